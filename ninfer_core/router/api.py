"""The lifecycle routes: llama.cpp's router API and the model suspend API.

GET /models, POST /models/load|unload|sleep, GET /models/sse; GET /v1/models/{id}/residency,
POST /v1/models/{id}/suspend|resume. A router also answers GET /health, GET /props (the router's
own properties, without ?model=) and GET /v1/models (every catalog model) itself. The same
routes serve a single-model server, whose catalog is its one model.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import StreamingResponse

from ninfer_core.engine.api import EngineError
from ninfer_core.router.manager import ModelManager
from ninfer_core.router.residency import ResidencyError
from ninfer_core.router.slots import LOADED, SLEEPING, ModelSlot
from ninfer_core.server.errors import install_error_handlers
from ninfer_core.version import build_string

SSE_KEEPALIVE_S = 15.0


def redacted(argv: list[str]) -> list[str]:
    args = list(argv)
    for i, a in enumerate(args):
        if a == "--api-key" and i + 1 < len(args):
            args[i + 1] = "<redacted>"
        elif a.startswith("--api-key="):
            args[i] = "--api-key=<redacted>"
    return args


def slot_object(slot: ModelSlot) -> dict[str, Any]:
    from ninfer_core.protocols.ops import model_object

    status: dict[str, Any] = {"value": slot.status, "args": redacted(getattr(slot.args, "serve_argv_model", None)
                                                                      or sys.argv[1:])}
    if slot.failed:
        status.update(failed=True, error=slot.error)
    base: dict[str, Any] = {"id": slot.name, "object": "model", "owned_by": "ninfer", "aliases": [slot.name,
                                                                                                   *slot.aliases]}
    ctx = slot.ctx
    if slot.status in (LOADED, SLEEPING) and ctx is not None and ctx.model is not None:
        base.update(model_object(ctx))  # its id first, then every alias it answers to
        base["aliases"] += [a for a in (slot.name, *slot.aliases) if a not in base["aliases"]]
        base["id"] = ctx.model.id
    base.update(path=slot.path, status=status)
    return base


def _body_model(body: Any) -> str:
    if not isinstance(body, dict) or not isinstance(body.get("model"), str) or not body["model"]:
        raise EngineError(400, "missing_required_parameter", "The body needs a 'model' string.", param="model")
    return body["model"]


def _find(manager: ModelManager, name: str) -> ModelSlot:
    slot = manager.find(name)
    if slot is None:
        raise EngineError(404, "model_not_found", f"The model '{name}' does not exist.", param="model")
    return slot


def _residency(slot: ModelSlot) -> Any:
    if slot.loaded is None or slot.status not in (LOADED, SLEEPING):
        raise EngineError(503, "model_not_loaded", f"The model '{slot.name}' is not loaded.", param="model")
    return slot.loaded.residency


def _need_suspend(slot: ModelSlot) -> None:
    if not slot.model_suspend:
        raise EngineError(400, "model_suspend_disabled", f"The model '{slot.name}' was not started with "
                          "--model-suspend.", param="model")


def _flag(request: Request, name: str) -> bool:
    values = request.query_params.getlist(name)
    if not values:
        return False
    v = values[-1].strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise EngineError(400, "invalid_value", f"{name} must be 0 or 1, got {values[-1]!r}", param=name)


async def _json(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        import json

        return json.loads(raw)
    except ValueError:
        raise EngineError(400, "invalid_json", "The body is not valid JSON.") from None


def lifecycle_routes(router: APIRouter, manager: ModelManager) -> None:
    async def catalog(request: Request) -> dict:
        # ?reload=1: read --models-dir / --models-preset again first (llama.cpp's router)
        if _flag(request, "reload"):
            await manager.reload()
        return {"object": "list", "data": [slot_object(s) for s in manager.listed()]}

    async def load(request: Request) -> dict:
        slot = _find(manager, _body_model(await _json(request)))
        manager.request_load(slot)
        return {"success": True}

    async def unload(request: Request) -> dict:
        slot = _find(manager, _body_model(await _json(request)))
        if slot.status not in (LOADED, SLEEPING) and not slot.moving:
            raise EngineError(400, "model_not_loaded", f"The model '{slot.name}' is not loaded.", param="model")
        manager.request_unload(slot)
        return {"success": True}

    async def sleep(request: Request) -> dict:
        slot = _find(manager, _body_model(await _json(request)))
        _need_suspend(slot)
        await _sleep(slot)
        return {"success": True}

    async def _sleep(slot: ModelSlot) -> None:
        try:
            await manager.sleep_now(slot)
        except ResidencyError as e:
            raise EngineError(e.status, e.code, str(e), param="model") from None

    async def events(request: Request) -> StreamingResponse:
        q = manager.subscribe()

        async def stream():
            try:
                yield ": connected\n\n"
                while True:
                    try:
                        line = await asyncio.wait_for(q.get(), SSE_KEEPALIVE_S)
                    except TimeoutError:
                        yield ": keep-alive\n\n"
                        continue
                    yield f"data: {line}\n\n"
            finally:
                manager.unsubscribe(q)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def residency(model_id: str) -> dict:
        return _residency(_find(manager, model_id)).report()

    async def suspend(model_id: str, request: Request) -> dict:
        slot = _find(manager, model_id)
        _need_suspend(slot)
        body = await _json(request)
        auto = body.get("auto_resume") if isinstance(body, dict) else None
        if auto is not None and not isinstance(auto, bool):
            raise EngineError(400, "invalid_type", "auto_resume must be a boolean.", param="auto_resume")
        res = _residency(slot)
        await _sleep(slot)
        if auto is not None:
            res.auto_resume = auto
        return res.report()

    async def resume(model_id: str) -> dict:
        slot = _find(manager, model_id)
        res = _residency(slot)
        await manager.resume_now(slot)
        if res.last_error and res.suspended:
            raise EngineError(503, "resume_failed", res.last_error, param="model")
        return res.report()

    router.add_api_route("/models", catalog, methods=["GET"])
    router.add_api_route("/models/load", load, methods=["POST"])
    router.add_api_route("/models/unload", unload, methods=["POST"])
    router.add_api_route("/models/sleep", sleep, methods=["POST"])
    router.add_api_route("/models/sse", events, methods=["GET"])
    for prefix in ("/v1", "/v1/v1"):
        router.add_api_route(prefix + "/models/{model_id:path}/residency", residency, methods=["GET"])
        router.add_api_route(prefix + "/models/{model_id:path}/suspend", suspend, methods=["POST"])
        router.add_api_route(prefix + "/models/{model_id:path}/resume", resume, methods=["POST"])


def router_only_routes(router: APIRouter, manager: ModelManager) -> None:
    async def health() -> dict:
        return {"status": "ok", "version": build_string()}

    async def props() -> dict:
        return {"role": "router", "max_instances": manager.models_max, "models_autoload": manager.autoload,
                "build_info": f"build ninfer {build_string()}", "endpoint_props": True,
                "models": [{"id": s.name, "status": s.status} for s in manager.listed()]}

    async def list_models() -> dict:
        return {"object": "list", "data": [slot_object(s) for s in manager.listed()]}

    for path in ("/health", "/v1/health"):
        router.add_api_route(path, health, methods=["GET", "HEAD"])
    router.add_api_route("/props", props, methods=["GET"])
    router.add_api_route("/v1/models", list_models, methods=["GET"])


def own_app(manager: ModelManager, router_mode: bool) -> tuple[FastAPI, set[tuple[str, str]]]:
    app = FastAPI(title="NInfer router", version=build_string(), docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    r = APIRouter()
    lifecycle_routes(r, manager)
    if router_mode:
        router_only_routes(r, manager)
    app.include_router(r)
    paths = {(m, route.path) for route in r.routes for m in getattr(route, "methods", ())}
    return app, paths
