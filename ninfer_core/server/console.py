"""The console log of `ninfer serve` (spec "Server options", "Structured request log"): stderr lines
`[YYYY-MM-DD HH:MM:SS.mmm] [level] message` in local time, `--log-level` filtering, `--log-colours`,
the aggregate throughput line every `--log-stats-interval-ms`, and with `--log-stats-panel on` a
session statistics panel pinned beneath the log on an interactive terminal (rich's Live display).

Engine diagnostics are ordinary records whose message starts `engine |`. No line carries a prompt,
an output or an API key: requests are logged by id, route, status and counts only.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR, "critical": logging.CRITICAL, "off": logging.CRITICAL + 10}
_LEVEL_NAMES = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning", logging.ERROR: "error",
                logging.CRITICAL: "critical"}
_LEVEL_COLOURS = {logging.DEBUG: "\x1b[2m", logging.INFO: "\x1b[32m", logging.WARNING: "\x1b[33m",
                  logging.ERROR: "\x1b[31m", logging.CRITICAL: "\x1b[1;31m"}
# A stable colour per statistic of the throughput line (spec --log-colours).
STAT_COLOURS = {"prefill": "\x1b[36m", "decode": "\x1b[35m", "batch": "\x1b[34m", "reused": "\x1b[32m",
                "running": "\x1b[33m", "waiting": "\x1b[33m", "done": "\x1b[32m", "failed": "\x1b[31m",
                "recoveries": "\x1b[31m"}
RESET = "\x1b[0m"


class ConsoleFormatter(logging.Formatter):
    def __init__(self, colours: bool):
        super().__init__()
        self.colours = colours

    def format(self, record: logging.LogRecord) -> str:
        t = time.localtime(record.created)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", t) + f".{int(record.msecs):03d}"
        level = _LEVEL_NAMES.get(record.levelno, record.levelname.lower())
        if self.colours:
            level = f"{_LEVEL_COLOURS.get(record.levelno, '')}{level}{RESET}"
        text = f"[{stamp}] [{level}] {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def colours_wanted(option: bool | None, stream: Any = None) -> bool:
    """--log-colours on|off; unset: on for a terminal. A redirected stream is always plain."""
    stream = stream or sys.stderr
    tty = bool(getattr(stream, "isatty", lambda: False)())
    return tty and (option is None or option)


class Console:
    """The logging setup of one `ninfer serve` process: handler, formatter, optional panel."""

    def __init__(self, level_name: str, colours: bool | None = None, panel: bool = False, stream: Any = None):
        self.stream = stream or sys.stderr
        self.colours = colours_wanted(colours, self.stream)
        self.level = LEVELS.get(level_name, logging.INFO)
        self.panel: StatsPanel | None = None
        interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        if panel and interactive:
            self.panel = StatsPanel(self.stream, self.colours)
        root = logging.getLogger("ninfer")
        root.setLevel(self.level)
        for h in list(root.handlers):
            if getattr(h, "_ninfer_console", False):
                root.removeHandler(h)
        handler = self.panel.handler() if self.panel is not None else logging.StreamHandler(self.stream)
        handler.setFormatter(ConsoleFormatter(self.colours))
        handler._ninfer_console = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.propagate = False

    def prompt(self, text: str | None) -> None:
        """The bottom-line prompt (Ctrl+C): on the panel, else a warning line; None clears it."""
        if self.panel is not None:
            self.panel.set_prompt(text)
        elif text:
            logging.getLogger("ninfer").warning("%s", text)

    def close(self) -> None:
        if self.panel is not None:
            self.panel.stop()


# -- the throughput line and the panel --------------------------------------------------------------

_KEYS = ("computed_prefill_tokens", "prefill_seconds", "committed_decode_tokens", "decode_seconds", "decode_rounds",
         "decode_row_rounds", "requests_completed", "requests_failed", "requests_timed_out", "requests_cancelled",
         "engine_recoveries")


def _counters(snap: dict) -> dict[str, float]:
    c = snap.get("counters") if isinstance(snap.get("counters"), dict) else {}
    out = {k: float(c.get(k, 0) or 0) for k in _KEYS}
    cc = snap.get("context_cache") if isinstance(snap.get("context_cache"), dict) else {}
    out["reused_prompt_tokens"] = float(cc.get("reused_prompt_tokens", 0) or 0)
    return out


def stats_fields(d: dict[str, float], snap: dict, seconds: float) -> list[tuple[str, str]]:
    """(statistic, text) pairs of one interval: token counts and rates, batch size, requests, queue."""
    rounds = d["decode_rounds"]
    out = [("prefill", f"{d['computed_prefill_tokens']:.0f} tok ({d['computed_prefill_tokens'] / seconds:.1f}/s)"),
           ("decode", f"{d['committed_decode_tokens']:.0f} tok ({d['committed_decode_tokens'] / seconds:.1f}/s)"),
           ("batch", f"{d['decode_row_rounds'] / rounds:.2f}" if rounds else "-"),
           ("reused", f"{d['reused_prompt_tokens']:.0f} tok"),
           ("done", f"{d['requests_completed']:.0f}"),
           ("failed", f"{d['requests_failed'] + d['requests_timed_out']:.0f}"),
           ("running", str(int(snap.get("lanes_active", 0) or 0))),
           ("waiting", str(int(snap.get("pending", 0) or 0)))]
    if d["engine_recoveries"]:
        out.append(("recoveries", f"{d['engine_recoveries']:.0f}"))
    return out


class StatsReporter:
    """Every `interval_s`, one `stats |` line with the interval's activity (idle intervals are
    skipped), and the panel's totals refreshed."""

    def __init__(self, engine: Any, interval_s: float, console: Console, label: str | None = None):
        self.engine, self.interval_s, self.console = engine, interval_s, console
        self.label = label  # a router's model name: `stats NAME | ...`
        self.log = logging.getLogger("ninfer.stats")
        self._stop = threading.Event()
        self._prev = _counters(self._snap())
        self._t_prev = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="ninfer-stats-line", daemon=True)

    def _snap(self) -> dict:
        try:
            return dict(self.engine.snapshot() or {})
        except Exception:  # noqa: BLE001 - a stopped engine has nothing to report
            return {}

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.report()

    def report(self) -> str | None:
        snap = self._snap()
        if not snap:
            return None
        now = _counters(snap)
        t = time.monotonic()
        d = {k: now[k] - self._prev.get(k, 0.0) for k in now}
        seconds, self._t_prev, self._prev = max(t - self._t_prev, 1e-9), t, now
        if self.console.panel is not None:
            self.console.panel.update(now, snap)
        busy = snap.get("lanes_active") or snap.get("pending")
        if not any(v for k, v in d.items() if not k.endswith("_seconds")) and not busy:
            return None
        fields = stats_fields(d, snap, seconds)
        colours = self.console.colours
        text = ("stats | " if self.label is None else f"stats {self.label} | ") + ", ".join(
            f"{k} {STAT_COLOURS.get(k, '')}{v}{RESET}" if colours else f"{k} {v}" for k, v in fields)
        self.log.info("%s", text)
        return text


class StatsPanel:
    """The session statistics table pinned beneath the log (rich Live on stderr); log records are
    printed above it, and the Ctrl+C prompt on its bottom line."""

    def __init__(self, stream: Any, colours: bool):
        from rich.console import Console as RichConsole
        from rich.live import Live

        self.console = RichConsole(file=stream, force_terminal=True, no_color=not colours, highlight=False)
        self._totals: dict[str, float] = {}
        self._snap: dict = {}
        self._prompt: str | None = None
        self._t0 = time.monotonic()
        self.live = Live(self._render(), console=self.console, refresh_per_second=2, transient=True,
                         redirect_stdout=False, redirect_stderr=False, get_renderable=self._render)
        self.live.start()

    def _render(self):
        from rich.console import Group
        from rich.text import Text

        t, snap = self._totals, self._snap
        line = Text.assemble(("ninfer", "bold"), f" up {time.monotonic() - self._t0:.0f} s | ",
                             f"prefill {t.get('computed_prefill_tokens', 0):.0f} tok | ",
                             f"decode {t.get('committed_decode_tokens', 0):.0f} tok | ",
                             f"reused {t.get('reused_prompt_tokens', 0):.0f} tok | ",
                             f"done {t.get('requests_completed', 0):.0f} | ",
                             f"running {int(snap.get('lanes_active', 0) or 0)} | ",
                             f"waiting {int(snap.get('pending', 0) or 0)}")
        if self._prompt:  # the bottom line, beneath the statistics
            return Group(line, Text(self._prompt, style="bold yellow"))
        return line

    def update(self, totals: dict[str, float], snap: dict) -> None:
        self._totals, self._snap = totals, snap

    def set_prompt(self, text: str | None) -> None:
        self._prompt = text
        self.live.refresh()

    def handler(self) -> logging.Handler:
        panel = self

        class _PanelHandler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                from rich.text import Text

                try:  # the formatted line may carry ANSI colours: rich reads them, not prints them
                    panel.console.print(Text.from_ansi(self.format(record)), soft_wrap=True)
                except Exception:  # noqa: BLE001 - logging must never raise
                    self.handleError(record)

        return _PanelHandler()

    def stop(self) -> None:
        try:
            self.live.stop()
        except Exception:  # the terminal may be gone at exit
            logging.getLogger("ninfer").debug("stopping the stats panel failed", exc_info=True)
