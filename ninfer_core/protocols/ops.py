"""Built-in protocol plugin: operational routes (health, API index, models, props, load).

GET /health, GET /v1, GET /v1/models, GET /v1/models/{id}, GET /models (llama.cpp's catalog of
the one model), GET /props, GET /v1/load and GET /metrics,
in the shapes of the spec's Server version, Models, Props, Load and Metrics sections. /v1/load and
/metrics read only the engine's published snapshot and the ingress count (never wait on a forward);
like every route but /health they need the API key when one is configured.
"""

from __future__ import annotations

import sys
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ninfer_core import hookimpl
from ninfer_core.engine.api import EngineError
from ninfer_core.server.context import ServerContext
from ninfer_core.server.metrics import MetricsEndpoint
from ninfer_core.server.prepare import default_settings
from ninfer_core.version import build_string


def model_object(ctx: ServerContext) -> dict[str, Any]:
    m = ctx.model
    inputs = ["text", "image", "video"] if m.vision else ["text"]
    return {
        "id": m.id, "object": "model", "created": m.created, "owned_by": "ninfer",
        # llama-server's: every name the model answers to (its id first), and --tags
        "aliases": [m.id, *m.aliases], "tags": list(m.tags),
        "max_model_len": m.max_model_len, "context_window": m.max_model_len, "context_length": m.max_model_len,
        "modalities": {"vision": m.vision},
        "architecture": {"input_modalities": inputs, "output_modalities": ["text"]},
        "meta": {"n_vocab": m.n_vocab, "n_ctx": m.max_model_len, "n_ctx_train": m.n_ctx_train,
                 "n_embd": m.n_embd, "n_params": m.n_params, "size": m.size, "ftype": m.ftype},
    }


def _speculative(ctx: ServerContext) -> bool:
    try:
        return bool((ctx.engine.snapshot() or {}).get("speculative")) if ctx.engine is not None else False
    except Exception:  # noqa: BLE001 - /props answers even if the engine is unwell
        return False


def catalog_entry(ctx: ServerContext) -> dict[str, Any]:
    """GET /models on a single-model server: the spec's catalog entry of its one model (status,
    path, aliases) with the fields of /v1/models. The serve arguments hide the API key."""
    args = list(sys.argv[1:])
    for i, a in enumerate(args):
        if a == "--api-key" and i + 1 < len(args):
            args[i + 1] = "<redacted>"
        elif a.startswith("--api-key="):
            args[i] = "--api-key=<redacted>"
    return {**model_object(ctx), "path": ctx.model.artifact_path, "status": {"value": "loaded", "args": args}}


def props(ctx: ServerContext) -> dict[str, Any]:
    eng = ctx.options.engine
    limit = eng.default_max_tokens if eng.default_max_tokens is not None else -1
    params = {"n_predict": limit, "max_tokens": limit, **default_settings(ctx)}
    return {
        "default_generation_settings": {"n_ctx": eng.max_context, "speculative": _speculative(ctx),
                                        "params": params},
        "total_slots": eng.max_concurrency,
        "model_alias": ctx.model.id,
        "model_path": ctx.model.artifact_path,
        "modalities": {"vision": ctx.model.vision, "audio": False},
        "build_info": f"ninfer {build_string()}",
        "endpoint_slots": not ctx.options.no_slots, "endpoint_props": True, "endpoint_metrics": True,
        "cors_proxy_enabled": bool(getattr(ctx.options, "webui_mcp_proxy", False)),
        # llama.cpp's: a suspended model (ninfer_core.router.residency)
        "is_sleeping": bool(getattr(getattr(ctx, "residency", None), "suspended", False)),
    }


def _int(snap: dict, *keys: str, default: int = 0) -> int:
    for k in keys:
        v = snap.get(k)
        if isinstance(v, (int, float)):
            return int(v)
    return default


def load_report(ctx: ServerContext) -> dict[str, Any]:
    """GET /v1/load from the engine's published snapshot and the server's ingress count."""
    eng = ctx.options.engine
    snap: dict[str, Any] = {}
    if ctx.engine is not None:
        try:
            snap = dict(ctx.engine.snapshot() or {})
        except Exception:  # noqa: BLE001 - a load probe must answer even if the engine is unwell
            snap = {}
    page = _int(snap, "page_size", default=64)
    pages_total = _int(snap, "pages_total")
    pages_used = max(0, pages_total - _int(snap, "pages_free", default=pages_total))
    slots_total = _int(snap, "slots_total", default=eng.max_concurrency)
    slots_used = max(0, slots_total - _int(snap, "slots_free", default=slots_total))
    counters = snap.get("counters") if isinstance(snap.get("counters"), dict) else {}
    cc = snap.get("context_cache") if isinstance(snap.get("context_cache"), dict) else {}
    running = _int(snap, "lanes_active")
    prefilling = _int(snap, "prefilling")
    return {
        "object": "ninfer.load",
        "model": ctx.model.id,
        "uptime_seconds": round(ctx.uptime_s(), 3),
        "capacity": {
            "max_concurrency": eng.max_concurrency, "max_pending_requests": eng.max_pending_requests,
            "max_admitted_requests": eng.max_concurrency + eng.max_pending_requests,
            "max_context": eng.max_context, "kv_capacity_tokens": pages_total * page,
            "kv_capacity_pages": pages_total, "kv_page_tokens": page,
            "device_state_slots": slots_total + _int(cc, "device_state_slots"),
            "host_state_slots": _int(cc, "host_state_slots"), "host_kv_bytes": _int(cc, "host_kv_bytes"),
        },
        "requests": {
            "admitted": ctx.ingress.admitted, "running": running,
            "prefilling": min(prefilling, 1), "decode_ready": _int(snap, "decode_ready"),
            "waiting": _int(snap, "pending"),
            # Admitted lanes still restoring their reused prefix: the engine materializes a lane
            # within the boundary that admits it, so none is ever observed in that state.
            "materializing": _int(snap, "materializing"),
        },
        "occupancy": {
            "device_main_kv_pages": pages_used, "device_main_kv_tokens": pages_used * page,
            "device_state_slots": slots_used + _int(cc, "device_state_slots_used"),
            "host_state_slots": _int(cc, "host_state_slots_used"), "host_kv_bytes": _int(cc, "host_kv_bytes_used"),
        },
        "counters": {
            # The engine's own monotonic request and token counts, then the spec's names over them.
            **{k: int(v) for k, v in counters.items()
               if isinstance(v, (int, float)) and not k.endswith("_seconds")},
            # Prompt tokens the prefill units computed (reused ones excluded), counted per chunk.
            "computed_prefill_tokens": _int(counters, "computed_prefill_tokens"),
            "committed_decode_tokens": _int(counters, "committed_decode_tokens"),
            "reused_prompt_tokens": _int(cc, "reused_prompt_tokens"),
            "decode_rounds": _int(counters, "decode_rounds"),
            "decode_row_rounds": _int(counters, "decode_row_rounds"),
        },
    }


def stats_report(ctx: ServerContext) -> dict[str, Any]:
    """GET /stats: the /v1/load report plus the ingress peak, the engine's counters since startup
    (tokens, rates over the uptime, scheduler, decode batches, context cache) and the queue."""
    report = load_report(ctx)
    snap: dict[str, Any] = {}
    if ctx.engine is not None:
        try:
            snap = dict(ctx.engine.snapshot() or {})
        except Exception:  # noqa: BLE001 - a stats probe must answer even if the engine is unwell
            snap = {}
    c = report["counters"]
    raw = snap.get("counters") if isinstance(snap.get("counters"), dict) else {}
    uptime = max(float(report["uptime_seconds"]), 1e-9)
    rounds = c.get("decode_rounds", 0)
    queue = [q for q in snap.get("queue") or [] if isinstance(q, dict)]
    report.update({
        "object": "ninfer.stats",
        "tokens": {"prompt": c.get("prompt_tokens_total", 0), "prefill": c["computed_prefill_tokens"],
                   "reused": c["reused_prompt_tokens"], "decode": c["committed_decode_tokens"],
                   "generated": c.get("generated_tokens_total", 0)},
        "throughput_tokens_per_second": {"prefill": c["computed_prefill_tokens"] / uptime,
                                         "decode": c["committed_decode_tokens"] / uptime},
        "scheduler": dict(report["requests"]),
        "decode_batch": {"rounds": rounds, "row_rounds": c["decode_row_rounds"],
                         "average_size": c["decode_row_rounds"] / rounds if rounds else None},
        "seconds": {"prefill": float(raw.get("prefill_seconds", 0.0)), "decode": float(raw.get("decode_seconds", 0.0)),
                    "context_transfer": float(raw.get("context_transfer_seconds", 0.0))},
        "context_cache": snap.get("context_cache"),
        "queue": {"depth": report["requests"]["waiting"],
                  "entries": [{"request_id": q.get("request_id"), "position": q.get("position"),
                               "wait_seconds": round(float(q.get("wait_seconds", 0.0)), 3)} for q in queue]},
    })
    report["requests"]["peak_admitted"] = ctx.ingress.peak
    model = snap.get("model") if isinstance(snap.get("model"), dict) else {}
    for name, block in model.items():  # the model family's own blocks; never over a core key
        if isinstance(block, dict):
            report.setdefault(name, block)
    return report


def mount_status_routes(router: APIRouter, ctx: ServerContext) -> None:
    """GET /health, /v1/load, /metrics and /stats: on the main listener (through Ops) and alone on
    the --stats-port listener."""
    async def health() -> dict:
        return {"status": "ok", "version": build_string()}

    async def get_load() -> dict:
        return load_report(ctx)

    async def get_stats() -> dict:
        return stats_report(ctx)

    metrics = MetricsEndpoint(ctx)  # this app's own registry and collector

    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type, headers=metrics.headers())

    # HEAD too: probes (and curl -I) ask without a body
    for path in ("/health", "/v1/health"):  # /v1/health: llama-server's second spelling
        router.add_api_route(path, health, methods=["GET"])
        router.add_api_route(path, health, methods=["HEAD"])
    router.add_api_route("/v1/load", get_load, methods=["GET"])
    router.add_api_route("/metrics", get_metrics, methods=["GET"])
    router.add_api_route("/stats", get_stats, methods=["GET"])


class Ops:
    name = "ops"

    def mount(self, router: APIRouter, ctx: ServerContext) -> None:
        async def api_index(request: Request) -> dict:
            owners = getattr(request.app.state, "routes", {})
            routes = [{"method": m, "path": p, "protocol": owners[(m, p)]}
                      for (m, p) in sorted(owners, key=lambda k: (k[1], k[0])) if m != "HEAD"]
            return {"object": "ninfer.api_index", "model": ctx.model.id, "version": build_string(),
                    "endpoints": routes}

        async def list_models() -> dict:
            return {"object": "list", "data": [model_object(ctx)]}

        async def get_model(model_id: str) -> dict:
            if not ctx.serves_model(model_id):
                raise EngineError(404, "model_not_found", f"The model '{model_id}' does not exist; this server "
                                  f"serves '{ctx.model.id}'.", param="model")
            return model_object(ctx)

        async def catalog() -> dict:
            return {"object": "list", "data": [catalog_entry(ctx)]}

        async def get_props() -> dict:
            return props(ctx)

        mount_status_routes(router, ctx)
        router.add_api_route("/v1", api_index, methods=["GET"])
        router.add_api_route("/v1/models", list_models, methods=["GET"])
        router.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
        router.add_api_route("/models", catalog, methods=["GET"])
        router.add_api_route("/props", get_props, methods=["GET"])


PROTOCOL = Ops()


@hookimpl
def ninfer_register_protocols(register):
    register("ops", "ninfer_core.protocols.ops:PROTOCOL")
