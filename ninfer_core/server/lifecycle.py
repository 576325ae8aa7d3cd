"""Stopping `ninfer serve` (spec "Stop the server").

- Ctrl+C twice: the first press only shows `Press Ctrl+C again within 5 s to close` (on the stats
  panel's bottom line, else as a warning line); a second press within those 5 s stops the server,
  otherwise the prompt goes away and serving continues. Before the server is ready one press
  ends startup at once. SIGTERM (and SIGHUP, a closed terminal) stops at once.
- Stopping refuses new connections (uvicorn closes its listeners), and every running and queued
  request ends with 503 service_unavailable, or an error event on a stream already started (the
  Engine's shutdown). The process logs `server stopped` and exits 0.
- One more Ctrl+C while stopping exits at once with status 130.
- An Engine that latches failed stops the server on its own; the exit status is then 2 (startup
  failures are 1), so a supervisor restarts the model instead of keeping a dead endpoint up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ninfer")

CONFIRM_WINDOW_S = 5.0
PROMPT = "Press Ctrl+C again within 5 s to close"


class StopControl:
    """The signal policy of one server process. `request_stop` is the one way to stop it."""

    def __init__(self, is_ready: Callable[[], bool], console: Any = None,
                 window_s: float = CONFIRM_WINDOW_S, force_exit: Callable[[int], None] = os._exit):
        self.is_ready = is_ready
        self.console = console
        self.window_s = window_s
        self._force_exit = force_exit
        self.stopping = threading.Event()
        self._pressed_at: float | None = None
        self._stoppers: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def on_stop(self, fn: Callable[[], None]) -> None:
        """Run `fn` when the server stops (at once when it already is stopping)."""
        with self._lock:
            self._stoppers.append(fn)
            now = self.stopping.is_set()
        if now:
            fn()

    def install(self) -> None:
        """Route SIGINT/SIGTERM/SIGHUP here from the start of startup (before uvicorn runs), so a
        Ctrl+C while loading stops cleanly instead of raising KeyboardInterrupt somewhere."""
        if threading.current_thread() is threading.main_thread():
            for s in _signals():
                signal.signal(s, lambda sig, frame: self.handle(sig))

    def handle(self, sig: int) -> None:
        if sig != signal.SIGINT:
            self.request_stop(f"{signal.Signals(sig).name} received")
            return
        if self.stopping.is_set():
            log.warning("second interrupt while stopping: exiting now")
            for h in logging.getLogger("ninfer").handlers:
                with contextlib.suppress(Exception):
                    h.flush()
            self._force_exit(130)
            return
        if not self.is_ready():
            self.request_stop("interrupted during startup")
            return
        now = time.monotonic()
        with self._lock:
            confirmed = self._pressed_at is not None and now - self._pressed_at <= self.window_s
            self._pressed_at = None if confirmed else now
        if confirmed:
            self._clear_prompt()
            self.request_stop("Ctrl+C pressed twice")
            return
        if self.console is not None:
            self.console.prompt(PROMPT)
        else:
            log.warning("%s", PROMPT)
        self._timer = threading.Timer(self.window_s, self._expire, args=(now,))
        self._timer.daemon = True
        self._timer.start()

    def _expire(self, pressed: float) -> None:
        with self._lock:
            if self._pressed_at != pressed:
                return
            self._pressed_at = None
        self._clear_prompt()

    def _clear_prompt(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.console is not None and getattr(self.console, "panel", None) is not None:
            self.console.prompt(None)

    def request_stop(self, why: str) -> None:
        with self._lock:
            if self.stopping.is_set():
                return
            self.stopping.set()
        log.info("stopping (%s)", why)
        with self._lock:
            stoppers = list(self._stoppers)
        for fn in stoppers:
            try:
                fn()
            except Exception:
                log.exception("while stopping")


def _signals() -> list[int]:
    sigs = [signal.SIGINT, signal.SIGTERM]
    if hasattr(signal, "SIGHUP"):
        sigs.append(signal.SIGHUP)
    if sys.platform == "win32" and hasattr(signal, "SIGBREAK"):
        sigs.append(signal.SIGBREAK)
    return sigs


def make_server(config: Any, control: StopControl):
    """uvicorn's Server, its signals routed through `control` (uvicorn's own would stop at once)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {s: signal.signal(s, lambda sig, frame: control.handle(sig)) for s in _signals()}
            try:
                yield
            finally:
                for s, h in previous.items():
                    signal.signal(s, h)

    server = Server(config)
    control.on_stop(lambda: setattr(server, "should_exit", True))
    return server
