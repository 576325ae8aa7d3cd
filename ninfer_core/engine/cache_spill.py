"""`--auto-save-evicted` (spec "Slots"): a session last saved to or restored from a slot file is
written back to that file, on a background thread, before an involuntary eviction destroys it.

* The binding (`Continuation.filename`, `file_depth`) is set by an explicit save or restore and
  carried to the continuation that extends the conversation, so the file tracks its newest turn.
* A spill never replaces a file with a shallower copy of the session than the last save or restore
  recorded; at most two spills wait for the writer (a third is skipped and logged).
* An explicit save or erase of a file supersedes every spill of it still waiting; a restore first
  writes the waiting spills of the file it reads, so it reads the newest state. An explicit erase
  never writes.
* The operational log reports each spill, skip or failure (token counts and file names only).

The snapshot (pages and StateImages copied out of the engine) is taken on the engine thread before
the memory is released; encoding, the checksum and the temp-file-and-rename write run on the writer.
"""

from __future__ import annotations

import logging
import threading
import time

from ninfer_core.engine import cache_slots

log = logging.getLogger("ninfer.engine.cache")
MAX_WAITING = 2


class SlotSpiller:
    def __init__(self, directory: str, compat: dict | None = None):
        self.dir = directory
        self.compat = compat  # the slot route's compatibility facts (set by its first action)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._write_lock = threading.Lock()  # held while one spill is checked and written
        self._waiting: list[tuple[str, int, int, object]] = []  # (filename, depth, generation, image)
        self._writing: str | None = None
        self._generation: dict[str, int] = {}
        self._stop = False
        self.counters = {"spills": 0, "skipped": 0, "failed": 0, "superseded": 0}
        self._thread = threading.Thread(target=self._loop, name="ninfer-slot-spill", daemon=True)
        self._thread.start()

    # -- engine thread ------------------------------------------------------------------------------
    def spill(self, cache, cont) -> bool:
        """Queue a bound continuation that is about to be evicted; False when it is skipped."""
        name, depth = cont.filename, len(cont.session)
        if not name:
            return False
        if self.compat is None:
            return self._skip(name, depth, "no slot action has run yet to fix the file format")
        if depth < cont.file_depth:
            return self._skip(name, depth, f"shallower than the {cont.file_depth} tokens last saved or restored")
        with self._lock:
            if len(self._waiting) >= MAX_WAITING:
                return self._skip(name, depth, f"{MAX_WAITING} spills already wait for the writer", locked=True)
        try:
            image = cache_slots.snapshot_continuation(cache, cont, self.compat)
        except Exception as e:  # noqa: BLE001 - the eviction proceeds regardless
            with self._lock:
                self.counters["failed"] += 1
            log.warning("auto-save: reading the evicted session of %s failed: %s", name, e)
            return False
        with self._lock:
            self._waiting.append((name, depth, self._generation.get(name, 0), image))
            self._wake.notify_all()
        log.info("auto-save: spilling an evicted %d-token session to %s", depth, name)
        return True

    def _skip(self, name: str, depth: int, why: str, locked: bool = False) -> bool:
        if locked:
            self.counters["skipped"] += 1
        else:
            with self._lock:
                self.counters["skipped"] += 1
        log.info("auto-save: skipped spilling a %d-token session to %s: %s", depth, name, why)
        return False

    # -- slot route (host threads) ------------------------------------------------------------------
    def supersede(self, name: str) -> None:
        """An explicit save or erase of `name`: drop its waiting spills; one being written finishes
        first, and none queued earlier is written afterwards."""
        with self._write_lock, self._lock:
            self._generation[name] = self._generation.get(name, 0) + 1
            before = len(self._waiting)
            self._waiting = [w for w in self._waiting if w[0] != name]
            self.counters["superseded"] += before - len(self._waiting)

    def flush_file(self, name: str, timeout: float = 60) -> None:
        """Before a restore of `name`: wait until its waiting spills are written."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while any(w[0] == name for w in self._waiting) or self._writing == name:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._wake.wait(left)

    def flush(self, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._waiting or self._writing is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
        return True

    def close(self, timeout: float = 60) -> None:
        self.flush(timeout)
        with self._lock:
            self._stop = True
            self._wake.notify_all()

    def snapshot(self) -> dict:
        with self._lock:
            return {**self.counters, "waiting": len(self._waiting)}

    # -- writer -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._stop:
                    self._wake.wait()
                if self._stop and not self._waiting:
                    return
                name, depth, gen, image = self._waiting.pop(0)
                self._writing = name
            try:
                self._write(name, depth, gen, image)
            finally:
                with self._lock:
                    self._writing = None
                    self._wake.notify_all()

    def _write(self, name: str, depth: int, gen: int, image) -> None:
        try:
            data = cache_slots.encode(image)
            with self._write_lock:
                if self._generation.get(name, 0) != gen:
                    log.info("auto-save: the spill of %s was superseded by an explicit slot action", name)
                    return
                cache_slots.write_atomic(self.dir, name, data)
        except Exception as e:  # noqa: BLE001 - logged; the session is gone either way
            with self._lock:
                self.counters["failed"] += 1
            log.warning("auto-save: writing %s failed: %s", name, e)
            return
        with self._lock:
            self.counters["spills"] += 1
        log.info("auto-save: wrote an evicted %d-token session to %s (%d bytes)", depth, name, len(data))
