"""Every NInfer hook spec. Plugins implement these with `@ninfer_core.hookimpl`.

Registration hooks receive a `register` callback (llm style): the host sees every registration,
refuses a second one under a taken name (naming both packages), and resolves exactly one
implementation by name when a flag or an artifact asks for it. Targets are given lazily as
"module:attribute" strings so that importing a plugin never imports torch kernels or CUDA.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("ninfer")


@hookspec
def ninfer_register_model_families(register):
    """Register model families: `register(name, target, architectures=[...])`.

    Called once when the host first needs a model family. `target` is "module:Class" of a
    `ninfer_core.engine.model_api.ModelFamily`; `architectures` are the artifact `architecture`
    strings (and HF `model_type`s) it serves. The artifact's architecture picks the family; two
    families claiming one architecture is a registration error.
    """


@hookspec
def ninfer_register_spec_backends(register):
    """Register speculative backends: `register(name, target)`; `--spec NAME` picks one.

    `target` is "module:Class" of a `ninfer_core.engine.spec.SpecBackend`. Called once at startup
    when `--spec` is given. A backend reaches the model family only through the model-family
    contract (`ninfer_core.engine.model_api`: draft heads, hidden states, verify, commit).
    """


@hookspec
def ninfer_add_serve_options(add):
    """Add `ninfer serve` options: `add(*flags, **kwargs)` takes argparse's `add_argument` arguments.

    Called once before the command line is parsed (so `ninfer serve --help` lists them), under a
    help group named after the plugin. The parsed values reach the plugin at load time: a
    `ModelFamily.load(..., options=)` and a `SpecBackend.load(..., options=)` receive a namespace
    of every option plugins added. One flag added by two plugins with identical settings is one
    shared option (e.g. `--draft-tokens`, used by every speculative backend); with other settings
    it is a registration error naming both packages.
    """


@hookspec
def ninfer_register_kv_dtypes(register):
    """Register KV-cache storage formats: `register(name, target)`; `--kv-dtype NAME` picks one.

    `target` is "module:obj", a KV storage format: bf16 is built in (`ninfer_core.engine.kv_bf16:BF16`)
    and int8, fp8 and k8v4 (`ninfer_core.quant.kv:INT8` ..., `KVFormat` objects with their per-token
    scales) register through this same hook. The loaded object reaches the family's `load(options=)`
    as `options.kv_dtype` and the runner as `RunnerOptions.kv_dtype` (docs/plugins/kv-dtypes.md).
    """


@hookspec
def ninfer_register_vision_residencies(register):
    """Register vision-tower residencies: `register(name, target)`; `--vision-residency NAME` picks one.

    `target` is "module:Class" of a `ninfer_core.media.api.VisionResidency`; with `--vision` the
    server calls its `load(family, artifact, runner, options)` once after the runner is built, and
    the engine calls `encode(item)` on its worker for every media item a prefill needs. resident
    and cpu are built in and registered through this same hook.
    """


@hookspec
def ninfer_register_prefix_caches(register):
    """Register prefix-cache builders: `register(name, target)`; the cache flags pick one.

    `target` is "module:function" of `build(runner, pages, options, state_bytes, page_size) -> cache
    or None`, or None for no cache. The server's loader resolves `checkpoint_catalog` (built in:
    `ninfer_core.engine.cache:build_context_cache`), or `none` with --no-prefix-reuse, and the engine
    calls the builder once, before it allocates the runner's cache.
    """


@hookspec
def ninfer_register_chat_templates(register):
    """Register built-in chat templates: `register(name, target)`; `--chat-template NAME` picks one.

    `target` is "module:attribute" of the template's Jinja source text (a str). Core ships none:
    the names are those of the formats the installed families speak (llama-server's built-in names).
    """


@hookspec
def ninfer_register_bench_shapes(register):
    """Register model shapes for `ninfer bench --shape NAME`: `register(name, target, default=False)`.

    `target` is "module:attribute" of a Hugging Face config dict (its `model_type` picks the family,
    which builds random weights at that shape through `random_artifact`). `default=True` marks the
    shape `ninfer bench` runs when none is named.
    """


@hookspec
def ninfer_register_protocols(register):
    """Register API protocols: `register(name, target)`.

    `target` is "module:attribute" of an object with `mount(router, ctx)` that adds its routes
    to the FastAPI router it is given (see `ninfer_core.server.app`). Every enabled protocol is
    mounted; two protocols mounting the same method and path is an error at startup.
    """


@hookspec(firstresult=True)
def ninfer_default_artifact(cache_dir):
    """Return the path of an artifact `ninfer serve` uses when no artifact is named, or None.

    Called only when serve has no artifact argument; the first non-None answer wins. A model
    family plugin may build a small model deterministically into `cache_dir` on first use.
    """
