"""`create_app(ctx)`: the FastAPI app of one server; every route comes from a protocol plugin.

Protocols are read from the plugin host's "protocol" registry (`ninfer_register_protocols`); the
built-in ops and openai_chat are registered there exactly as an outside protocol would be. Each
registered target is an object with `mount(router, ctx)`; two protocols mounting one method and
path is a startup error naming both.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI

from ninfer_core.plugins import PluginError, PluginHost, PluginSelection
from ninfer_core.server.context import ServerContext
from ninfer_core.server.errors import install_error_handlers
from ninfer_core.server.middleware import ServerMiddleware
from ninfer_core.server.openapi import install_openapi
from ninfer_core.version import build_string


class ProtocolConflictError(PluginError):
    pass


def create_app(ctx: ServerContext) -> FastAPI:
    """Build the app around `ctx` (no module-level state; several apps can live in one process)."""
    if ctx.plugins is None:
        ctx.plugins = PluginHost(PluginSelection(autoload=False))
    docs = ctx.options.api_docs  # /docs and /redoc only when asked: they load their scripts from a CDN
    app = FastAPI(title="NInfer", version=build_string(), docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json",
                  description="OpenAI-, Anthropic- and llama.cpp-compatible inference server (ninfer serve).")
    app.state.ctx = ctx
    install_error_handlers(app)
    app.state.routes = mount_protocols(app, ctx)
    install_openapi(app, bool(ctx.options.api_key))
    from ninfer_core.server.webui import install as install_webui

    install_webui(app, ctx)  # last: its catch-all takes only what no protocol route does
    if ctx.request_log is not None:  # inside ServerMiddleware: sees the undoubled path, authorized requests
        from ninfer_core.server.request_log import RequestLogMiddleware

        app.add_middleware(RequestLogMiddleware)
    if ctx.options.engine.ngram_archive_mib:  # X-NInfer-Draft-Session binds requests to a draft session
        from ninfer_core.server.draft_session import DraftSessionMiddleware

        app.add_middleware(DraftSessionMiddleware)
    app.add_middleware(ServerMiddleware, ctx=ctx)
    return app


def create_stats_app(ctx: ServerContext) -> FastAPI:
    """The --stats-port app: GET /health, /stats, /v1/load and /metrics only, under the main listener's
    readiness and API-key rules, so a dashboard or watchdog never queues behind the request pool."""
    from ninfer_core.protocols.ops import mount_status_routes

    app = FastAPI(title="NInfer stats", version=build_string(), docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)
    router = APIRouter()
    mount_status_routes(router, ctx)
    app.include_router(router)
    app.add_middleware(ServerMiddleware, ctx=ctx)
    return app


def mount_protocols(app: FastAPI, ctx: ServerContext) -> dict[tuple[str, str], str]:
    """Mount every registered protocol; returns {(method, path): protocol name}."""
    owners: dict[tuple[str, str], str] = {}
    for name, reg in ctx.plugins.registry("protocol").items():
        protocol = reg.load()
        router = APIRouter()
        protocol.mount(router, ctx)
        for route in router.routes:
            methods = getattr(route, "methods", None) or {"*"}
            for method in methods:
                key = (method, route.path)
                if key in owners:
                    other = owners[key]
                    raise ProtocolConflictError(
                        f"protocols {other!r} ({ctx.plugins.registry('protocol')[other].package}) and "
                        f"{name!r} ({reg.package}) both mount {method} {route.path}")
                owners[key] = name
        app.include_router(router)
    return owners
