"""GET /metrics: the Prometheus text of the spec's "Metrics" table, from published counters only.

The llamacpp: series keep llama.cpp's --metrics names and meanings; the ninfer: series follow the
spec. Token and time counters are the Engine's per-unit totals (every prefill chunk and decode
round), so they advance during a long request. Everything is read from `engine.snapshot()` (a copy
taken under the engine lock, never waiting on a forward) and the server's ingress count. Written by
hand, like the context-cache series it appends, because prometheus_client is not a dependency of
ninfer-core and these are a few dozen counters and gauges read from a dict.
"""

from __future__ import annotations

from typing import Any

from ninfer_core.engine.cache_metrics import context_cache_metrics, family
from ninfer_core.server.context import ServerContext

# Preparation rejections that count in ninfer:requests_rejected_total (one per request_rejected
# request-log event): overload, invalid or oversized prompt or media. Unparseable and 413 bodies
# and schema validation failures are not measurement requests and are not counted.
REJECTION_CODES = frozenset({"server_overloaded", "context_length_exceeded", "invalid_prompt", "invalid_media",
                             "media_budget_exceeded", "vision_disabled", "request_queue_timeout"})
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/completion", "/completions",
                              "/v1/messages", "/v1/responses", "/chat/completions", "/responses"})


def count_rejection(scope: dict, code: str | None, status: int, err: Any = None) -> None:
    """Called by the error mapper for every EngineError a route raised before responding; a counted
    rejection is also the request log's request_rejected record."""
    if scope.get("method") != "POST" or scope.get("path") not in GENERATION_PATHS:
        return
    if code not in REJECTION_CODES and status != 429:
        return
    app = scope.get("app")
    ctx = getattr(getattr(app, "state", None), "ctx", None)
    if ctx is not None:
        ctx.requests_rejected += 1
        if err is not None and ctx.request_log is not None:
            from ninfer_core.server.request_log import log_rejection

            log_rejection(ctx, err)


def _num(d: dict, key: str) -> float:
    v = d.get(key, 0) if isinstance(d, dict) else 0
    return float(v) if isinstance(v, (int, float)) else 0.0


def render_metrics(ctx: ServerContext) -> str:
    """The whole /metrics body (text/plain; version=0.0.4)."""
    snap: dict[str, Any] = {}
    if ctx.engine is not None:
        try:
            snap = dict(ctx.engine.snapshot() or {})
        except Exception:  # noqa: BLE001 - a scrape must answer even if the engine is unwell
            snap = {}
    c = snap.get("counters") if isinstance(snap.get("counters"), dict) else {}
    pages_total = _num(snap, "pages_total")
    pages_used = max(0.0, pages_total - _num(snap, "pages_free"))
    page = _num(snap, "page_size") or 64.0
    prompt_tokens, prompt_s = _num(c, "computed_prefill_tokens"), _num(c, "prefill_seconds")
    decoded, decode_s = _num(c, "committed_decode_tokens"), _num(c, "decode_seconds")
    rounds, rows = _num(c, "decode_rounds"), _num(c, "decode_row_rounds")
    ended = sum(_num(c, k) for k in ("requests_completed", "requests_cancelled", "requests_failed",
                                     "requests_timed_out"))

    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else 0.0

    out: list[str] = []

    def one(name: str, kind: str, help_: str, value: float) -> None:
        out.extend(family(name, kind, help_, [({}, value)]))

    one("llamacpp:prompt_tokens_total", "counter", "prompt tokens computed by prefill; prefix-cache hits excluded",
        prompt_tokens)
    one("llamacpp:prompt_seconds_total", "counter", "prefill execution time", prompt_s)
    one("llamacpp:tokens_predicted_total", "counter", "tokens committed by decode rounds", decoded)
    one("llamacpp:tokens_predicted_seconds_total", "counter", "decode execution time", decode_s)
    one("llamacpp:prompt_tokens_seconds", "gauge", "prompt tokens over prefill seconds", ratio(prompt_tokens, prompt_s))
    one("llamacpp:predicted_tokens_seconds", "gauge", "decoded tokens over decode seconds", ratio(decoded, decode_s))
    one("llamacpp:n_decode_total", "counter", "decode rounds executed", rounds)
    one("llamacpp:n_busy_slots_per_decode", "gauge", "average requests per decode round", ratio(rows, rounds))
    one("llamacpp:kv_cache_usage_ratio", "gauge", "occupied share of the device KV cache", ratio(pages_used, pages_total))
    one("llamacpp:kv_cache_tokens", "gauge", "tokens held in the device KV cache", pages_used * page)
    one("llamacpp:requests_processing", "gauge", "requests holding an execution lane", _num(snap, "lanes_active"))
    one("llamacpp:requests_deferred", "gauge", "requests waiting for admission", _num(snap, "pending"))
    one("ninfer:requests_total", "counter", "requests completed with an outcome", ended)
    one("ninfer:requests_failed_total", "counter", "accepted requests that ended in an error",
        _num(c, "requests_failed") + _num(c, "requests_timed_out"))
    one("ninfer:requests_rejected_total", "counter", "generation requests rejected during preparation",
        float(getattr(ctx, "requests_rejected", 0)))
    one("ninfer:requests_admitted", "gauge", "requests holding server ingress capacity, in any phase",
        float(ctx.ingress.admitted if ctx.ingress is not None else 0))
    one("ninfer:prefix_cache_hit_tokens_total", "counter",
        "prompt tokens of completed requests served from a cached prefix", _num(c, "prefix_cache_hit_tokens"))
    one("ninfer:draft_tokens_total", "counter", "speculative draft tokens proposed for completed requests",
        _num(c, "draft_tokens"))
    one("ninfer:draft_accepted_tokens_total", "counter", "speculative draft tokens accepted for completed requests",
        _num(c, "draft_accepted_tokens"))
    # llama.cpp's speculative series (its --metrics names), over the same completed-request totals
    one("llamacpp:spec_decode_num_draft_tokens_total", "counter", "speculative draft tokens proposed",
        _num(c, "draft_tokens"))
    one("llamacpp:spec_decode_num_accepted_tokens_total", "counter", "speculative draft tokens accepted",
        _num(c, "draft_accepted_tokens"))
    one("llamacpp:spec_decode_num_drafts_total", "counter", "speculative rounds that verified drafts",
        _num(c, "draft_rounds"))
    one("ninfer:context_cache_exhausted_requests_total", "counter",
        "requests failed because the context cache had no placement for them", _num(c, "context_cache_exhausted"))
    one("ninfer:engine_recoveries_total", "counter",
        "host-side worker failures the Engine survived instead of latching unavailable", _num(c, "engine_recoveries"))
    one("ninfer:uptime_seconds", "gauge", "seconds since the Engine became ready", ctx.uptime_s())
    one("ninfer:waiting_cancelled_requests_total", "counter",
        "requests the client cancelled while they waited for admission", _num(c, "waiting_cancelled"))
    one("ninfer:waiting_expired_requests_total", "counter", "requests that reached --pending-timeout-ms before admission",
        _num(c, "waiting_expired"))
    one("ninfer:waiting_abandoned_seconds_total", "counter", "time those cancelled and expired requests had waited",
        _num(c, "waiting_abandoned_seconds"))
    one("ninfer:cancelled_prefills_total", "counter", "requests cancelled while their prompt prefilled",
        _num(c, "cancelled_prefills"))
    one("ninfer:cancelled_prefill_computed_tokens_total", "counter", "prompt tokens those requests had computed",
        _num(c, "cancelled_prefill_computed_tokens"))
    cc = snap.get("context_cache") if isinstance(snap.get("context_cache"), dict) else {}
    salvage = cc.get("salvage") if isinstance(cc.get("salvage"), dict) else {}
    one("ninfer:cancelled_prefills_salvaged_total", "counter",
        "cancelled prefills the context cache kept at the point they reached",
        _num(salvage, "cancelled_prefills_salvaged"))
    cache = context_cache_metrics(snap)
    if not cache:  # --no-prefix-reuse: nothing is reused, every admission is a root one
        one("ninfer:reused_prompt_tokens_total", "counter",
            "prompt tokens restored from the context cache instead of prefilled", 0)
    return "\n".join(out) + "\n" + cache
