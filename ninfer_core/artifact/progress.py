"""Byte progress for the writer and `verify`: a rich bar on a terminal, sparse plain lines otherwise."""

from __future__ import annotations

import sys
import time


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


class ByteProgress:
    """Progress over `total_bytes` in `total_items` tensors, drawn on stderr.

    Disabled: silent. On a terminal: a rich bar (bytes, rate, time left). Otherwise (logs, pipes):
    one line per 10% so a 50 GB conversion shows it is alive without flooding the log.
    """

    def __init__(self, enabled: bool, description: str, total_bytes: int, total_items: int):
        self.enabled = enabled
        self.description = description
        self.total_bytes = max(int(total_bytes), 0)
        self.total_items = total_items
        self.done_bytes = 0
        self.done_items = 0
        self._rich = None
        self._task = None
        self._next_pct = 10
        self._t0 = time.monotonic()

    def __enter__(self) -> "ByteProgress":
        if not self.enabled:
            return self
        from rich.console import Console

        console = Console(stderr=True)
        if console.is_terminal:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._rich = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TextColumn("{task.fields[items]}"),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=console,
                transient=False,
            )
            self._rich.start()
            self._task = self._rich.add_task(
                self.description, total=self.total_bytes or 1, items=self._items_text()
            )
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None

    def _items_text(self) -> str:
        return f"{self.done_items}/{self.total_items} tensors"

    def advance(self, nbytes: int) -> None:
        self.done_bytes += nbytes
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, advance=nbytes)

    def item_done(self) -> None:
        self.done_items += 1
        if self._rich is not None:
            self._rich.update(self._task, items=self._items_text())
        elif self.enabled:
            self._maybe_line()

    def _maybe_line(self) -> None:
        if self._rich is not None:
            return
        if self.total_bytes:
            pct = 100 * self.done_bytes // self.total_bytes
        else:
            pct = 100 * self.done_items // max(self.total_items, 1)
        if pct < self._next_pct:
            return
        while self._next_pct <= pct:
            self._next_pct += 10
        elapsed = time.monotonic() - self._t0
        print(
            f"{self.description}: {pct}% ({self._items_text()}, {human_bytes(self.done_bytes)} of "
            f"{human_bytes(self.total_bytes)}, {elapsed:.0f}s)",
            file=sys.stderr,
            flush=True,
        )
