"""What the Engine's worker does when an iteration fails (spec "Startup readiness", "Stop the server").

- Out of memory (torch's OutOfMemoryError, MemoryError), and with --recover-invariant-failures a
  broken internal invariant (any other exception raised outside one request's forward): fail only
  the requests holding lanes (running or being admitted), wait for the device, release the
  context cache's retained owners, and keep serving the queue. Each recovery counts in
  `engine_recoveries` (ninfer:engine_recoveries_total, the request log's throughput record).
- Any other worker failure, a recovery that cannot complete, or the eighth recovery in a row
  without a completed unit (a prefill chunk or a decode round) in between: the Engine latches
  failed. Every queued request fails with 503 engine_failed, every new one is refused, and the
  listeners (the server, which then exits with status 2) are told.

A forward's own failure already fails only its requests (Engine._fail); an out-of-memory one is
noted there and recovered after the iteration, so the cache is released the same way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ninfer_core.engine.api import EngineError

log = logging.getLogger("ninfer.engine")

MAX_CONSECUTIVE = 8


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    # older CUDA paths raise a plain RuntimeError with this text
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class Recovery:
    """The failure policy of one Engine; its state is touched by the worker thread (and read by
    `submit`/`snapshot` under the engine lock)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.failure: str | None = None  # set once the engine latched failed
        self.consecutive = 0
        self._units_at_last: float | None = None
        self._noted_oom: BaseException | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._lock = threading.Lock()

    # -- the server's side ------------------------------------------------------------------------
    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Call `listener(reason)` once the engine latched failed (at once when it already has)."""
        with self._lock:
            failed = self.failure
            if failed is None:
                self._listeners.append(listener)
        if failed is not None:
            listener(failed)

    @staticmethod
    def error_for(exc: BaseException) -> EngineError | None:
        """The request error of an out-of-memory failure (503: it passes), else None."""
        if not is_out_of_memory(exc):
            return None
        return EngineError(503, "out_of_memory", "The server ran out of memory while running this request; it "
                           "recovered and serves on. Retry shortly.", type_="service_unavailable")

    def refusal(self) -> EngineError:
        return EngineError(503, "engine_failed", f"The engine failed and serves no more requests: {self.failure}",
                           type_="service_unavailable")

    # -- the worker's side ------------------------------------------------------------------------
    def note(self, exc: BaseException) -> None:
        """A request failed with `exc`: an out-of-memory failure is recovered after the iteration."""
        if self._noted_oom is None and is_out_of_memory(exc):
            self._noted_oom = exc

    def after_iteration(self) -> bool:
        """False once the engine latched failed."""
        exc, self._noted_oom = self._noted_oom, None
        if exc is None:
            return True
        return self._recover(exc, "out of memory")

    def on_iteration_error(self, exc: BaseException) -> bool:
        """The worker's iteration raised `exc`; False once the engine latched failed."""
        self._noted_oom = None
        if is_out_of_memory(exc):
            return self._recover(exc, "out of memory")
        if self.engine.options.recover_invariant_failures:
            return self._recover(exc, "a broken invariant")
        log.error("engine | worker failure: %s: %s", type(exc).__name__, exc)
        self.latch(f"{type(exc).__name__}: {exc}")
        return False

    def _units(self) -> float:
        c = self.engine.counters
        return float(c.get("decode_rounds", 0)) + float(c.get("computed_prefill_tokens", 0))

    def _recover(self, exc: BaseException, what: str) -> bool:
        eng = self.engine
        units = self._units()
        self.consecutive = self.consecutive + 1 if units == self._units_at_last else 1
        self._units_at_last = units
        with eng._cv:
            eng.counters["engine_recoveries"] += 1
            lanes = list(eng.scheduler.lanes)
        if what == "out of memory":
            err = self.error_for(exc)
        else:
            err = EngineError(500, "internal_error", f"Internal server error: {type(exc).__name__}",
                              type_="server_error")
        if self.consecutive >= MAX_CONSECUTIVE:
            log.error("engine | %d recoveries in a row without a completed unit (%s: %s): failing every pending "
                      "request", self.consecutive, type(exc).__name__, exc)
            self.latch(f"{self.consecutive} consecutive recoveries ({what})")
            return False
        log.warning("engine | recovering from %s (%s: %s): failing %d running request(s), releasing the context "
                    "cache; recovery %d in a row", what, type(exc).__name__, exc, len(lanes), self.consecutive)
        try:
            for seq in lanes:
                eng._fail(seq, err)
            self._noted_oom = None  # the failures above are this recovery's own
            _wait_for_device(eng)
            if eng.cache is not None:
                with eng._cv:
                    eng.cache.clear()
        except Exception as again:  # noqa: BLE001 - a recovery that cannot complete latches the engine
            log.error("engine | the recovery failed: %s: %s", type(again).__name__, again)
            self.latch(f"recovery from {what} failed: {type(again).__name__}: {again}")
            return False
        log.warning("engine | recovered from %s; serving the queue", what)
        return True

    def latch(self, reason: str) -> None:
        """Fail the engine for good: every request it holds or queues fails, new ones are refused."""
        eng = self.engine
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            listeners, self._listeners = self._listeners, []
        for listener in listeners:  # first, so the server is stopping before a client hears of it
            try:
                listener(reason)
            except Exception:
                log.exception("engine failure listener")
        err = self.refusal()
        with eng._cv:
            seqs = list(eng.scheduler.lanes) + list(eng.scheduler.waiting)
        for seq in seqs:
            eng._fail(seq, err)


def _wait_for_device(eng: Any) -> None:
    """Let the device finish what was launched and give the failed lanes' cached blocks back."""
    device = getattr(eng.options, "device", "cpu")
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
