"""`ninfer serve --models-dir DIR | --models-preset FILE`: a router, one Engine per loaded model.

Startup checks every catalog model's serve arguments (preset, then the command line) the way a
single-model server checks its own, so a bad preset fails at once with status 1; the port is
then bound and the router is ready at once. Models load on demand (or at startup with
load-on-startup = true), each into a ServerContext and app of its own, configured exactly as a
single-model server started with its arguments, except that the host, port, API key and CORS
are the router's (spec "Several models (router)").
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from ninfer_core.router.catalog import CatalogError, build_catalog, model_arguments
from ninfer_core.router.manager import ModelManager
from ninfer_core.router.prepare import PrepareError, model_options, prepare
from ninfer_core.router.reporting import check_model_logs, open_model_log, start_stats
from ninfer_core.router.residency import Residency
from ninfer_core.router.slots import Loaded, ModelSlot, stop_loaded

log = logging.getLogger("ninfer")


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 1


def check_suspend(options: Any, device: str) -> None:
    if options.engine.cuda_graph and device.startswith("cuda") and getattr(options, "_model_suspend", False):
        raise PrepareError("--model-suspend on CUDA needs --no-cuda-graph: a resumed model's memory may sit at other "
                           "addresses than its captured CUDA Graphs (this build has no CUDA virtual memory mapping)")


class RouterBackend:
    """Loads a catalog model into its own ServerContext and app."""

    def __init__(self, host: Any, console: Any = None):
        self.host = host
        self.console = console  # the router's: each model's stats line (reporting.py)
        self.manager: ModelManager | None = None

    def load(self, slot: ModelSlot) -> Loaded:
        from ninfer_core.server.app import create_app
        from ninfer_core.server.context import ServerContext
        from ninfer_core.server.loader import Loader, resolve_device

        options = model_options(slot.args, self.host)
        # the listener, key and CORS are the router's; the model answers to its catalog names
        options.api_key, options.cors, options.cors_origins = None, False, None
        options.model_id, options.aliases = slot.name, list(slot.aliases)
        options.no_webui, options.webui_dir = True, None
        options._model_suspend = slot.model_suspend
        check_suspend(options, resolve_device(options.engine.device))
        prepared = prepare(options, self.host)
        ctx = ServerContext(options=options, plugins=self.host)
        ctx.webui = None
        ctx.request_log = open_model_log(options, slot.name)  # before the app: its middleware marks requests
        app = create_app(ctx)
        loader = Loader(ctx, prepared.artifact, prepared.family_reg, prepared.template, prepared.spec_reg)
        manager = self.manager

        def failed(reason: str) -> None:
            ctx.engine_failure = reason
            if manager is not None:
                manager.on_engine_failure(slot, reason)

        loader.on_engine_failure = failed
        loader.run()  # this thread: the manager runs loads off the event loop
        residency = Residency.from_args(loader.engine, slot.args, prepared.artifact) \
            if loader.engine is not None else None
        loaded = Loaded(ctx, app, loader, residency)
        if ctx.load_error:
            stop_loaded(loaded)
            raise PrepareError(ctx.load_error)
        ctx.residency = residency
        start_stats(loader, options, self.console, slot.name)
        return loaded

    def unload(self, slot: ModelSlot, loaded: Loaded) -> None:
        stop_loaded(loaded)


class Lifespan:
    """ASGI lifespan: start the manager (and load-on-startup models), unload every model at the end."""

    def __init__(self, app: Any, manager: ModelManager, startup: list[ModelSlot]):
        self.app, self.manager, self.startup = app, manager, startup

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.manager.start()
                for slot in self.startup:
                    self.manager.request_load(slot)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.manager.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


def build_slots(args: Any, host: Any, backend: Any) -> list[ModelSlot]:
    parser = getattr(args, "serve_parser", None)
    if parser is None:
        raise CatalogError("the router needs the serve command line (start it through `ninfer serve`)")
    entries = build_catalog(args.models_dir, args.models_preset, parser)
    if not entries:
        raise CatalogError("the catalog is empty: no .ninfer in --models-dir and no model in --models-preset")
    slots = []
    for e in entries:
        if not e.path:
            raise CatalogError(f"model {e.name}: no artifact path")
        ns = model_arguments(e, list(getattr(args, "serve_argv", [])), parser)
        ns.serve_argv_model = [*e.preset_args, *getattr(args, "serve_argv", [])]
        model_options(ns, host)  # refuses a bad combination now, not at the model's first request
        slots.append(ModelSlot(e.name, e.aliases, e.path, ns, backend))
        slots[-1].load_on_startup = e.load_on_startup
    try:
        check_model_logs(slots)
    except ValueError as e:
        raise CatalogError(str(e)) from None
    return slots


def run_router(args: Any, host: Any) -> int:
    import uvicorn

    from ninfer_core.config import options_from_args
    from ninfer_core.plugins import PluginError
    from ninfer_core.router.api import own_app
    from ninfer_core.router.front import RouterFront
    from ninfer_core.server.console import Console
    from ninfer_core.server.context import ServerContext
    from ninfer_core.server.lifecycle import StopControl, make_server
    from ninfer_core.server.listen import BindError, announce, bind_sockets
    from ninfer_core.server.middleware import ServerMiddleware
    from ninfer_core.version import build_string

    try:
        options = options_from_args(args)
    except ValueError as e:
        return _fail(str(e))
    console = Console(options.log_level, options.log_colours, False)
    control = StopControl(lambda: True, console)
    control.install()
    try:
        host.load()
        backend = RouterBackend(host, console)
        slots = build_slots(args, host, backend)
    except (CatalogError, PrepareError, PluginError) as e:
        return _fail(str(e))
    manager = ModelManager(slots, args.models_max, args.models_autoload)
    backend.manager = manager

    def rebuild() -> list[ModelSlot]:  # GET /models?reload=1: the startup checks, on the files as they are now
        try:
            return build_slots(args, host, backend)
        except (PrepareError, PluginError) as e:
            raise CatalogError(str(e)) from None

    manager.rebuild = rebuild
    ctx = ServerContext(options=options, plugins=host)
    ctx.mark_ready()
    own, own_paths = own_app(manager, router_mode=True)
    app = Lifespan(ServerMiddleware(RouterFront(own, manager, own_paths), ctx=ctx), manager,
                   [s for s in slots if getattr(s, "load_on_startup", False)])
    hosts = options.hosts or [options.host]
    try:
        socks = bind_sockets(hosts, options.port)
    except BindError as e:
        return _fail(f"cannot listen on {e.address}:{e.port}: {e.reason}")
    port = socks[0].getsockname()[1]
    log.info("ninfer %s", build_string())
    log.info("listening on %s (API base %s/v1)", " and ".join(announce(h, port) for h in hosts),
             announce(hosts[0], port))
    log.info("router: %d models (%s), at most %s loaded at once", len(slots), ", ".join(s.name for s in slots),
             args.models_max or "any number")
    for flag, given in (("--stats-port", options.stats_port is not None), ("--log-stats-panel", options.log_stats_panel)):
        if given:  # docs/router.md: one engine's listener and panel; a router has several engines
            log.warning("%s is a single-model option: a router ignores it (each model's /stats, /v1/load and "
                        "/metrics answer on the main port with ?model=)", flag)
    level = options.log_level if options.log_level in ("debug", "warning", "error", "critical") else "warning"
    config = uvicorn.Config(app, log_level=level, access_log=False, lifespan="on", timeout_graceful_shutdown=5,
                            timeout_keep_alive=30)
    server = make_server(config, control)
    try:
        server.run(sockets=socks)
    finally:
        for sock in socks:
            sock.close()
        for s in manager.slots:  # a lifespan that never ran its shutdown: unload here
            if s.loaded is not None:
                s.do_unload()
        log.info("server stopped")
        console.close()
    return 0

