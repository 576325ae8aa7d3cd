"""`ninfer serve`: resolve plugins and the artifact, bind the port, then load the model behind it.

Order (spec "Startup readiness"): everything that can fail fast (plugins, artifact, model family,
KV dtype, chat template file, the port) fails before any weight is read, with `error: ...` and exit
status 1. The port is bound and served at once, answering 503 model_loading, while a background
thread loads the weights, starts the Engine and runs a warmup forward (server/loader.py); then the
server is ready. Stopping is server/lifecycle.py; exit status 0 stopped, 1 startup, 2 engine failure.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
from pathlib import Path

from ninfer_core.config import options_from_args
from ninfer_core.plugins import PluginError, PluginHost, PluginSelection
from ninfer_core.server.context import ServerContext

# bind_socket stays importable from here (bench, tests)
from ninfer_core.server.listen import BindError, announce, bind_socket, bind_sockets  # noqa: F401
from ninfer_core.server.loader import (  # noqa: F401 - importable from here as before
    Loader,
    artifact_facts,
    public_model_id,
    resolve_device,
)
from ninfer_core.version import build_string

log = logging.getLogger("ninfer")

EXIT_STARTUP = 1
EXIT_ENGINE_FAILURE = 2


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return EXIT_STARTUP


def cache_dir() -> Path:
    d = Path(os.environ.get("NINFER_CACHE_DIR") or Path.home() / ".cache" / "ninfer")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _spec_plugins(host: PluginHost) -> set[str]:
    return {r.plugin for r in host.registry("spec_backend").values()}


LOADER_JOIN_S = 2.0  # how long a stop waits for an interrupted model load to reach its next step


def run_serve(args, host: PluginHost | None = None) -> int:
    """`ninfer serve`; `host` is the plugin host the command line was parsed with (cli.main)."""
    if (getattr(args, "models_dir", None) or getattr(args, "models_preset", None)) and not args.artifact:
        from ninfer_core.router.serve import run_router  # several models: spec "Several models (router)"

        return run_router(args, host or PluginHost(PluginSelection.from_sources(args.plugin)))
    try:
        options = options_from_args(args)
    except ValueError as e:  # a refused option combination (e.g. --no-prefix-reuse with a capacity)
        return _fail(str(e))
    options.router_args = args  # the lifecycle options of ninfer_core.router.single
    from ninfer_core.server.console import Console
    from ninfer_core.server.lifecycle import StopControl

    console = Console(options.log_level, options.log_colours, options.log_stats_panel)
    started: dict = {}  # the ServerContext once there is one (readiness decides what Ctrl+C does)
    control = StopControl(lambda: started.get("ctx") is not None and started["ctx"].ready, console)
    control.install()
    host = host or PluginHost(PluginSelection.from_sources(args.plugin))
    try:
        host.load()
        for kind in ("protocol", "model_family", "kv_dtype", "spec_backend", "prefix_cache"):
            host.registry(kind)
        options.plugin_options = argparse.Namespace(
            **{o.dest: getattr(args, o.dest, o.kwargs.get("default")) for o in host.serve_options()})
        spec_reg = host.resolve_spec_backend(options.spec) if options.spec else None
        if spec_reg is not None:
            spec_reg.load().check_options(options.plugin_options)
    except PluginError as e:
        return _fail(str(e))
    except ValueError as e:  # a refused speculative option combination
        return _fail(str(e))
    if spec_reg is None and any(getattr(args, o.dest, None) not in (None, False, o.kwargs.get("default"))
                                for o in host.serve_options() if o.plugin in _spec_plugins(host)):
        return _fail("speculative-decoding options need a backend: add --spec NAME")

    from ninfer_core.artifact import Artifact, ArtifactError

    path = options.artifact
    if not path:
        try:
            path = host.default_artifact(str(cache_dir()))
        except Exception as e:  # noqa: BLE001 - a plugin's builder failing is a startup error
            return _fail(f"building the default artifact failed: {type(e).__name__}: {e}")
        if not path:
            return _fail("no artifact given and no installed plugin provides a default one")
        path = str(path)
        options.artifact = path
    try:
        artifact = Artifact.open(path)
    except ArtifactError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"cannot open artifact {path}: {e}")
    try:
        family_reg = host.family_for_architecture(artifact.architecture)
        from ninfer_core.server.loader import resolve_kv_dtype

        options.kv_format = resolve_kv_dtype(host, options.engine.kv_dtype)
    except (PluginError, ValueError) as e:
        return _fail(str(e))
    if options.devices:
        err = check_pipeline(options, artifact, family_reg)
        if err:
            return _fail(err)
    from ninfer_core.tokenizer.builtin_templates import resolve_chat_template
    from ninfer_core.tokenizer.chat_template import ChatTemplate, TemplateError

    try:
        if options.chat_template:
            template = resolve_chat_template(options.chat_template, host)
        else:
            template = ChatTemplate(artifact.chat_template) if artifact.chat_template else None
    except TemplateError as e:
        return _fail(str(e))
    if template is None:
        from ninfer_core.tokenizer.builtin_templates import family_chat_template

        target = family_reg.load()
        found = family_chat_template(target() if isinstance(target, type) else target, artifact.architecture)
        if found is not None:
            template = ChatTemplate(found[0])
            log.warning("the artifact has no chat template: using %s (--chat-template NAME|FILE picks another)",
                        found[1])
        else:
            log.warning("the artifact has no chat template: chat requests will be refused with 400 "
                        "no_chat_template (use --chat-template NAME|FILE)")

    ctx = ServerContext(options=options, plugins=host)
    from ninfer_core.server.webui import WebUI, WebUIError, resolve_webui_dir

    try:
        webui_root = resolve_webui_dir(options.webui_dir, options.no_webui)
    except WebUIError as e:
        return _fail(str(e))
    ctx.webui = WebUI(webui_root) if webui_root is not None else None
    started["ctx"] = ctx
    if options.request_log_jsonl:
        from ninfer_core.server.request_log import RequestLog, RequestLogError, check_log_path

        try:
            check_log_path(options.request_log_jsonl, path)
            ctx.request_log = RequestLog(options.request_log_jsonl, options.request_log_max_mib,
                                         options.request_log_keep)
        except RequestLogError as e:
            return _fail(str(e))
    from ninfer_core.server.app import create_app

    try:
        app = create_app(ctx)
    except PluginError as e:
        return _fail(str(e))
    hosts = options.hosts or [options.host]
    try:
        socks = bind_sockets(hosts, options.port)
    except BindError as e:
        return _fail(f"cannot listen on {e.address}:{e.port}: {e.reason}")
    port = socks[0].getsockname()[1]
    stats_socks: list[socket.socket] = []
    if options.stats_port is not None:
        try:
            stats_socks = bind_sockets(hosts, options.stats_port)
        except BindError as e:
            for sk in socks:
                sk.close()
            return _fail(f"cannot listen on {e.address}:{e.port} (--stats-port): {e.reason}")
    base = announce(hosts[0], port)
    log.info("ninfer %s", build_string())
    log.info("listening on %s (API base %s/v1)", " and ".join(announce(h, port) for h in hosts), base)
    if ctx.webui is not None:
        log.info("WebUI on %s/ (from %s)", base, ctx.webui.root)
    if stats_socks:
        stats_port = stats_socks[0].getsockname()[1]
        log.info("stats listening on %s (GET /health, /stats, /v1/load, /metrics)",
                 " and ".join(announce(h, stats_port) for h in hosts))
    log.info("loading %s (%s) from %s", public_model_id(options, artifact), artifact.architecture, path)

    return _serve_until_stopped(ctx, app, options, artifact, family_reg, template, spec_reg, console, socks,
                                stats_socks, control)


def check_pipeline(options, artifact, family_reg) -> str | None:
    """The reason --devices / --stage-layers cannot split this model, before any weight is read."""
    from ninfer_core.engine.pipeline.split import StageSplitError, plan_stages

    target = family_reg.load()
    family = target() if isinstance(target, type) else target
    n = int(getattr(family, "pipeline_layers", lambda _a: 0)(artifact) or 0)
    if n <= 0:
        return f"--devices: the {family_reg.name} family cannot run as pipeline stages"
    try:
        plan_stages(n, options.devices, options.stage_layers, cuts=getattr(family, "pipeline_cuts", lambda _a: None)(
            artifact))
    except StageSplitError as e:
        return str(e)
    return None


def _serve_until_stopped(ctx, app, options, artifact, family_reg, template, spec_reg, console, socks,
                         stats_socks, control) -> int:
    import uvicorn

    from ninfer_core.server.lifecycle import make_server

    level = options.log_level if options.log_level in ("debug", "info", "warning", "error", "critical") else (
        "debug" if options.log_level == "trace" else "critical")
    # uvicorn's own access log stays off: the middleware writes one line per request (server/access_log.py)
    uv_level = "warning" if level == "info" else level
    config = uvicorn.Config(app, log_level=uv_level, access_log=False, lifespan="off", timeout_graceful_shutdown=5,
                            timeout_keep_alive=30)
    loader = Loader(ctx, artifact, family_reg, template, spec_reg, console=console)
    shutdown_done = threading.Event()
    shutdown_lock = threading.Lock()

    def shutdown_engine() -> None:
        with shutdown_lock:
            if shutdown_done.is_set():
                return
            loader.stopping.set()
            if loader.stats is not None:
                loader.stats.stop()
            engine = loader.engine
            if engine is not None:  # running and queued requests end with 503 service_unavailable
                try:
                    engine.shutdown()
                except Exception as e:  # noqa: BLE001
                    log.warning("engine shutdown: %s", e)
                close = getattr(engine.runner, "close", None)  # a pipeline's stage processes
                if close is not None:
                    close()
            if loader.throughput is not None:
                loader.throughput.stop()  # the last partial interval
            if ctx.request_log is not None:
                ctx.request_log.close()
            shutdown_done.set()

    stats_server = None
    if stats_socks:
        from ninfer_core.server.app import create_stats_app

        stats_server = uvicorn.Server(uvicorn.Config(
            create_stats_app(ctx), log_level=uv_level, access_log=False,
            lifespan="off", timeout_graceful_shutdown=2, timeout_keep_alive=30))
        # Its own thread and event loop: a scrape never waits behind the request pool.
        threading.Thread(target=stats_server.run, kwargs={"sockets": stats_socks}, name="ninfer-stats",
                         daemon=True).start()
        control.on_stop(lambda: setattr(stats_server, "should_exit", True))
    control.on_stop(lambda: threading.Thread(target=shutdown_engine, name="ninfer-shutdown", daemon=True).start())
    server = make_server(config, control)

    def on_engine_failure(reason: str) -> None:
        ctx.engine_failure = reason
        log.error("engine failed: %s; the server stops (exit status %d)", reason, EXIT_ENGINE_FAILURE)
        control.request_stop("engine failure")

    loader.on_failure = lambda: control.request_stop("model load failed")
    loader.on_engine_failure = on_engine_failure
    from ninfer_core.router.single import SingleGate  # /models*, suspend, idle sleep and unload

    ctx.gate = SingleGate(ctx, loader, options.router_args)
    loader.thread.start()
    try:
        server.run(sockets=socks)
    finally:
        for sock in socks:
            sock.close()
        if stats_server is not None:
            stats_server.should_exit = True
        shutdown_engine()
        # a stop during the load (Ctrl-C at startup): the loader ends at its next step (it checks
        # `stopping` and shuts down an engine it made late); give it a moment to get there
        loader.thread.join(LOADER_JOIN_S)
        log.info("server stopped")
        console.close()
    rc = 0
    if ctx.load_error:
        print(f"error: loading the model failed: {ctx.load_error}", file=sys.stderr, flush=True)
        rc = EXIT_STARTUP
    elif ctx.engine_failure:
        print(f"error: the engine failed: {ctx.engine_failure}", file=sys.stderr, flush=True)
        rc = EXIT_ENGINE_FAILURE
    if loader.thread.is_alive():
        # still inside the family's load (minutes for a large model): the interpreter's teardown
        # under a thread in torch's native code aborts the process ("terminate called without an
        # active exception", status -6), so this exit skips the teardown once the logs are out
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc
