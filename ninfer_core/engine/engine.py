"""The Engine: one worker thread that owns every model call for one loaded model.

Each loop iteration is a boundary (cancellations, queue timeouts, admission), then decode rounds
over every decode-ready lane as one batched forward, then one prefill chunk of the staged lane.
`submit`, `cancel` and `snapshot` only touch bookkeeping under the engine lock, so the HTTP event
loop never waits on a forward.
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

import torch

from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import EngineError, EngineEvent, GenerationRequest, Usage
from ninfer_core.engine.budget import BudgetPolicy
from ninfer_core.engine.cache import build_context_cache, derive_hints
from ninfer_core.engine.cache_lease import build_page_leases, lease_window_tokens
from ninfer_core.engine.detok import OutputText
from ninfer_core.engine.media_side import segment_side, vision_overlay_report, whole_spans_end
from ninfer_core.engine.model_api import (
    PAGE_SIZE,
    PREFILL,
    ForwardBatch,
    LaneSegment,
    ModelRunner,
    RunnerOptions,
)
from ninfer_core.engine.pages import PagePool, pages_for
from ninfer_core.engine.recovery import Recovery
from ninfer_core.engine.request import RequestHandle, Sequence, SeqStatus, post_batch
from ninfer_core.engine.rounds import RoundDriver
from ninfer_core.engine.sampler import SamplerState, sample, token_logprobs
from ninfer_core.engine.scheduler import Scheduler
from ninfer_core.engine.slots import SlotPool
from ninfer_core.engine.thinking import ThinkingControl
from ninfer_core.structured.masks import MaskStage

log = logging.getLogger("ninfer.engine")

COUNTERS = ("requests_completed", "requests_cancelled", "requests_rejected", "requests_timed_out",
            "requests_failed", "prompt_tokens_total", "generated_tokens_total")
# Per-unit execution totals for GET /metrics and /v1/load (spec "Metrics"): they advance with every
# prefill chunk and decode round, whichever request it served, not at request completion.
UNIT_COUNTERS = ("computed_prefill_tokens", "prefill_seconds", "decode_seconds", "decode_rounds",
                 "decode_row_rounds", "committed_decode_tokens", "prefix_cache_hit_tokens",
                 "waiting_cancelled", "waiting_expired", "waiting_abandoned_seconds", "cancelled_prefills",
                 "cancelled_prefill_computed_tokens", "context_transfer_seconds",
                 # worker iterations that failed outside any one forward and were survived (spec
                 # ninfer:engine_recoveries_total): the affected requests fail, the worker goes on
                 "engine_recoveries",
                 # speculative decoding, counted when a request completes (spec ninfer:draft_*_total;
                 # llama.cpp's spec_decode_num_* series): drafted / accepted tokens, rounds with drafts
                 "draft_tokens", "draft_accepted_tokens", "draft_rounds")


def _context_report(seq: Sequence) -> dict | None:
    """The finish event's context-cache facts: the reuse path, and the /slots cell and session
    digest a completed session was retained under."""
    source = getattr(seq, "cache_source", None)
    overlay = vision_overlay_report(getattr(seq, "vision_windows", None))
    if source is None:
        return {"vision_overlay": overlay} if overlay else None
    cont = getattr(seq, "retained", None)
    report: dict = {"source": source, "cache_n": seq.cache_n}
    if overlay:
        report["vision_overlay"] = overlay
    mat = getattr(seq, "cache_materialization", None)
    if mat is not None:  # the admission's context-cache decision (spec request_done.materialization)
        report["materialization"] = dict(mat)
    if cont is not None:
        report.update(id_slot=cont.slot, session_digest=cont.digest)
    return report


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
        # media encodes run on the worker before the prefill unit needing them (snapshot "vision")
        self.vision_counters = {"encodes": 0, "encoded_tokens": 0, "encode_seconds": 0.0}
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
        with self._cv:
            s = self.scheduler
            return {
                "lanes_active": len(s.lanes),
                "lanes_total": s.max_lanes,
                "prefilling": len(s.staged()),
                "decode_ready": len(s.decode_batch()),
                "pages_total": s.pages.num_pages,
                "pages_free": s.pages.num_free,
                "page_size": self.page_size,
                "slots_total": s.slots.num_slots,
                "slots_free": s.slots.num_free,
                "pending": len(s.waiting),
                # GET /stats: the first 16 waiting requests in submission order.
                "queue": [{"request_id": q.request_id, "position": i, "wait_seconds": time.monotonic() - q.t_submit}
                          for i, q in zip(range(16), s.waiting)],
                "outstanding": self._outstanding,
                "capacity": self.capacity,
                "kv_bytes": self.kv_bytes,
                "state_bytes": self.state_bytes,
                "counters": dict(self.counters),
                # llama.cpp's n_tokens_max, and the pages running requests hold (the gateway's KV usage)
                "n_tokens_max": max([self._n_tokens_max] + [_lane_tokens(q) for q in s.lanes]),
                "pages_in_lanes": len({p for q in s.lanes for p in q.pages}),
                "context_cache": self.cache.snapshot() if self.cache is not None else None,
                "speculative": self.rounds.describe(),
                "vision": dict(self.vision_counters, residency=self.vision.name) if self.vision is not None else None,
                "failed": self.recovery.failure,
                # the family's own counter blocks (GET /stats shows each under its name)
                "model": self._model_counters(),
            }

    def _model_counters(self) -> dict[str, Any]:
        try:
            return dict(self.runner.counters() or {})
        except Exception:  # noqa: BLE001 - a stats probe must answer even if a family's report fails
            return {}

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
            if self.scheduler.lanes or self.scheduler.waiting or self._outstanding:
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
                self._prefill_chunk(staged)
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
                    ended.append((seq, self._finish_event(seq, "cancelled", None)))
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

    @staticmethod
    def _logprob_records(logits, seqs: list[Sequence], tokens: list[int], forced: list) -> list:
        rows = [i for i, s in enumerate(seqs) if s.request.logprobs is not None and forced[i] is None]
        records = [None] * len(seqs)
        if rows:
            if logits.dim() == 1:
                logits = logits.unsqueeze(0)
            got = token_logprobs(logits[rows], [seqs[i].sampler for i in rows], [tokens[i] for i in rows],
                                 [seqs[i].request.logprobs for i in rows])
            for i, r in zip(rows, got):
                records[i] = r
        return records

    def _prefill_chunk(self, seq: Sequence) -> None:
        start = seq.num_cached
        end = min(start + self.options.prefill_chunk, seq.prompt_len)
        snap = None  # (frontier, reserved state slot): a capture inside this chunk
        if self.cache is not None:
            ahead = self.cache.splits_ahead(seq)
            if ahead and ahead[0] < end:
                with self._cv:
                    slot = self.cache.reserve_capture_slot(seq, ahead[0], time.monotonic())
                if slot is not None:
                    # one forward leaves the frontier's state in the slot: no split, no copy
                    snap = (ahead[0], slot)
                    if len(ahead) > 1 and ahead[1] < end:
                        end = ahead[1]
                else:
                    end = ahead[0]  # the chunk ends at the frontier; after_chunk copies the state
        if seq.request.media is not None and getattr(self.runner, "whole_media_spans", False):
            moved = whole_spans_end(seq.request.media, start, end)
            if moved != end:
                end = moved
                if snap is not None and snap[0] >= end:  # the capture is no longer inside the chunk
                    with self._cv:
                        self.cache.release_capture_slot(snap[1])
                    snap = None
        chunk = seq.prompt_ids[start: end]
        pages = seq.pages[: pages_for(start + len(chunk), self.page_size)]
        last = start + len(chunk) == seq.prompt_len
        segment = LaneSegment(seq.slot, {g: pages for g in self.cache_spec.group_names}, start, chunk, PREFILL,
                              "last" if last else "none", self.rounds.target_layers,
                              snapshot=None if snap is None else (snap[0] - start, snap[1]))
        t0 = time.monotonic()
        try:
            if seq.request.media is not None:
                segment.side = segment_side(seq.request.media, start, len(chunk),
                                            lambda item: self._media_rows(seq, item))
            out = self.runner.forward(ForwardBatch([segment]))[0]
            logits = out.logits
            self._launches += 1
            self._flush()
            if last and seq.request.score_token_ids:
                seq.scores = _log_probs_of(logits, seq.request.score_token_ids)
            masked = self._masks.apply(logits[-1] if logits.dim() == 2 else logits, [seq]) if last else {}
            if masked:
                raise masked[0]
            token = sample(logits, [seq.sampler])[0] if last and seq.max_tokens > 0 else None
            record = None
            if token is not None:
                row = logits[-1:] if logits.dim() == 2 else logits
                record = self._logprob_records(row, [seq], [token], [None])[0]
        except Exception as exc:
            log.exception("prefill failed for request %s", seq.request_id)
            if snap is not None:
                with self._cv:
                    self.cache.release_capture_slot(snap[1])
            self._fail(seq, exc)
            return
        self.rounds.observed(seq, start, out.hidden)
        seq.num_cached += len(chunk)
        if last:
            seq.media_embeds = None  # the prompt is in the KV: its media embeddings are done with
        with self._cv:
            self.counters["computed_prefill_tokens"] += len(chunk)
            self.counters["prefill_seconds"] += time.monotonic() - t0
        if self.cache is not None and (snap is not None or not last):
            with self._cv:
                if snap is not None:
                    self.cache.capture_reserved(seq, snap[0], snap[1], time.monotonic())
                if not last:
                    self.cache.after_chunk(seq, time.monotonic())
        if not last:
            if seq.request.progress:  # llama.cpp return_progress
                self._post(seq, EngineEvent("progress", progress={"total": seq.prompt_len, "cache": seq.cache_n,
                                                                  "processed": seq.num_cached}))
            return
        seq.t_first = time.monotonic()
        if token is None:  # max_tokens == 0: prompt processing only
            self._finish(seq, "length", "context" if seq.at_context else "max_tokens", "")
            return
        seq.status = SeqStatus.DECODE
        self._commit(seq, token, record)

    def _media_rows(self, seq: Sequence, item):
        """An item's embeddings [tokens, hidden], encoded by the vision residency on first use."""
        got = seq.media_embeds if seq.media_embeds is not None else {}
        seq.media_embeds = got
        k = id(item)
        if k not in got:
            if self.vision is None:
                raise EngineError(400, "vision_disabled", "This server was started without --vision.")
            t0 = time.monotonic()
            got[k] = self.vision.encode(item)
            stats = getattr(self.vision, "last_encode", None)
            if stats:  # an overlay window's facts (request_done.vision_overlay)
                seq.vision_windows.append(dict(stats))
            with self._cv:
                c = self.vision_counters
                c["encodes"] += 1
                c["encoded_tokens"] += item.tokens
                c["encode_seconds"] += time.monotonic() - t0
            seq.vision_encodes += 1
            seq.vision_seconds += time.monotonic() - t0
        return got[k]

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
            self._n_tokens_max = max(self._n_tokens_max, _lane_tokens(seq))
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
        self._post(seq, self._finish_event(seq, reason, stop_reason))

    def _finish_event(self, seq: Sequence, reason: str, stop_reason: str | None) -> EngineEvent:
        usage = Usage(prompt_tokens=seq.prompt_len, completion_tokens=len(seq.output_ids),
                      cached_tokens=seq.cache_n)
        t = seq.timings() or {}
        # Counts and rates only: a log line never carries prompt or output text.
        # The completion line names the reuse path (spec: root, private_endpoint, ...) and cache=.
        mat = getattr(seq, "cache_materialization", None)
        log.info("request %s %s (%s): prompt %d tokens, cache=%d via %s, in %.0f ms, %d output tokens at %.1f tok/s%s",
                 seq.request_id, reason, stop_reason or "-", seq.prompt_len, t.get("cache_n", 0) or 0,
                 getattr(seq, "cache_source", None) or "root", t.get("prompt_ms", 0.0) or 0.0,
                 len(seq.output_ids), t.get("predicted_per_second", 0.0) or 0.0,
                 # the admission's materialization decision, when it had to make room
                 "" if not mat or mat["stop_reason"] == "no_pressure" else
                 f" (best reuse {mat['best_reuse_prompt_tokens']}, degraded {mat['degradation_tokens']}, "
                 f"search {mat['stop_reason']}{', maximal fallback' if mat['maximal_fallback'] else ''})")
        spec = getattr(seq, "spec_facts", None) or self.rounds.facts(seq)
        if spec is not None and (spec["rounds"] or spec["fallback_steps"]):
            rate = spec["accepted_tokens"] / spec["drafted_tokens"] if spec["drafted_tokens"] else 0.0
            log.info("request %s drafts: %d/%d accepted (%.2f) in %d rounds, %.2f accepted per drafted round, "
                     "n-gram %d/%d in %d rounds, %d rounds without drafts", seq.request_id,
                     spec["accepted_tokens"], spec["drafted_tokens"], rate, spec["rounds"],
                     spec["accepted_tokens"] / spec["rounds"] if spec["rounds"] else 0.0,
                     spec["ngram_accepted_tokens"], spec["ngram_drafted_tokens"], spec["ngram_rounds"],
                     spec["fallback_steps"])
        facts = seq.thinking.facts() if seq.thinking is not None else None
        if facts is not None:  # the requested budget, and the effective one when it differs
            budget = facts["budget_requested"]
            if budget is not None and facts["budget_effective"] not in (None, budget):
                budget = f"{budget} (effective {facts['budget_effective']})"
            log.info("request %s thinking: budget %s, early close %s, %d reasoning tokens, post-thinking "
                     "sampling %s", seq.request_id, budget, facts["early_close"], facts["reasoning_tokens"],
                     facts["post_thinking_sampling"])
        return EngineEvent("finish", finish_reason=reason, stop_reason=stop_reason, usage=usage,
                           timings=seq.timings(), matched_stop=seq.output.matched_stop,
                           scores=getattr(seq, "scores", None),
                           thinking=seq.thinking.facts() if seq.thinking is not None else None,
                           context=_context_report(seq), speculative=spec)

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


def _lane_tokens(seq: Sequence) -> int:
    """Tokens a lane's sequence holds: the prompt processed so far, then prompt and output."""
    return max(seq.num_cached, seq.prompt_len + len(seq.output_ids) if seq.output_ids else 0)


def _log_probs_of(logits, token_ids: list[int]) -> list[float]:
    """log-softmax over the whole vocabulary of the last row of `logits`, at `token_ids`."""
    row = logits[-1] if logits.dim() > 1 else logits  # [vocab]
    logp = torch.log_softmax(row.float(), dim=-1)
    return logp[torch.tensor(token_ids, dtype=torch.long, device=logp.device)].tolist()
