"""One request inside the engine (`Sequence`) and the caller's view of it (`RequestHandle`)."""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable

from ninfer_core.engine.api import EngineEvent, GenerationRequest
from ninfer_core.engine.spec import SpecStats

if TYPE_CHECKING:
    from ninfer_core.engine.detok import OutputText
    from ninfer_core.engine.sampler import SamplerState


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # in the FIFO, holds nothing
    PREFILL = "prefill"  # admitted to a lane (pages + slot), prompt not fully processed
    DECODE = "decode"  # in the decode batch
    FINISHED = "finished"  # resources released, terminal event posted


TERMINAL_KINDS = ("finish", "error")


class RequestHandle:
    """What `Engine.submit` returns: an async stream of EngineEvents and a cancel switch.

    The worker thread delivers events onto the loop that submitted (`loop.call_soon_threadsafe`):
    one event with `post`, or every lane's events of a decode round at once with `post_batch` (one
    wakeup of each loop per round, not one per token). They wait in a deque; `events()` reads them
    one by one, `events().batches(keepalive_s)` as lists of everything already delivered. The
    stream ends after the "finish" or "error" event.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 cancel: Callable[[], None], prompt_tokens: int, max_tokens: int):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens  # the effective output limit the engine runs with
        self._loop = loop
        self._items: collections.deque[EngineEvent] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._cancel = cancel
        self._done = False
        # Sees every event as it is delivered, on the loop, whether or not a stream still reads
        # (the server's request log, ninfer_core.server.request_log).
        self.observer: Callable[[EngineEvent], None] | None = None

    def post(self, event: EngineEvent) -> None:
        """Deliver an event from any thread; a closed loop means nobody is listening any more."""
        try:
            self._loop.call_soon_threadsafe(self._deliver, (event,))
        except RuntimeError:
            pass

    def _deliver(self, events) -> None:  # on the loop
        self._items.extend(events)
        if self.observer is not None:
            for event in events:
                self.observer(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self, timeout: float | None) -> None:
        """Until something is delivered, or `timeout` seconds pass (None: no limit)."""
        waiter = self._waiter
        if waiter is None or waiter.done():
            waiter = self._waiter = self._loop.create_future()
        timer = None if timeout is None else self._loop.call_later(timeout, _time_out, waiter)
        try:
            await waiter
        finally:
            if self._waiter is waiter:
                self._waiter = None
            if timer is not None:
                timer.cancel()

    def events(self) -> EventStream:
        return EventStream(self)

    def cancel(self) -> None:
        """Thread-safe and idempotent; the worker releases the request at its next boundary."""
        self._cancel()


def _time_out(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def post_batch(items: list[tuple[RequestHandle, EngineEvent]]) -> None:
    """Deliver (handle, event) pairs in order from the worker thread with one wakeup per loop."""
    if not items:
        return
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for handle, event in items:
        by_loop.setdefault(handle._loop, []).append((handle, event))
    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver_pairs, pairs)
        except RuntimeError:  # that loop is closed: nobody is listening any more
            pass


def _deliver_pairs(pairs) -> None:  # on the loop
    for handle, event in pairs:
        handle._deliver((event,))


class EventStream:
    """A handle's events as an async iterator (ends after the terminal event). `batches` yields
    lists of all events already delivered, or None after `keepalive_s` seconds without one."""

    def __init__(self, handle: RequestHandle):
        self._h = handle

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> EngineEvent:
        h = self._h
        if h._done:
            raise StopAsyncIteration
        while not h._items:
            await h._wait(None)
        event = h._items.popleft()
        if event.kind in TERMINAL_KINDS:
            h._done = True
        return event

    async def aclose(self) -> None:
        pass

    async def batches(self, keepalive_s: float | None) -> AsyncIterator[list[EngineEvent] | None]:
        h = self._h
        while not h._done:
            if not h._items:
                await h._wait(keepalive_s)
                if not h._items:
                    yield None
                    continue
            batch = []
            items = h._items
            while items:
                event = items.popleft()
                batch.append(event)
                if event.kind in TERMINAL_KINDS:
                    h._done = True
                    break
            yield batch


class Sequence:
    """Engine-side state of one request: budget, lane resources, progress and output."""

    def __init__(self, request: GenerationRequest, request_id: str, max_tokens: int, at_context: bool,
                 entitlement_pages: int, sampler: "SamplerState", output: "OutputText",
                 handle: RequestHandle | None = None, order: int = 0):
        self.request = request
        self.request_id = request_id
        self.prompt_ids = list(request.prompt_ids)
        self.max_tokens = max_tokens
        self.at_context = at_context
        self.entitlement_pages = entitlement_pages
        self.deadline = request.deadline
        self.sampler = sampler
        self.output = output
        self.handle = handle
        self.order = order  # submission order, the FIFO and tie-break key

        self.status = SeqStatus.WAITING
        self.pages: list[int] = []
        self.slot: int | None = None
        self.num_cached = 0  # positions already in the KV pages and the state slot
        self.output_ids: list[int] = []
        self.unsent_ids: list[int] = []  # committed tokens not yet carried by a delta event
        self.passed_over = 0  # prefill units given to another staged lane since this one last ran
        self.cancel_requested = False
        self.unsent_logprobs: list = []  # (TokenLogprob, its first char offset) not yet in a delta
        self.thinking = None  # ThinkingControl, set by the engine
        # Context cache: hints of reusable frontiers, the admission's reuse plan, reused tokens.
        self.hints = getattr(request, "checkpoint_hints", None)
        self.cache_plan = None
        self.cache_n = 0
        # Speculative decoding: counters, and the lane's n-gram drafting state (engine.ngram)
        self.spec = SpecStats()
        self.drafter = None
        # Media: the embeddings of spans encoded for this prefill ({span index: tensor}), and what
        # encoding cost this request (a prefix reused from the cache encodes nothing)
        self.media_embeds: dict | None = None
        self.media_jobs: dict = {}  # id(item) -> the encode's future while it runs (media_side.MediaEncodes)
        self.vision_encodes = 0
        self.vision_seconds = 0.0
        self.vision_windows: list[dict] = []  # the overlay windows this request's encodes opened

        self.t_submit = time.monotonic()
        self.t_admit: float | None = None
        self.t_first: float | None = None  # first output token committed (or prompt done)
        self.t_last: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prompt_remaining(self) -> int:
        return len(self.prompt_ids) - self.num_cached

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    def post(self, event: EngineEvent) -> None:
        if self.handle is not None:
            self.handle.post(event)

    def timings(self) -> dict:
        """llama.cpp-style timings (spec "llama.cpp-compatible request observations"); zero rates
        instead of NaN or infinity for empty or instantaneous phases."""
        prompt_n = max(0, min(self.num_cached, self.prompt_len) - self.cache_n)
        prompt_ms = ((self.t_first or self.t_admit or 0.0) - (self.t_admit or 0.0)) * 1000.0
        predicted_n = len(self.output_ids)
        predicted_ms = ((self.t_last or 0.0) - (self.t_first or 0.0)) * 1000.0 if predicted_n else 0.0
        intervals = max(predicted_n - 1, 0)

        def rate(n, ms):
            return n * 1000.0 / ms if n and ms > 0 else 0.0

        def per_token(ms, n):
            return ms / n if n and ms > 0 else 0.0

        out = {
            "cache_n": self.cache_n,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": per_token(prompt_ms, prompt_n),
            "prompt_per_second": rate(prompt_n, prompt_ms),
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": per_token(predicted_ms, intervals),
            "predicted_per_second": rate(intervals, predicted_ms),
        }
        if self.request.media is not None:  # media items, and how many of them this request encoded
            out["media_n"] = len(self.request.media.items)
            out["vision_encodes"] = self.vision_encodes
            out["vision_ms"] = self.vision_seconds * 1000.0
        if self.spec.rounds:  # spec: draft_n / draft_n_accepted when draft work occurred
            out["draft_n"] = self.spec.drafted
            out["draft_n_accepted"] = self.spec.accepted
        return out
