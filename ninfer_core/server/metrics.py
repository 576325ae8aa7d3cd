"""GET /metrics: the Prometheus text of the spec's "Metrics" table, from published counters only.

A prometheus_client Collector per app (`MetricsEndpoint`, no global registry) yields the families
at scrape time; prometheus_client writes the text format, so label values are escaped and numbers
formatted as Prometheus reads them. The llamacpp: series keep llama.cpp's --metrics names and
meanings; the ninfer: series follow the spec. Token and time counters are the Engine's per-unit
totals (every prefill chunk and decode round), so they advance during a long request. Everything
is read from `engine.snapshot()` (a copy taken under the engine lock, never waiting on a forward)
and the server's ingress count. `--metrics-compat vllm|sglang` adds the gauges the Gateway API
Inference Extension's endpoint picker reads, under vLLM's or SGLang's names (server/metrics_compat.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from ninfer_core.engine.cache_metrics import context_cache_families
from ninfer_core.server.context import ServerContext

# Preparation rejections that count in ninfer:requests_rejected_total (one per request_rejected
# request-log event): overload, invalid or oversized prompt or media. Unparseable and 413 bodies
# and schema validation failures are not measurement requests and are not counted.
REJECTION_CODES = frozenset({"server_overloaded", "context_length_exceeded", "invalid_prompt", "invalid_media",
                             "media_budget_exceeded", "vision_disabled", "request_queue_timeout",
                             "image_detail_not_supported", "media_fetch_failed", "media_fetch_timeout"})
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


def _num(d: Any, key: str) -> float:
    v = d.get(key, 0) if isinstance(d, dict) else 0
    return float(v) if isinstance(v, (int, float)) else 0.0


def engine_snapshot(ctx: ServerContext) -> dict[str, Any]:
    if ctx.engine is None:
        return {}
    try:
        return dict(ctx.engine.snapshot() or {})
    except Exception:  # noqa: BLE001 - a scrape must answer even if the engine is unwell
        return {}


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


class ServerCollector:
    """The families of one server's /metrics, built from one snapshot per scrape."""

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    def collect(self) -> Iterator[Metric]:
        ctx = self.ctx
        snap = engine_snapshot(ctx)
        c = snap.get("counters") if isinstance(snap.get("counters"), dict) else {}
        cc = snap.get("context_cache") if isinstance(snap.get("context_cache"), dict) else {}

        def counter(name: str, help_: str, value: float) -> Metric:
            return CounterMetricFamily(name, help_, value=value)

        def gauge(name: str, help_: str, value: float) -> Metric:
            return GaugeMetricFamily(name, help_, value=value)

        pages_total = _num(snap, "pages_total")
        pages_used = max(0.0, pages_total - _num(snap, "pages_free"))
        page = _num(snap, "page_size") or 64.0
        prompt_tokens, prompt_s = _num(c, "computed_prefill_tokens"), _num(c, "prefill_seconds")
        decoded, decode_s = _num(c, "committed_decode_tokens"), _num(c, "decode_seconds")
        rounds, rows = _num(c, "decode_rounds"), _num(c, "decode_row_rounds")
        ended = sum(_num(c, k) for k in ("requests_completed", "requests_cancelled", "requests_failed",
                                         "requests_timed_out"))
        yield counter("llamacpp:prompt_tokens_total", "prompt tokens computed by prefill; prefix-cache hits excluded",
                      prompt_tokens)
        # llama.cpp: prompt tokens matched in the cache instead of computed (here: restored from the
        # context cache at admission)
        yield counter("llamacpp:prompt_tokens_cached_total", "prompt tokens reused from the context cache "
                      "instead of computed", _num(cc, "reused_prompt_tokens"))
        yield counter("llamacpp:prompt_seconds_total", "prefill execution time", prompt_s)
        yield counter("llamacpp:tokens_predicted_total", "tokens committed by decode rounds", decoded)
        yield counter("llamacpp:tokens_predicted_seconds_total", "decode execution time", decode_s)
        yield gauge("llamacpp:prompt_tokens_seconds", "prompt tokens over prefill seconds", _ratio(prompt_tokens, prompt_s))
        yield gauge("llamacpp:predicted_tokens_seconds", "decoded tokens over decode seconds", _ratio(decoded, decode_s))
        yield counter("llamacpp:n_decode_total", "decode rounds executed", rounds)
        # llama.cpp's high-water mark (a gauge here: it is a maximum, and a counter's name ends in _total)
        yield gauge("llamacpp:n_tokens_max", "largest observed sequence length in a lane (prompt + generation)",
                    _num(snap, "n_tokens_max"))
        yield gauge("llamacpp:n_busy_slots_per_decode", "average requests per decode round", _ratio(rows, rounds))
        yield gauge("llamacpp:kv_cache_usage_ratio", "occupied share of the device KV cache",
                    _ratio(pages_used, pages_total))
        yield gauge("llamacpp:kv_cache_tokens", "tokens held in the device KV cache", pages_used * page)
        yield gauge("llamacpp:requests_processing", "requests holding an execution lane", _num(snap, "lanes_active"))
        yield gauge("llamacpp:requests_deferred", "requests waiting for admission", _num(snap, "pending"))
        yield counter("ninfer:requests_total", "requests completed with an outcome", ended)
        yield counter("ninfer:requests_failed_total", "accepted requests that ended in an error",
                      _num(c, "requests_failed") + _num(c, "requests_timed_out"))
        yield counter("ninfer:requests_rejected_total", "generation requests rejected during preparation",
                      float(getattr(ctx, "requests_rejected", 0)))
        yield gauge("ninfer:requests_admitted", "requests holding server ingress capacity, in any phase",
                    float(ctx.ingress.admitted if ctx.ingress is not None else 0))
        yield counter("ninfer:prefix_cache_hit_tokens_total",
                      "prompt tokens of completed requests served from a cached prefix", _num(c, "prefix_cache_hit_tokens"))
        yield counter("ninfer:draft_tokens_total", "speculative draft tokens proposed for completed requests",
                      _num(c, "draft_tokens"))
        yield counter("ninfer:draft_accepted_tokens_total", "speculative draft tokens accepted for completed requests",
                      _num(c, "draft_accepted_tokens"))
        # llama.cpp's speculative series (its --metrics names), over the same completed-request totals
        yield counter("llamacpp:spec_decode_num_draft_tokens_total", "speculative draft tokens proposed",
                      _num(c, "draft_tokens"))
        yield counter("llamacpp:spec_decode_num_accepted_tokens_total", "speculative draft tokens accepted",
                      _num(c, "draft_accepted_tokens"))
        yield counter("llamacpp:spec_decode_num_drafts_total", "speculative rounds that verified drafts",
                      _num(c, "draft_rounds"))
        yield counter("ninfer:context_cache_exhausted_requests_total",
                      "requests failed because the context cache had no placement for them",
                      _num(c, "context_cache_exhausted"))
        yield counter("ninfer:engine_recoveries_total",
                      "host-side worker failures the Engine survived instead of latching unavailable",
                      _num(c, "engine_recoveries"))
        yield gauge("ninfer:uptime_seconds", "seconds since the Engine became ready", ctx.uptime_s())
        yield counter("ninfer:waiting_cancelled_requests_total",
                      "requests the client cancelled while they waited for admission", _num(c, "waiting_cancelled"))
        yield counter("ninfer:waiting_expired_requests_total",
                      "requests that reached --pending-timeout-ms before admission", _num(c, "waiting_expired"))
        yield counter("ninfer:waiting_abandoned_seconds_total", "time those cancelled and expired requests had waited",
                      _num(c, "waiting_abandoned_seconds"))
        yield counter("ninfer:cancelled_prefills_total", "requests cancelled while their prompt prefilled",
                      _num(c, "cancelled_prefills"))
        yield counter("ninfer:cancelled_prefill_computed_tokens_total", "prompt tokens those requests had computed",
                      _num(c, "cancelled_prefill_computed_tokens"))
        yield counter("ninfer:cancelled_prefills_salvaged_total",
                      "cancelled prefills the context cache kept at the point they reached",
                      _num(cc.get("salvage"), "cancelled_prefills_salvaged"))
        cache = context_cache_families(snap)
        if not cache:  # --no-prefix-reuse: nothing is reused, every admission is a root one
            yield counter("ninfer:reused_prompt_tokens_total",
                          "prompt tokens restored from the context cache instead of prefilled", 0)
        yield from cache
        if ctx.options.metrics_compat:
            from ninfer_core.server.metrics_compat import gateway_families

            yield from gateway_families(ctx, snap, ctx.options.metrics_compat)


class MetricsEndpoint:
    """One app's registry with its collector; `render()` is the /metrics body."""

    # the classic text format, which generate_latest writes and every Prometheus version reads
    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ServerCollector(ctx))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def headers(self) -> dict[str, str]:
        # llama-server's: a scraper that sees it change knows the counters restarted from zero
        return {"Process-Start-Time-Unix": str(int(self.ctx.process_start_unix))}


def render_metrics(ctx: ServerContext) -> str:
    """The whole /metrics body of `ctx` as text (a registry of its own: tests and tools)."""
    return MetricsEndpoint(ctx).render().decode("utf-8")
