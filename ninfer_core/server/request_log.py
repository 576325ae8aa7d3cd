"""--request-log-jsonl FILE: the machine-readable request log (spec "Structured request log").

One JSON object a line, appended and flushed per event: `server_start` (first line of every file),
`request_start` / `request_rejected` / `request_error` / `request_done` for each generation
request, and a `throughput` record of interval counter deltas every five seconds while the engine
is not idle. No record carries a prompt, generated text, a request body or an API-key value.

How it hooks in, without touching the protocols:
* `RequestLogMiddleware` (inside ServerMiddleware) marks a POST to a generation route with its
  endpoint and arrival time in a context variable;
* `LoggedEngine` wraps the Engine the server hands the protocols: a submit made under such a mark
  writes `request_start` and installs an observer on the handle, which sees every event as it is
  delivered to the event loop (whether or not the stream still reads) and writes the outcome;
* the error mapper calls `log_rejection` for a preparation rejection, the same ones that count in
  ninfer:requests_rejected_total;
* `ThroughputReporter` reads the engine snapshot every five seconds on a thread of its own.
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import json
import logging
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("ninfer.server")

SCHEMA = "ninfer_serve_request_log"
SCHEMA_VERSION = 28
REDACTED = "<redacted>"
THROUGHPUT_INTERVAL_S = 5.0
# Endpoint -> protocol name of the request records.
PROTOCOLS = {"/v1/chat/completions": "openai_chat", "/v1/completions": "openai_completions",
             "/completion": "llamacpp_completion", "/completions": "llamacpp_completion",
             "/v1/messages": "anthropic_messages", "/v1/responses": "openai_responses",
             "/chat/completions": "openai_chat", "/responses": "openai_responses"}  # llama-server's unprefixed forms


class RequestLogError(Exception):
    """The log cannot be used (startup fails with this message)."""


def check_log_path(path: str, artifact_path: str | None) -> None:
    """Startup checks: the parent directory exists, and the path is not the model artifact."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise RequestLogError(f"--request-log-jsonl {path}: the directory {parent} does not exist")
    if p.is_dir():
        raise RequestLogError(f"--request-log-jsonl {path}: is a directory")
    if artifact_path and os.path.realpath(path) == os.path.realpath(artifact_path):
        raise RequestLogError(f"--request-log-jsonl {path}: resolves to the model artifact")


def redact_argv(argv: list[str]) -> list[str]:
    """argv with the value of --api-key (either form) replaced by <redacted>."""
    out: list[str] = []
    redact_next = False
    for arg in argv:
        if redact_next:
            out.append(REDACTED)
            redact_next = False
        elif arg == "--api-key":
            out.append(arg)
            redact_next = True
        elif arg.startswith("--api-key="):
            out.append("--api-key=" + REDACTED)
        else:
            out.append(arg)
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, argparse.Namespace):
        return _jsonable(vars(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _sampler_record(sampling: Any) -> dict | None:
    """A SamplingParams as logged: its logit_bias as the number of biased tokens (a ban is minus
    infinity, which JSON cannot hold, and the ids are the client's request content)."""
    if not dataclasses.is_dataclass(sampling):
        return None
    out = dataclasses.asdict(sampling)
    out["logit_bias"] = len(out.get("logit_bias") or {})
    return out


class RequestLog:
    """The open JSONL file: one lock, append mode, a flush after every record, size rotation."""

    def __init__(self, path: str, max_mib: int = 0, keep: int = 4, max_bytes: int | None = None):
        self.path = path
        self.max_bytes = int(max_mib) * (1 << 20) if max_bytes is None else max_bytes
        self.keep = keep
        self.instance_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._ids = 0
        self._start_record: dict | None = None
        try:
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the server's life
        except OSError as e:
            raise RequestLogError(f"cannot open --request-log-jsonl {path}: {e.strerror or e}") from None

    def next_request_id(self) -> int:
        """Monotonic within this server instance (spec), from 1."""
        with self._lock:
            self._ids += 1
            return self._ids

    def start(self, record: dict) -> None:
        """Write the server_start record; it also opens every file rotation starts."""
        self._start_record = dict(record)
        self.write("server_start", **record)

    def write(self, event: str, **fields: Any) -> None:
        record = {"event": event, "timestamp_unix_ms": int(time.time() * 1000),
                  "server_instance_id": self.instance_id, **fields}
        line = json.dumps(_jsonable(record), separators=(",", ":"), allow_nan=False) + "\n"
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.write(line)
                self._file.flush()
                if self.max_bytes and self._file.tell() >= self.max_bytes:
                    self._rotate_locked()
            except (OSError, ValueError) as e:  # a full disk must not fail requests
                log.warning("request log: write failed: %s", type(e).__name__)

    def _rotate_locked(self) -> None:
        self._file.close()
        if self.keep <= 0:
            os.unlink(self.path)
        else:
            for i in range(self.keep - 1, 0, -1):
                older = f"{self.path}.{i}"
                if os.path.exists(older):
                    os.replace(older, f"{self.path}.{i + 1}")
            os.replace(self.path, f"{self.path}.1")
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        if self._start_record is not None:
            record = {"event": "server_start", "timestamp_unix_ms": int(time.time() * 1000),
                      "server_instance_id": self.instance_id, **self._start_record, "rotated": True}
            self._file.write(json.dumps(_jsonable(record), separators=(",", ":")) + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


# -- the request scope: which endpoint a submit belongs to -----------------------------------------

@dataclass
class RequestScope:
    endpoint: str
    t_arrival: float  # time.monotonic() when the request reached the route
    request_id: int | None = None  # the log's id, given at request_start or request_rejected
    logged: bool = False  # an outcome-less start or a rejection was written


_scope: contextvars.ContextVar[RequestScope | None] = contextvars.ContextVar("ninfer_request_log_scope",
                                                                             default=None)


class RequestLogMiddleware:
    """Marks POSTs to generation routes so the engine wrapper and the error mapper can log them."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in PROTOCOLS:
            await self.app(scope, receive, send)
            return
        token = _scope.set(RequestScope(scope["path"], time.monotonic()))
        try:
            await self.app(scope, receive, send)
        finally:
            _scope.reset(token)


def log_rejection(ctx: Any, err: Any) -> None:
    """request_rejected for a preparation failure (called by the error mapper, which decides that
    it is a counted rejection). Nothing when the request already started or is not a generation one."""
    rlog = getattr(ctx, "request_log", None)
    s = _scope.get()
    if rlog is None or s is None or s.logged:
        return
    s.logged = True
    s.request_id = rlog.next_request_id()
    rlog.write("request_rejected", request_id=s.request_id, endpoint=s.endpoint, protocol=PROTOCOLS[s.endpoint],
               phase="prepare", status=err.status, type=err.type, code=err.code, param=err.param,
               timings_seconds={"prepare": time.monotonic() - s.t_arrival})


# -- the engine wrapper -----------------------------------------------------------------------------

class LoggedEngine:
    """The Engine as the protocols see it when the request log is on: every attribute is the
    Engine's, `submit` under a generation route also logs the request."""

    def __init__(self, engine: Any, rlog: RequestLog):
        self._engine = engine
        self._log = rlog

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def submit(self, request: Any) -> Any:
        s = _scope.get()
        handle = self._engine.submit(request)
        if s is None or s.logged:  # not a generation route (rerank, warmup), or a second submit
            return handle
        s.logged = True
        s.request_id = self._log.next_request_id()
        tracker = _Tracker(self._log, s, request, handle)
        tracker.start()
        try:
            handle.observer = tracker.observe
        except AttributeError:  # a handle type that takes no observer (test doubles)
            pass
        return handle


class _Tracker:
    """One request's times and outcome, fed by its handle's delivered events (on the event loop)."""

    def __init__(self, rlog: RequestLog, scope: RequestScope, request: Any, handle: Any):
        self.log, self.scope, self.request, self.handle = rlog, scope, request, handle
        self.t_submit = time.monotonic()
        self.t_admitted: float | None = None
        self.t_first: float | None = None
        self.done = False

    def budget(self) -> int | None:
        """The output budget actually submitted (spec: requested_output_tokens): the request's limit,
        or the derived default the engine resolved for one that named none."""
        effective = getattr(self.handle, "max_tokens", None)
        return effective if isinstance(effective, int) else self.request.max_tokens

    def _base(self) -> dict:
        return {"request_id": self.scope.request_id, "engine_request_id": getattr(self.handle, "request_id", None),
                "endpoint": self.scope.endpoint, "protocol": PROTOCOLS[self.scope.endpoint]}

    def start(self) -> None:
        r = self.request
        sampling = _sampler_record(r.sampling)
        thinking = {"enable_thinking": bool(r.in_reasoning), "thinking_budget": r.thinking_budget,
                    "post_thinking_sampler": _sampler_record(r.post_thinking) if r.post_thinking else None}
        self.log.write("request_start", **self._base(), prompt_tokens=len(r.prompt_ids),
                       requested_output_tokens=self.budget(), explicit_output_limit=r.max_tokens is not None,
                       sampler=sampling, stop_strings=len(r.stop), ignore_eos=bool(r.ignore_eos),
                       logprobs=r.logprobs, thinking=thinking, session_bound=r.session_id is not None,
                       cache_prompt=bool(r.cache_prompt), media=_media_record(r.media),
                       timings_seconds={"prepare": self.t_submit - self.scope.t_arrival})

    def observe(self, ev: Any) -> None:
        try:
            self._observe(ev)
        except Exception:  # the log never breaks event delivery
            log.exception("request log: recording an event failed")

    def _observe(self, ev: Any) -> None:
        if self.done:
            return
        now = time.monotonic()
        if ev.kind == "admitted":
            self.t_admitted = now
        elif ev.kind == "delta":
            if self.t_first is None:
                self.t_first = now
        elif ev.kind == "finish":
            self.done = True
            if ev.finish_reason == "cancelled":
                self._error(now, "cancelled", None, ev)
            else:
                self._done(now, ev)
        elif ev.kind == "error":
            self.done = True
            self._error(now, "generation", ev.error, ev)

    def _timings(self, now: float, ev: Any) -> dict:
        s = self.scope
        t = {"prepare": self.t_submit - s.t_arrival,
             "queue_wait": (self.t_admitted - self.t_submit) if self.t_admitted is not None else None,
             "ttft": (self.t_first - s.t_arrival) if self.t_first is not None else None,
             "total": now - s.t_arrival}
        et = getattr(ev, "timings", None) or {}
        if "prompt_ms" in et:
            t["prefill"] = et["prompt_ms"] / 1000.0
        if "predicted_ms" in et:
            t["decode"] = et["predicted_ms"] / 1000.0
        if "vision_ms" in et:  # media encodes this request ran (0 when its media came from the cache)
            t["vision"] = et["vision_ms"] / 1000.0
        return t

    def _done(self, now: float, ev: Any) -> None:
        usage = ev.usage
        timings = ev.timings or {}
        context = ev.context or {}
        rec: dict[str, Any] = dict(
            self._base(), finish_reason=ev.finish_reason, stop_reason=ev.stop_reason,
            prompt_tokens=usage.prompt_tokens if usage else len(self.request.prompt_ids),
            completion_tokens=usage.completion_tokens if usage else 0,
            cached_tokens=usage.cached_tokens if usage else 0,
            computed_prefill_tokens=timings.get("prompt_n"),
            prefix_reuse_path=context.get("source", "root"),
            requested_output_tokens=self.budget(),
            timings_seconds=self._timings(now, ev))
        mat = materialization(context.get("materialization"))
        if mat is not None:
            rec["materialization"] = mat
        if ev.thinking:
            rec["thinking"] = ev.thinking
        if getattr(ev, "speculative", None):
            rec["speculative"] = ev.speculative
        if context.get("id_slot") is not None:
            rec["retained_slot"] = context["id_slot"]
        if context.get("vision_overlay"):  # the overlay windows this request's encodes opened
            rec["vision_overlay"] = context["vision_overlay"]
        self.log.write("request_done", **rec)

    def _error(self, now: float, phase: str, err: Any, ev: Any) -> None:
        rec: dict[str, Any] = dict(self._base(), phase=phase, timings_seconds=self._timings(now, ev))
        if err is not None:
            # no message: error texts can quote client values (model names, tool names, schema
            # paths), and the spec keeps arbitrary client error messages out of these records
            rec.update(status=err.status, type=err.type, code=err.code)
        else:
            rec.update(finish_reason="cancelled")
            if ev.usage is not None:
                rec.update(prompt_tokens=ev.usage.prompt_tokens, completion_tokens=ev.usage.completion_tokens,
                           cached_tokens=ev.usage.cached_tokens)
            if ev.timings:
                rec.update(computed_prefill_tokens=ev.timings.get("prompt_n"))
        self.log.write("request_error", **rec)


# Our planner's summary keys -> the spec's request_done.materialization names.
_MAT_NAMES = {"targets_evaluated": "targets_evaluated", "search_work": "search_work", "stop_reason": "stop_reason",
              "budget_exhausted": "budget_exhausted", "degradation_tokens": "selected_degradation_units",
              "maximal_fallback": "selected_maximal_fallback",
              "best_reuse_prompt_tokens": "best_reuse_prompt_tokens", "resume_tokens": "resume_tokens",
              "planning_elapsed_ns": "planning_elapsed_ns",
              # our cost unit is prefill tokens, not nanoseconds: named for what it is
              "predicted_cost_tokens": "predicted_total_tokens"}


def materialization(summary: dict | None) -> dict | None:
    """The admission's decision in the spec's names; only what the planner computed."""
    if not summary:
        return None
    return {_MAT_NAMES[k]: v for k, v in summary.items() if k in _MAT_NAMES}


# -- throughput -------------------------------------------------------------------------------------

_TOKEN_KEYS = ("computed_prefill_tokens", "committed_decode_tokens", "prefill_seconds", "decode_seconds",
               "decode_rounds", "decode_row_rounds", "prefix_cache_hit_tokens", "context_transfer_seconds",
               "requests_completed", "requests_cancelled", "requests_failed", "requests_timed_out",
               "engine_recoveries")
# Context-cache snapshot fields that are gauges (end-of-interval values), not counters.
_CC_GAUGES = ("device_state_slots_used", "host_state_slots_used", "host_kv_bytes_used", "host_kv_pages_used",
              "private_continuations", "shared_prefixes", "checkpoints", "disk_writes_staged")
_CC_CAPACITIES = ("device_state_slots", "host_state_slots", "host_kv_bytes", "host_kv_pages", "state_image_bytes",
                  "max_private_continuations")


def _delta(now: Any, before: Any) -> Any:
    """Numeric leaves of `now` minus those of `before` (nested dicts)."""
    if isinstance(now, dict):
        prev = before if isinstance(before, dict) else {}
        return {k: _delta(v, prev.get(k)) for k, v in now.items()
                if isinstance(v, (dict, int, float)) and not isinstance(v, bool)}
    if isinstance(now, (int, float)) and not isinstance(now, bool):
        return now - (before if isinstance(before, (int, float)) and not isinstance(before, bool) else 0)
    return None


def _nonzero(d: Any) -> bool:
    if isinstance(d, dict):
        return any(_nonzero(v) for v in d.values())
    return bool(d)


def context_cache_counters(cc: dict) -> dict:
    return {k: v for k, v in cc.items() if k not in _CC_GAUGES and k not in _CC_CAPACITIES}


class ThroughputReporter:
    """Every `interval_s`, a throughput record of the engine's interval deltas; idle intervals
    (no counter moved) are omitted. `stop` writes the last partial interval."""

    def __init__(self, rlog: RequestLog, engine: Any, interval_s: float = THROUGHPUT_INTERVAL_S):
        self.log, self.engine, self.interval_s = rlog, engine, interval_s
        self._stop = threading.Event()
        self._prev = self._read()
        self._t_prev = time.monotonic()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ninfer-throughput", daemon=True)

    def _read(self) -> dict:
        try:
            return dict(self.engine.snapshot() or {})
        except Exception:  # noqa: BLE001 - a stopped engine: nothing to report
            return {}

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.report()

    def stop(self) -> None:
        self._stop.set()
        self.report()

    def report(self) -> None:
        with self._lock:
            snap = self._read()
            if not snap:
                return
            now = time.monotonic()
            prev, self._prev = self._prev, snap
            elapsed, self._t_prev = now - self._t_prev, now
            c = snap.get("counters") or {}
            d = _delta({k: c.get(k, 0) for k in _TOKEN_KEYS}, prev.get("counters") or {})
            cc = snap.get("context_cache")
            cc_delta = None
            if isinstance(cc, dict):
                cc_delta = _delta(context_cache_counters(cc), context_cache_counters(prev.get("context_cache") or {}))
            if not _nonzero(d) and not _nonzero(cc_delta):
                return  # a fully idle interval
            rounds, rows = d["decode_rounds"], d["decode_row_rounds"]
            record: dict[str, Any] = {
                "interval_seconds": elapsed,
                "tokens": {"prefill": d["computed_prefill_tokens"], "decode": d["committed_decode_tokens"],
                           "prefix_cache_hit": d["prefix_cache_hit_tokens"]},
                "seconds": {"prefill": d["prefill_seconds"], "decode": d["decode_seconds"],
                            "context_transfer": d["context_transfer_seconds"]},
                "decode_batch": {"rounds": rounds, "row_rounds": rows,
                                 "average_size": rows / rounds if rounds else None},
                "requests": {"completed": d["requests_completed"], "cancelled": d["requests_cancelled"],
                             "failed": d["requests_failed"], "timed_out": d["requests_timed_out"]},
                "scheduler": {"running": snap.get("lanes_active", 0), "prefilling": snap.get("prefilling", 0),
                              "decode_ready": snap.get("decode_ready", 0), "waiting": snap.get("pending", 0)},
                "engine_recoveries": d["engine_recoveries"],
            }
            if isinstance(cc, dict):
                record["context_cache"] = dict(cc_delta or {},
                                               occupancy={k: cc.get(k) for k in _CC_GAUGES if k in cc})
            self.log.write("throughput", **record)


# -- server_start -----------------------------------------------------------------------------------

def _vision_record(engine: Any, ctx: Any) -> dict | None:
    vision = getattr(engine, "vision", None)
    if vision is None:
        return None
    out = dict(vision.describe())
    media = getattr(ctx, "media", None)
    if media is not None:
        out.update(max_merged_per_item=media.max_merged, media_cache_bytes=media.cache.capacity,
                   media_live_bytes=media.live.capacity)
    return out


def _media_record(media: Any) -> dict | None:
    """Request-scoped media facts: items, tokens, acquisition and preprocessing, cache outcome, bytes."""
    if media is None:
        return None
    rep = media.report
    out = {"items": len(media.items), "tokens": sum(s.length for s in media.spans),
           "digests": [i.digest[:16] for i in media.items]}
    if rep is not None:
        out.update(source_bytes=rep.source_bytes, payload_bytes=rep.payload_bytes, acquire_seconds=rep.acquire_s,
                   preprocess_seconds=rep.preprocess_s, cache=dict(rep.cache))
    return out


def server_start_record(ctx: Any, engine: Any, argv: list[str] | None = None) -> dict:
    """build, artifact, architecture, public name, redacted argv and options, the resolved Engine
    and context-cache capacities and switches, and the context-cost source."""
    from ninfer_core.version import build_string

    opts = ctx.options
    options = _jsonable(opts)
    if options.get("api_key") is not None:
        options["api_key"] = REDACTED
    model = ctx.model
    snap = dict(engine.snapshot() or {})
    eng: dict[str, Any] = {"lanes": snap.get("lanes_total"), "pages_total": snap.get("pages_total"),
                           "page_size": snap.get("page_size"), "kv_bytes": snap.get("kv_bytes"),
                           "state_bytes": snap.get("state_bytes"), "capacity": snap.get("capacity"),
                           "prefill_chunk": opts.engine.prefill_chunk,
                           "decode_rounds_per_prefill": opts.engine.resolved_decode_rounds(),
                           "concurrent_prefill": opts.engine.concurrent_prefill}
    spec = snap.get("speculative") or {}
    eng["speculative"] = spec.get("backend")  # the backend's description (None: no --spec)
    e = opts.engine
    ngram = spec.get("ngram") or {}
    eng.update(ngram_draft_window=ngram.get("draft_tokens", 0), ngram_min_match=e.ngram_min_match,
               lookup_ngram=e.lookup_ngram, ngram_archive_bytes=ngram.get("archive_bytes", 0),
               ngram_session_bytes=ngram.get("session_bytes", e.ngram_session_mib << 20),
               ngram_native_sessions=False)
    cache = getattr(engine, "cache", None)
    cc = snap.get("context_cache")
    if cache is not None and isinstance(cc, dict):
        caps = _jsonable(cache.caps) if dataclasses.is_dataclass(getattr(cache, "caps", None)) else {}
        e = opts.engine
        eng["context_cache"] = dict(
            {k: cc.get(k) for k in _CC_CAPACITIES}, capacities=caps, mode="checkpoint_catalog",
            automatic_long_anchors=e.auto_long_anchors, branch_anchors=e.branch_anchors,
            endpoint_anchors=e.endpoint_anchors, long_anchor_min_spacing_tokens=e.long_anchor_spacing,
            disk_tier=e.disk_kv_path is not None, disk_restore=e.disk_kv_restore)
    else:
        eng["context_cache"] = None
    record: dict[str, Any] = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "build": build_string(), "pid": os.getpid(),
        "argv": redact_argv(list(sys.argv if argv is None else argv)),
        "artifact_path": model.artifact_path if model else opts.artifact,
        "architecture": model.architecture if model else None,
        "public_name": model.id if model else None,
        "device": opts.engine.device, "kv_dtype": opts.engine.kv_dtype,
        "options": options, "engine": eng,
        "sampler_defaults": ctx.sampling_presets,
        "thinking": _jsonable(opts.thinking),
        # the vision residency and its device memory (null: --vision off)
        "vision": _vision_record(engine, ctx),
    }
    if cache is not None:
        from ninfer_core.engine import cache_planner

        record["context_cost"] = {"source": "compiled_defaults", "unit": "prefill_tokens",
                                  "host_resume_cost": cache_planner.HOST_RESUME_COST,
                                  "half_life_s": cache_planner.HALF_LIFE_S,
                                  "search_work": cache_planner.SEARCH_WORK,
                                  "search_seconds": cache_planner.SEARCH_SECONDS}
    return record
