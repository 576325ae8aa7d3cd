"""The Engine: one worker thread that owns every model call for one loaded model.

Each loop iteration is a boundary (cancellations, queue timeouts, admission), then decode rounds
over every decode-ready lane as one batched forward, then one prefill chunk of the staged lane.
`submit`, `cancel` and `snapshot` only touch bookkeeping under the engine lock, so the HTTP event
loop never waits on a forward. The prefill unit is `engine_prefill`'s, the decode rounds
`rounds`', the snapshot and the finish event `engine_report`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
import uuid
from typing import Any

from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import EngineError, EngineEvent, GenerationRequest, Usage
from ninfer_core.engine.budget import BudgetPolicy
from ninfer_core.engine.cache import build_context_cache, derive_hints
from ninfer_core.engine.cache_lease import build_page_leases, lease_window_tokens
from ninfer_core.engine.detok import OutputText
from ninfer_core.engine.engine_prefill import prefill_chunk
from ninfer_core.engine.engine_report import COUNTERS, UNIT_COUNTERS, finish_event, lane_tokens, snapshot
from ninfer_core.engine.media_side import MediaEncodes
from ninfer_core.engine.model_api import (
    PAGE_SIZE,
    ModelRunner,
    RunnerOptions,
)
from ninfer_core.engine.pages import PagePool
from ninfer_core.engine.recovery import Recovery
from ninfer_core.engine.request import RequestHandle, Sequence, SeqStatus, post_batch
from ninfer_core.engine.rounds import RoundDriver
from ninfer_core.engine.sampler import SamplerState
from ninfer_core.engine.scheduler import Scheduler
from ninfer_core.engine.slots import SlotPool
from ninfer_core.engine.thinking import ThinkingControl
from ninfer_core.structured.masks import MaskStage

log = logging.getLogger("ninfer.engine")


class Engine:
    """Serves GenerationRequests on one ModelRunner; see `ninfer_core.engine.api.EngineClient`."""

    def __init__(self, runner: ModelRunner, tokenizer, options: EngineOptions, spec=None,
                 prefix_cache=build_context_cache, kv_dtype=None, vision=None):
        """`spec`: a loaded `ninfer_core.engine.spec.SpecBackend` (`--spec`), or None; `vision`: a
        loaded `ninfer_core.media.api.VisionResidency` (`--vision`), or None.

        `prefix_cache`: the builder a `ninfer_register_prefix_caches` registration names,
        `(runner, pages, options, state_bytes, page_size) -> cache or None`; None serves every
        request from root. `kv_dtype`: the object `--kv-dtype` resolved to (None: the runner's
        native format); the runner gets it in `RunnerOptions.kv_dtype`."""
        if not 1 <= options.max_concurrency <= 8:
            raise ValueError(f"max_concurrency must be in 1..8, got {options.max_concurrency}")
        self.runner = runner
        self.vision = vision
        # media encodes run beside other lanes' decode before the prefill unit needing them
        # (ninfer_core.engine.media_side.MediaEncodes; snapshot "vision")
        self.vision_counters = {"encodes": 0, "encoded_tokens": 0, "encode_seconds": 0.0}
        self.media_encodes = MediaEncodes(self) if vision is not None else None
        self.tokenizer = tokenizer
        self.options = options
        self.spec = spec
        self.kv_dtype = kv_dtype
        self.page_size = PAGE_SIZE
        ngram = options.ngram_options(spec.draft_tokens if spec is not None else 0)
        widths = set(spec.verify_widths if spec is not None else ())
        if ngram.enabled:
            widths.update(range(2, 2 + max(ngram.draft_tokens, ngram.lookup_drafts if ngram.lookup else 0)))
        # a runner that holds a media item whole in one forward may get a chunk as long as the largest item
        whole_item = int(getattr(vision, "max_item_tokens", 0) or 0) if getattr(runner, "whole_media_spans", False) else 0
        runner.configure(RunnerOptions(cuda_graph=options.cuda_graph, verify_widths=tuple(sorted(widths)),
                                       max_lanes=options.max_concurrency, kv_dtype=kv_dtype,
                                       max_segment_tokens=max(options.prefill_chunk, max(widths, default=1),
                                                              whole_item)))
        self.cache_spec = runner.cache_spec()
        from ninfer_core.engine.kv_sizing import pool_pages

        # --kv-capacity auto counts the cache spec's bytes per token (the --kv-dtype's real size)
        self.pool_pages = pool_pages(options, self.cache_spec, getattr(runner, "device", "cpu"), self.page_size)
        if options.kv_capacity == "auto":
            log.info("--kv-capacity auto: %d tokens (%d bytes per token)", self.pool_pages * self.page_size,
                     self.cache_spec.kv_bytes_per_token)
        pool = PagePool(self.pool_pages, self.page_size)
        # Context cache (spec "Execution behavior"): None with --no-prefix-reuse or a runner that
        # cannot capture state; its Device checkpoint slots are runner slots past the lanes.
        self.cache = (prefix_cache(runner, pool, options, self.cache_spec.state_bytes, self.page_size)
                      if prefix_cache is not None else None)
        extra_slots = self.cache.device_slots_total if self.cache is not None else 0
        runner.allocate_cache(self.pool_pages, options.max_concurrency + extra_slots, self.page_size)
        self.scheduler = Scheduler(options.max_concurrency, pool, SlotPool(options.max_concurrency),
                                   cache=self.cache)
        self.budget = BudgetPolicy(options.max_context, options.max_concurrency, self.pool_pages,
                                   self.page_size, options.default_max_tokens,
                                   lease_window_tokens(options) if options.kv_lease_growth else None)
        # Pages a lane receives after admission (own-pages leases, --kv-lease-growth): grown at boundaries.
        self.leases = build_page_leases(pool, self.cache, options)
        self.capacity = options.max_concurrency + options.max_pending_requests
        eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
        eos.update(runner.info.eos_token_ids or ())
        self.eos_token_ids = frozenset(eos)
        self.decode_rounds = options.resolved_decode_rounds()
        self.kv_bytes = self.pool_pages * self.page_size * self.cache_spec.kv_bytes_per_token
        self.state_bytes = options.max_concurrency * self.cache_spec.state_bytes
        log.info("engine: %d lanes, KV pool %d pages x %d tokens (%.1f MiB), %d state slots (%.1f MiB)",
                 options.max_concurrency, self.pool_pages, self.page_size, self.kv_bytes / 2**20,
                 options.max_concurrency, self.state_bytes / 2**20)

        self._cv = threading.Condition(threading.Lock())
        if vision is not None and hasattr(vision, "attach"):  # an overlay residency borrows its windows from free KV pages
            vision.attach(pool, runner, self._cv)
        self._outstanding = 0  # submitted and not yet ended: the lifetime capacity in use
        self._cancelled: list[Sequence] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._order = itertools.count()
        self.counters = dict.fromkeys(COUNTERS + UNIT_COUNTERS, 0)
        self._n_tokens_max = 0  # longest sequence (prompt + output) an ended request reached (/metrics)
        self._controls: list = []  # (fn, concurrent.futures.Future) run by the worker at a boundary
        # Events the worker produced, delivered together by `_flush` (one wakeup of each event loop
        # per decode round instead of one per token). Worker thread only. A runner whose forwards
        # only launch device work (CUDA) gets a round's events once the next forward is launched,
        # so the server turns them into HTTP chunks while the device computes, instead of holding
        # the GIL while the worker prepares that launch; others get them at the end of the round.
        self._outbox: list = []
        self._flush_after_launch = bool(runner.launches_async)
        self._launches = 0  # forwards run so far (worker thread only)
        self.rounds = RoundDriver(self, spec, ngram)
        # Structured output: constrained requests' masks on host threads (ninfer_core.structured.masks)
        self._masks = MaskStage()
        # Worker failures: recover (out of memory; invariants with --recover-invariant-failures) or
        # latch failed (ninfer_core.engine.recovery)
        self.recovery = Recovery(self)
        # Model suspend (ninfer_core.router.residency): while held the worker starts nothing, so no
        # forward touches the device memory a suspend released; work submitted meanwhile waits.
        self._held = False

    # -- client side (any thread; submit from an asyncio loop) ---------------------------------
    def start(self) -> None:
        with self._cv:
            if self._thread is not None:
                return
            if self._stopping:
                raise RuntimeError("engine was shut down")
            self._thread = threading.Thread(target=self._worker, name="ninfer-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the worker; waiting and running requests end with 503 "server is shutting down"."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if thread is None:
            self._fail_all_on_shutdown()
        self._masks.shutdown()
        if self.media_encodes is not None:
            self.media_encodes.shutdown()

    def default_output_limit(self, prompt_tokens: int) -> int:
        return self.budget.default_output_limit(prompt_tokens)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises EngineError for a prompt that can never run (400) or a full
        capacity (429). Call from inside the asyncio loop that will read the events."""
        loop = asyncio.get_running_loop()
        if request.media is not None and self.vision is None:
            raise EngineError(400, "vision_disabled", "This server was started without --vision; image and video "
                              "input is not accepted.")
        budget = self.budget.resolve(len(request.prompt_ids), request.max_tokens)
        request_id = request.request_id or uuid.uuid4().hex
        sampler = SamplerState.create(request.sampling, force_greedy=self.options.greedy,
                                      default_seed=self.options.seed)
        seq = Sequence(request, request_id, budget.max_tokens, budget.at_context, budget.entitlement_pages,
                       sampler, OutputText(self.tokenizer, request.stop))
        if seq.hints is None and self.cache is not None:
            seq.hints = derive_hints(self.tokenizer, seq.prompt_ids)
        seq.thinking = ThinkingControl(request, budget.max_tokens)
        if seq.deadline is None:  # the server normally sets it from the request's arrival
            seq.deadline = seq.t_submit + self.options.pending_timeout_ms / 1000.0
        seq.handle = RequestHandle(request_id, loop, lambda: self._cancel(seq), seq.prompt_len,
                                   budget.max_tokens)
        with self._cv:
            if self.recovery.failure is not None:
                raise self.recovery.refusal()
            if self._stopping:
                raise EngineError(503, "service_unavailable", "server is shutting down")
            if self._outstanding >= self.capacity:
                self.counters["requests_rejected"] += 1
                raise EngineError(
                    429, "server_overloaded",
                    f"the server is at capacity ({self.options.max_concurrency} running + "
                    f"{self.options.max_pending_requests} pending requests); retry later")
            self._outstanding += 1
            self._masks.prefetch(request.constraint)  # the first mask, computed while the prompt prefills
            seq.order = next(self._order)
            self.scheduler.add(seq)
            self._cv.notify_all()
        return seq.handle

    def _cancel(self, seq: Sequence) -> None:
        with self._cv:
            if seq.cancel_requested or seq.status is SeqStatus.FINISHED:
                return
            seq.cancel_requested = True
            self._cancelled.append(seq)
            self._cv.notify_all()

    def snapshot(self) -> dict[str, Any]:
        """Counters and pool occupancy, read under the engine's lock (engine_report.snapshot)."""
        return snapshot(self)

    def slots_report(self, max_context: int) -> list[dict]:
        """GET /slots: one row per private continuation cell of the context cache (none without one),
        read under the engine's lock, never waiting on a forward."""
        if self.cache is None:
            return []
        with self._cv:
            return self.cache.slots_report(max_context, list(self.scheduler.lanes))

    def bind_slot_file(self, slot: int, filename: str, depth: int, compat: dict) -> None:
        """Bind a saved cell's session to its slot file (--auto-save-evicted), under the engine's lock."""
        from ninfer_core.engine import cache_slots

        with self._cv:
            cache_slots.bind_file(self.cache, slot, filename, depth, compat)

    def run_control(self, fn) -> "concurrent.futures.Future":
        """Run `fn()` on the worker at the next boundary, with no forward in flight (slot save and
        restore); the future carries its result or exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopping:
                fut.set_exception(EngineError(503, "service_unavailable", "server is shutting down"))
                return fut
            self._controls.append((fn, fut))
            self._cv.notify_all()
        return fut

    def end_reasoning(self, request_id: str) -> "concurrent.futures.Future":
        """End a request's thinking at the next boundary, as the thinking budget does (llama.cpp's
        reasoning_end control): its close sequence is committed over the next decode rounds. The
        future's result: True when the close was queued or the block is already closed, False when
        the request has no close sequence, None when no live request has that id."""
        def apply():
            for seq in list(self.scheduler.lanes) + list(self.scheduler.waiting):
                if seq.request_id == request_id and seq.thinking is not None:
                    return seq.thinking.end_now()
            return None

        return self.run_control(apply)

    def _run_controls(self) -> None:
        self._flush()
        with self._cv:
            controls, self._controls = self._controls, []
        for fn, fut in controls:
            try:
                with self._cv:
                    result = fn()
            except BaseException as exc:  # noqa: BLE001 - the caller gets it through the future
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    # -- worker ---------------------------------------------------------------------------------
    def _worker(self) -> None:
        try:
            while True:
                with self._cv:
                    idle = not self._stopping and not self._has_work_locked()
                if idle:
                    self._flush()
                with self._cv:
                    while not self._stopping and not self._has_work_locked():
                        self._cv.wait()
                    if self._stopping:
                        break
                try:
                    self._iteration()
                    serving = self.recovery.after_iteration()
                except Exception as exc:  # a failure outside any one forward: recover or latch
                    log.exception("engine iteration failed")
                    serving = self.recovery.on_iteration_error(exc)
                if not serving:
                    break
        finally:
            self._flush()
            self._fail_all_on_shutdown()
            if self.cache is not None:  # the disk tier keeps what is still resident
                try:
                    with self._cv:
                        self.cache.on_shutdown()
                except Exception:  # noqa: BLE001 - shutting down regardless
                    log.exception("context cache: writing the disk tier at shutdown failed")

    def hold_when_idle(self) -> "concurrent.futures.Future":
        """Future of True once the worker is held at a boundary with nothing queued or running (a
        suspend may then release device memory), of False when a request is in the engine."""
        def apply() -> bool:
            if self.scheduler.lanes or self.scheduler.waiting or self._outstanding or (
                    self.media_encodes is not None and self.media_encodes.in_flight):
                return False
            self._held = True
            return True

        return self.run_control(apply)

    def release_hold(self) -> None:
        with self._cv:
            self._held = False
            self._cv.notify_all()

    def _has_work_locked(self) -> bool:
        if self._held:
            return False
        return bool(self.scheduler.lanes or self.scheduler.waiting or self._cancelled or self._controls
                    or (self.cache is not None and self.cache.has_background_work()))

    def _iteration(self) -> None:
        launches = self._launches
        if self._controls:
            self._run_controls()
        for seq in self._boundary(admit=True):
            try:
                if self.cache is not None:
                    ckpt = seq.cache_plan.ckpt
                    host = ckpt is not None and (ckpt.image is not None or ckpt.host_kv is not None)
                    t0 = time.monotonic()
                    with self._cv:
                        self.cache.materialize(seq)
                        if host:  # the admission waited for a Host -> Device copy
                            self.counters["context_transfer_seconds"] += time.monotonic() - t0
                    plan = seq.cache_plan
                    mat = getattr(seq, "cache_materialization", None) or {}
                    log.info("request %s context: source=%s cache=%d prompt=%d captures=%d best_reuse=%d plan=%s",
                             seq.request_id, plan.source, seq.cache_n, seq.prompt_len, len(plan.captures),
                             mat.get("best_reuse_prompt_tokens", seq.cache_n), mat.get("stop_reason", "-"))
                else:
                    self.runner.reset_slot(seq.slot)
            except Exception as exc:
                self._fail(seq, exc)
        with self._cv:
            staged = self.scheduler.pick_prefill()
        rounds = self.decode_rounds
        if staged is not None:
            unit = min(self.options.prefill_chunk, staged.prompt_remaining)
            rounds = max(1, rounds * unit // self.options.prefill_chunk)
        else:
            rounds = 1  # back to the boundary after every round so admission is not delayed
        for r in range(rounds):
            batch = self.scheduler.decode_batch()
            if not batch:
                break
            self._decode(batch)
            if r + 1 < rounds:
                self._boundary(admit=False)
        if staged is not None and staged.status is SeqStatus.PREFILL:
            self._boundary(admit=False)
            if staged.status is SeqStatus.PREFILL:
                prefill_chunk(self, staged)
        if not self._flush_after_launch or self._launches == launches:
            self._flush()  # no forward will carry them out (e.g. an iteration of background cache work)

    def _boundary(self, admit: bool) -> list[Sequence]:
        """Apply cancellations and queue timeouts, then admit; returns the newly admitted lanes."""
        ended: list[tuple[Sequence, EngineEvent]] = []
        admitted: list[Sequence] = []
        with self._cv:
            now = time.monotonic()
            for seq in self._cancelled:
                if seq.status is not SeqStatus.FINISHED:
                    if seq.status is SeqStatus.WAITING:
                        self.counters["waiting_cancelled"] += 1
                        self.counters["waiting_abandoned_seconds"] += now - seq.t_submit
                    elif seq.status is SeqStatus.PREFILL:
                        self.counters["cancelled_prefills"] += 1
                        self.counters["cancelled_prefill_computed_tokens"] += max(0, seq.num_cached - seq.cache_n)
                    if self.cache is not None and seq.status in (SeqStatus.PREFILL, SeqStatus.DECODE):
                        try:  # salvage: the retry resumes where the cancelled request got to
                            seq.retained = self.cache.on_cancel(seq, now)
                        except Exception:  # a failed salvage only loses the cache
                            log.exception("context cache: salvaging request %s failed", seq.request_id)
                    self._end_locked(seq, "requests_cancelled")
                    ended.append((seq, finish_event(self, seq, "cancelled", None)))
            self._cancelled.clear()
            now = time.monotonic()
            for seq in self.scheduler.expired(now):
                self.counters["waiting_expired"] += 1
                self.counters["waiting_abandoned_seconds"] += now - seq.t_submit
                self._end_locked(seq, "requests_timed_out")
                ended.append((seq, EngineEvent("error", error=EngineError(
                    503, "request_queue_timeout",
                    "the request was not admitted before its pending timeout (--pending-timeout-ms)"))))
            if self.cache is not None:  # a batch of the staged disk-tier writes, between rounds
                self.cache.between_rounds()
            if admit:
                admitted = self.scheduler.admit(self.options.concurrent_prefill)
                for seq in admitted:
                    seq.t_admit = now
                    self.counters["prompt_tokens_total"] += seq.prompt_len
            short = self.leases.grow(self.scheduler.lanes) if self.leases is not None else []
        for seq in short:  # --kv-lease-growth: the pool could not give its next page
            self._finish(seq, "length", "max_tokens", seq.output.finish())
        if ended or admitted:
            self._flush()
        for seq, event in ended:
            seq.post(event)
        for seq in admitted:
            # admission has chosen the reused prefix: the uncached/cached split is final here
            seq.post(EngineEvent("admitted", usage=Usage(prompt_tokens=seq.prompt_len,
                                                         cached_tokens=seq.cache_n)))
        return admitted

    def _decode(self, batch: list[Sequence]) -> None:
        self.rounds.run(batch)

    def _commit(self, seq: Sequence, token: int, record=None) -> None:
        """Append a sampled token, publish its text, and finish the request when it ends."""
        text, fin = self._take(seq, token, record)
        self._settle(seq, text, fin)

    def _take(self, seq: Sequence, token: int, record=None) -> tuple[str, tuple | None]:
        """Append a committed token to the output: (text it makes publishable, finish or None).
        The finish (reason, stop reason, final text) -- or ("error", EngineError) when a constrained
        request's grammar refuses the token -- is carried out by `_settle`."""
        refused = self._masks.commit(seq, token)  # structured output: the grammar must admit it
        if refused is not None:
            return "", ("error", refused, None)
        now = time.monotonic()
        seq.t_first = seq.t_first if seq.output_ids else now
        seq.t_last = now
        seq.output_ids.append(token)
        seq.unsent_ids.append(token)
        seq.sampler.observe(token)
        if seq.thinking.on_commit(token) and seq.thinking.post_thinking is not None:
            seq.sampler = seq.thinking.switch_sampler(seq.sampler, self.options.greedy)
        if token in self.eos_token_ids and not seq.request.ignore_eos:
            return "", ("stop", "eos", seq.output.finish())
        if record is not None:
            seq.unsent_logprobs.append((record, seq.output.decoded_chars))
        text = seq.output.feed(token)
        if seq.output.stopped:  # records of the tokens the stop string cuts are dropped
            published = seq.output.published_chars
            seq.unsent_logprobs = [(r, at) for r, at in seq.unsent_logprobs if at < published]
            return "", ("stop", "stop_string", text)
        if len(seq.output_ids) >= seq.max_tokens:
            return "", ("length", "context" if seq.at_context else "max_tokens", text + seq.output.finish())
        seq.thinking.start_early_close()
        return text, None

    def _settle(self, seq: Sequence, text: str, fin: tuple | None) -> None:
        """Publish what `_take` returned for a lane: a delta, or the finish."""
        if fin is not None:
            reason, stop_reason, tail = fin
            if reason == "error":  # (stop_reason holds the EngineError)
                self._fail(seq, stop_reason)
                return
            self._finish(seq, reason, stop_reason, text + tail)
        elif text:
            ids, seq.unsent_ids = seq.unsent_ids, []
            self._post(seq, EngineEvent("delta", token_ids=ids, text=text, logprobs=self._take_logprobs(seq)))

    def _post(self, seq: Sequence, event: EngineEvent) -> None:
        """Queue an event for the next `_flush` (events posted directly flush first: order kept)."""
        if seq.handle is not None:
            self._outbox.append((seq.handle, event))

    def _flush(self) -> None:
        if self._outbox:
            outbox, self._outbox = self._outbox, []
            post_batch(outbox)

    @staticmethod
    def _take_logprobs(seq: Sequence) -> list | None:
        if seq.request.logprobs is None:
            return None
        records, seq.unsent_logprobs = seq.unsent_logprobs, []
        return [r for r, _ in records]

    # -- ending requests ------------------------------------------------------------------------
    def _end_locked(self, seq: Sequence, counter: str) -> None:
        seq.spec_facts = self.rounds.facts(seq)  # before the backend forgets the request
        if seq.status in (SeqStatus.PREFILL, SeqStatus.DECODE):  # it held a lane
            self._n_tokens_max = max(self._n_tokens_max, lane_tokens(seq))
        self.rounds.released(seq)
        self.scheduler.release(seq)
        self._outstanding -= 1
        self.counters[counter] += 1
        self.counters["generated_tokens_total"] += len(seq.output_ids)

    def _finish(self, seq: Sequence, reason: str, stop_reason: str, text: str) -> None:
        with self._cv:
            if seq.status is SeqStatus.FINISHED:
                return
            if self.cache is not None:
                try:
                    seq.retained = self.cache.on_finish(seq, True, time.monotonic())
                except Exception:  # a capture failure must not fail the finished request
                    log.exception("context cache: publishing request %s failed", seq.request_id)
            self.counters["prefix_cache_hit_tokens"] += seq.cache_n
            self.counters["draft_tokens"] += seq.spec.drafted
            self.counters["draft_accepted_tokens"] += seq.spec.accepted
            self.counters["draft_rounds"] += seq.spec.rounds
            self.rounds.published(seq)
            self._end_locked(seq, "requests_completed")
        if text or seq.unsent_ids:
            ids, seq.unsent_ids = seq.unsent_ids, []
            self._post(seq, EngineEvent("delta", token_ids=ids, text=text, logprobs=self._take_logprobs(seq)))
        self._post(seq, finish_event(self, seq, reason, stop_reason))

    def _fail(self, seq: Sequence, exc: BaseException, status: int = 500) -> None:
        err = exc if isinstance(exc, EngineError) else self.recovery.error_for(exc) or EngineError(
            status, "server_error", f"model execution failed: {type(exc).__name__}: {exc}")
        with self._cv:
            if seq.status is SeqStatus.FINISHED:
                return
            self._end_locked(seq, "requests_failed")
        self.recovery.note(exc)
        self._flush()
        seq.post(EngineEvent("error", error=err))

    def _fail_all_on_shutdown(self) -> None:
        err = EngineError(503, "service_unavailable", "server is shutting down")
        if self.recovery.failure is not None:
            err = self.recovery.refusal()
        with self._cv:
            seqs = list(self.scheduler.lanes) + list(self.scheduler.waiting)
            self._cancelled.clear()
        for seq in seqs:
            self._fail(seq, err)


