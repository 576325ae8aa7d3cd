"""llama.cpp's streaming observations: `timings_per_token` snapshots and `return_progress` events.

Spec ("llama.cpp-compatible request observations"). The engine publishes exact timings only on the
finish event; between events a stream observes its own request on the HTTP side: admission (the
"admitted" event fixes the reused prefix), each committed prefill unit (the "progress" events a
request with `progress` gets) and each delta's committed tokens.

* `snapshot()` is the cumulative timings object. While the prompt is processed it is prompt-only:
  the predicted_* fields are zero, prompt_ms is the wall time since admission and the prompt rates
  span the processed suffix (processed - cache). Once the first output token is committed the
  prompt phase is closed (prompt_n is the whole suffix) and generation uses max(predicted_n - 1, 0)
  token intervals. Rates of empty or instantaneous phases are zero, never NaN or infinity.
* `progress()` is a prompt_progress object {"total", "cache", "processed", "time_ms"}: processed
  never moves backwards, the first has processed == cache and the last processed == total.
"""

from __future__ import annotations

import time


def _rate(n: float, ms: float) -> float:
    return n * 1000.0 / ms if n and ms > 0 else 0.0


def _per_token(ms: float, n: float) -> float:
    return ms / n if n and ms > 0 else 0.0


class StreamTimings:
    """One streamed request's live timings and prompt progress."""

    def __init__(self, prompt_tokens: int, clock=time.monotonic):
        self._now = clock
        self.total = prompt_tokens
        self.cache = 0
        self.processed = 0
        self.predicted_n = 0
        self.t_admit: float | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None

    def admitted(self, cached: int) -> None:
        self.t_admit = self._now()
        self.cache = self.processed = max(0, cached)

    def progressed(self, processed: int) -> None:
        self.processed = min(self.total, max(self.processed, processed))

    def tokens(self, n: int) -> None:
        """A delta committed `n` output tokens (the first closes the prompt phase)."""
        now = self._now()
        if self.t_admit is None:
            self.t_admit = now
        if n and self.t_first is None:
            self.t_first = now
            self.processed = self.total
        if n:
            self.t_last = now
        self.predicted_n += n

    @property
    def prompt_done(self) -> bool:
        return self.t_first is not None

    def prompt_ms(self) -> float:
        if self.t_admit is None:
            return 0.0
        return ((self.t_first if self.t_first is not None else self._now()) - self.t_admit) * 1000.0

    def snapshot(self) -> dict:
        prompt_ms = self.prompt_ms()
        prompt_n = max(0, (self.total if self.prompt_done else self.processed) - self.cache)
        if self.prompt_done:
            predicted_ms = ((self.t_last or self.t_first) - self.t_first) * 1000.0
        else:
            predicted_ms = 0.0
        intervals = max(self.predicted_n - 1, 0)
        return {"cache_n": self.cache, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": _per_token(prompt_ms, prompt_n),
                "prompt_per_second": _rate(prompt_n, prompt_ms),
                "predicted_n": self.predicted_n, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": _per_token(predicted_ms, intervals),
                "predicted_per_second": _rate(intervals, predicted_ms)}

    def progress(self, final: bool = False) -> dict:
        """The prompt_progress object; `final` (the prompt is done) moves processed to total."""
        if final:
            self.processed = self.total
        processed = self.processed
        return {"total": self.total, "cache": self.cache, "processed": processed,
                "time_ms": int(self.prompt_ms()) if processed > self.cache else 0}
