"""The model behind a serving port: plugins resolved, weights loaded, the Engine started and warm.

`Loader.run` (its own thread) loads the family's runner, the speculative backend, the Engine and
its wrappers (draft sessions, the request log), warms it with a one-token generation, then marks
the server ready. A load failure ends the server with status 1 (`on_failure`); an engine that
later latches failed is reported through `on_engine_failure` (status 2).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace
from typing import Any

from ninfer_core.config import ServeOptions
from ninfer_core.server.context import ServedModel, ServerContext
from ninfer_core.server.prepare import default_sampling_presets

log = logging.getLogger("ninfer")


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


def resolve_kv_dtype(host, name: str):
    """The loaded `--kv-dtype` target (a KV format object); ValueError/PluginError name what exists."""
    from ninfer_core.quant.kv import check_kv_dtype

    check_kv_dtype(name, host.registry("kv_dtype"))
    return host.resolve("kv_dtype", name).load()


def load_options(opts) -> Any:
    """What `ModelFamily.load(options=)` receives: the plugins' serve options plus the load-time
    encodings core resolves (`kv_dtype`: the KV format object, `lm_head_q`, `embedding_q`)."""
    import argparse

    ns = argparse.Namespace(**vars(opts.plugin_options))
    ns.kv_dtype = opts.kv_format if opts.kv_format is not None else opts.engine.kv_dtype
    ns.lm_head_q, ns.embedding_q = opts.lm_head_q, opts.embedding_q
    return ns

def engine_plugins(host: Any, options: Any) -> tuple[Any, Any]:
    """The KV dtype `--kv-dtype` names and the prefix-cache builder the cache flags pick
    (`checkpoint_catalog`, or `none` with --no-prefix-reuse), each from its registry."""
    if host is None:  # a context built without plugins (tests of the server alone): core's own
        from ninfer_core.plugins import PluginHost, PluginSelection

        host = PluginHost(PluginSelection(autoload=False))
    kv_dtype = host.resolve("kv_dtype", options.kv_dtype).load()
    cache = host.resolve("prefix_cache", "checkpoint_catalog" if options.prefix_reuse else "none").load()
    return kv_dtype, cache


class Loader:
    """Loads the model behind a serving port: family.load, Engine start, warmup, then ready."""

    def __init__(self, ctx: ServerContext, artifact: Any, family_reg: Any, template: Any, spec_reg: Any = None,
                 console: Any = None):
        self.ctx, self.artifact, self.family_reg, self.template = ctx, artifact, family_reg, template
        self.spec_reg = spec_reg
        self.console = console  # server.console.Console: the stats line and panel
        self.stopping = threading.Event()
        self.engine: Any = None
        self.throughput: Any = None  # request_log.ThroughputReporter with --request-log-jsonl
        self.stats: Any = None  # console.StatsReporter (--log-stats-interval-ms)
        self.on_failure = lambda: None
        self.on_engine_failure = lambda reason: None
        self.thread = threading.Thread(target=self.run, name="ninfer-loader", daemon=True)

    def run(self) -> None:
        ctx = self.ctx
        try:
            t0 = time.monotonic()
            from ninfer_core.engine.engine import Engine
            from ninfer_core.tokenizer import Tokenizer

            opts = ctx.options
            device = opts.devices[0] if opts.devices else resolve_device(opts.engine.device)
            tokenizer = Tokenizer.from_section(self.artifact.tokenizer_section)
            target = self.family_reg.load()
            family = target() if isinstance(target, type) else target
            if opts.devices:  # one stage per device (ninfer_core.engine.pipeline); --device is overridden
                from ninfer_core.engine.pipeline.runner import PipelineRunner

                runner = PipelineRunner.start(self.family_reg.target, self.artifact.path, opts.devices,
                                              opts.stage_layers, options=opts.plugin_options)
            else:
                runner = family.load(self.artifact, device=device, options=load_options(opts))
            if hasattr(family, "chat_format"):  # the family's reasoning and tool-call markup
                from ninfer_core.tokenizer.chat_format import attach

                attach(tokenizer, family.chat_format(self.artifact))
            native = int(getattr(runner.info, "max_position", 0) or 0)
            if native and opts.engine.max_context > native:  # llama.cpp warns alike (vLLM refuses)
                log.warning("--max-context %d is above the model's native window of %d tokens: positions past it "
                            "are extrapolated, and output quality there is not guaranteed", opts.engine.max_context,
                            native)
            spec = None
            if self.spec_reg is not None:  # the backend enables what it needs before the cache is sized
                spec = self.spec_reg.load().load(runner, self.artifact, opts.plugin_options)
                log.info("speculative backend %s: %s", self.spec_reg.name, spec.describe())
            vision = media = None
            if opts.media is not None and opts.media.vision:
                from ninfer_core.media.loading import load_vision

                vision, media = load_vision(ctx, family, self.artifact, runner, int(runner.info.vocab_size), tokenizer)
            kv_dtype, prefix_cache = engine_plugins(ctx.plugins, opts.engine)
            engine = Engine(runner, tokenizer, replace(opts.engine, device=device), spec=spec,
                            prefix_cache=prefix_cache, kv_dtype=kv_dtype, vision=vision)
            engine.start()
            self.engine = engine
            engine.recovery.on_failure(self.on_engine_failure)
            if self.stopping.is_set():  # the server stopped during the load: nothing else stops this engine
                engine.shutdown()
                close = getattr(runner, "close", None)
                if close is not None:
                    close()
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
                tags=tuple(opts.tags), vision=vision is not None)
            ctx.tokenizer, ctx.chat_template, ctx.engine = tokenizer, self.template, engine
            ctx.media = media
            if opts.engine.ngram_archive_mib:
                from ninfer_core.server.draft_session import DraftSessionEngine

                ctx.engine = DraftSessionEngine(engine)
            if opts.structured_output:  # xgrammar's tokenizer info and compiler for this model
                from ninfer_core.structured.compiler import StructuredOutput

                ctx.structured = StructuredOutput(tokenizer, int(info.vocab_size))
                ctx.structured.warm()
            from ninfer_core.tokenizer.chat_format import chat_format_of

            ctx.sampling_presets = default_sampling_presets(
                self.artifact.architecture, family, generation=getattr(self.artifact, "generation", None),
                chat_format=chat_format_of(tokenizer))
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
            if self.console is not None and opts.log_stats_interval_ms > 0:
                from ninfer_core.server.console import StatsReporter

                self.stats = StatsReporter(engine, opts.log_stats_interval_ms / 1000.0, self.console)
                self.stats.start()
            ctx.mark_ready()
            log.info("model %s ready on %s in %.1f s", ctx.model.id, device, time.monotonic() - t0)
        except BaseException as e:  # noqa: BLE001 - any load failure ends the server with status 1
            ctx.load_error = f"{type(e).__name__}: {e}"
            log.error("loading the model failed: %s", ctx.load_error)
            self.on_failure()


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


