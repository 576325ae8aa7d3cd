"""`ninfer serve`: resolve plugins and the artifact, bind the port, then load the model behind it.

Order (spec "Startup readiness"): everything that can fail fast (plugins, artifact, model family,
KV dtype, chat template file, the port) fails before any weight is read, with `error: ...` and exit
status 1. The port is bound and served at once, answering 503 model_loading, while a background
thread loads the weights, starts the Engine and runs a warmup forward; then the server is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ninfer_core.config import ServeOptions, options_from_args
from ninfer_core.plugins import PluginError, PluginHost, PluginSelection
from ninfer_core.server.context import ServedModel, ServerContext
# bind_socket stays importable from here (bench, tests)
from ninfer_core.server.listen import BindError, announce, bind_socket, bind_sockets  # noqa: F401
from ninfer_core.server.prepare import default_sampling_presets
from ninfer_core.version import build_string

log = logging.getLogger("ninfer")

_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL, "off": logging.CRITICAL + 10}


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 1


def _setup_logging(level_name: str) -> None:
    level = _LEVELS.get(level_name, logging.INFO)
    root = logging.getLogger("ninfer")
    root.setLevel(level)
    if not root.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(message)s", "%H:%M:%S"))
        root.addHandler(h)
    root.propagate = False


def cache_dir() -> Path:
    d = Path(os.environ.get("NINFER_CACHE_DIR") or Path.home() / ".cache" / "ninfer")
    d.mkdir(parents=True, exist_ok=True)
    return d


def resolve_device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def artifact_facts(artifact: Any) -> dict[str, Any]:
    """n_params (logical elements), size (encoded payload bytes) and ftype (encodings joined by +)."""
    names = artifact.tensor_names()
    counts: dict[str, int] = {}
    for n in names:
        enc = artifact.tensor_encoding(n)
        counts[enc] = counts.get(enc, 0) + 1
    return {"n_params": artifact.num_parameters(), "size": sum(artifact.tensor_nbytes(n) for n in names),
            "ftype": "+".join(sorted(counts, key=lambda k: (-counts[k], k)))}


def public_model_id(options: ServeOptions, artifact: Any) -> str:
    """--model-id, else the first --alias (llama-server's --alias names the model), else the artifact's."""
    identity = artifact.manifest.get("identity") or {}
    first_alias = options.aliases[0] if options.aliases else None
    return options.model_id or first_alias or identity.get("model_id") or artifact.name or artifact.architecture


class _Loader:
    """Loads the model behind a serving port: family.load, Engine start, warmup, then ready."""

    def __init__(self, ctx: ServerContext, artifact: Any, family_reg: Any, template: Any, spec_reg: Any = None):
        self.ctx, self.artifact, self.family_reg, self.template = ctx, artifact, family_reg, template
        self.spec_reg = spec_reg
        self.stopping = threading.Event()
        self.engine: Any = None
        self.throughput: Any = None  # request_log.ThroughputReporter with --request-log-jsonl
        self.on_failure = lambda: None
        self.thread = threading.Thread(target=self.run, name="ninfer-loader", daemon=True)

    def run(self) -> None:
        ctx = self.ctx
        try:
            t0 = time.monotonic()
            from ninfer_core.engine.engine import Engine
            from ninfer_core.tokenizer import Tokenizer

            opts = ctx.options
            device = resolve_device(opts.engine.device)
            tokenizer = Tokenizer.from_section(self.artifact.tokenizer_section)
            target = self.family_reg.load()
            family = target() if isinstance(target, type) else target
            runner = family.load(self.artifact, device=device, options=opts.plugin_options)
            spec = None
            if self.spec_reg is not None:  # the backend enables what it needs before the cache is sized
                spec = self.spec_reg.load().load(runner, self.artifact, opts.plugin_options)
                log.info("speculative backend %s: %s", self.spec_reg.name, spec.describe())
            engine = Engine(runner, tokenizer, replace(opts.engine, device=device), spec=spec)
            engine.start()
            self.engine = engine
            if self.stopping.is_set():
                return
            _warmup(engine, tokenizer)
            info = runner.info
            facts = artifact_facts(self.artifact)
            ctx.model = ServedModel(
                id=public_model_id(opts, self.artifact), artifact_path=opts.artifact or self.artifact.path,
                architecture=self.artifact.architecture, max_model_len=opts.engine.max_context,
                n_vocab=tokenizer.vocab_size, n_ctx_train=int(info.max_position), n_embd=int(info.hidden_size),
                n_params=facts["n_params"] or int(info.n_params), size=facts["size"], ftype=facts["ftype"],
                aliases=tuple(a for a in opts.aliases if a != public_model_id(opts, self.artifact)),
                tags=tuple(opts.tags))
            ctx.tokenizer, ctx.chat_template, ctx.engine = tokenizer, self.template, engine
            if opts.engine.ngram_archive_mib:
                from ninfer_core.server.draft_session import DraftSessionEngine

                ctx.engine = DraftSessionEngine(engine)
            if opts.structured_output:  # xgrammar's tokenizer info and compiler for this model
                from ninfer_core.structured.compiler import StructuredOutput

                ctx.structured = StructuredOutput(tokenizer, int(info.vocab_size))
                ctx.structured.warm()
            ctx.sampling_presets = default_sampling_presets(self.artifact.architecture, family)
            if self.template is not None and engine.cache is not None:
                from ninfer_core.engine.turn_markers import template_turn_markers

                markers = template_turn_markers(self.template, tokenizer)  # probed once, here
                if markers is None:
                    log.warning("context cache: the chat template's message opener could not be derived; chat "
                                "prompts get no turn-closure or message-boundary checkpoints")
                else:
                    log.info("context cache: chat messages open with %r (assistant %r)",
                             tokenizer.decode([markers.start_id], skip_special=False), markers.assistant)
            if ctx.request_log is not None:  # server_start first, then requests through the logging wrapper
                from ninfer_core.server.request_log import (
                    LoggedEngine,
                    ThroughputReporter,
                    server_start_record,
                )

                ctx.request_log.start(server_start_record(ctx, engine))
                ctx.engine = LoggedEngine(ctx.engine, ctx.request_log)
                self.throughput = ThroughputReporter(ctx.request_log, engine)
                self.throughput.start()
            ctx.mark_ready()
            log.info("model %s ready on %s in %.1f s", ctx.model.id, device, time.monotonic() - t0)
        except BaseException as e:  # noqa: BLE001 - any load failure ends the server with status 1
            ctx.load_error = f"{type(e).__name__}: {e}"
            log.error("loading the model failed: %s", ctx.load_error)
            self.on_failure()


def _spec_plugins(host: PluginHost) -> set[str]:
    return {r.plugin for r in host.registry("spec_backend").values()}


def _warmup(engine: Any, tokenizer: Any) -> None:
    """One short generation through the engine, so the first request pays no first-use cost."""
    from ninfer_core.engine.api import GenerationRequest, SamplingParams

    ids = tokenizer.encode("Hello") or [0]

    async def run() -> None:
        handle = engine.submit(GenerationRequest(prompt_ids=ids, sampling=SamplingParams(greedy=True,
                                                 temperature=0.0), max_tokens=1, request_id="warmup"))
        async for ev in handle.events():
            if ev.kind == "error":
                raise ev.error
            if ev.kind == "finish":
                return

    asyncio.run(run())


def _make_server(config: Any, on_exit):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server with our own signal handling: shut the engine down, exit with 0."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            previous = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in previous.items():
                    signal.signal(s, h)

        def handle_exit(self, sig, frame):
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            on_exit()

    return Server(config)


def run_serve(args, host: PluginHost | None = None) -> int:
    """`ninfer serve`; `host` is the plugin host the command line was parsed with (cli.main)."""
    try:
        options = options_from_args(args)
    except ValueError as e:  # a refused option combination (e.g. --no-prefix-reuse with a capacity)
        return _fail(str(e))
    _setup_logging(options.log_level)
    host = host or PluginHost(PluginSelection.from_sources(args.plugin))
    try:
        host.load()
        for kind in ("protocol", "model_family", "kv_dtype", "spec_backend"):
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
        host.resolve("kv_dtype", options.engine.kv_dtype)
    except PluginError as e:
        return _fail(str(e))
    from ninfer_core.tokenizer.builtin_templates import resolve_chat_template
    from ninfer_core.tokenizer.chat_template import ChatTemplate, TemplateError

    try:
        if options.chat_template:
            template = resolve_chat_template(options.chat_template)
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
    if stats_socks:
        stats_port = stats_socks[0].getsockname()[1]
        log.info("stats listening on %s (GET /health, /stats, /v1/load, /metrics)",
                 " and ".join(announce(h, stats_port) for h in hosts))
    log.info("loading %s (%s) from %s", public_model_id(options, artifact), artifact.architecture, path)

    import uvicorn

    level = options.log_level if options.log_level in ("debug", "info", "warning", "error", "critical") else (
        "debug" if options.log_level == "trace" else "critical")
    config = uvicorn.Config(app, log_level="warning" if level == "info" else level,
                            access_log=level == "debug", lifespan="off", timeout_graceful_shutdown=5,
                            timeout_keep_alive=30)
    loader = _Loader(ctx, artifact, family_reg, template, spec_reg)
    shutdown_done = threading.Event()
    shutdown_lock = threading.Lock()

    def shutdown_engine() -> None:
        with shutdown_lock:
            if shutdown_done.is_set():
                return
            loader.stopping.set()
            engine = loader.engine
            if engine is not None:
                try:
                    engine.shutdown()
                except Exception as e:  # noqa: BLE001
                    log.warning("engine shutdown: %s", e)
            if loader.throughput is not None:
                loader.throughput.stop()  # the last partial interval
            if ctx.request_log is not None:
                ctx.request_log.close()
            shutdown_done.set()

    stats_server = None
    if stats_socks:
        from ninfer_core.server.app import create_stats_app

        stats_server = uvicorn.Server(uvicorn.Config(
            create_stats_app(ctx), log_level="warning" if level == "info" else level, access_log=False,
            lifespan="off", timeout_graceful_shutdown=2, timeout_keep_alive=30))
        # Its own thread and event loop: a scrape never waits behind the request pool.
        threading.Thread(target=stats_server.run, kwargs={"sockets": stats_socks}, name="ninfer-stats",
                         daemon=True).start()

    def on_exit() -> None:
        log.info("stopping")
        if stats_server is not None:
            stats_server.should_exit = True
        threading.Thread(target=shutdown_engine, name="ninfer-shutdown", daemon=True).start()

    server = _make_server(config, on_exit)

    def on_failure() -> None:
        server.should_exit = True

    loader.on_failure = on_failure
    loader.thread.start()
    try:
        server.run(sockets=socks)
    finally:
        for sock in socks:
            sock.close()
        if stats_server is not None:
            stats_server.should_exit = True
        shutdown_engine()
    if ctx.load_error:
        print(f"error: loading the model failed: {ctx.load_error}", file=sys.stderr, flush=True)
        return 1
    return 0
