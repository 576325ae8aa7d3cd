"""Serve options: one dataclass shared by the CLI, the engine and the HTTP server.

The argparse side (every option, its help, default and range) is ninfer_core.serve_options;
`options_from_args` turns its namespace into ServeOptions and refuses option combinations.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from ninfer_core.media.options import media_options_from_args

# The argparse side lives in serve_options; these names stay importable from here.
from ninfer_core.serve_options import (  # noqa: F401
    EFFORT_VALUES,
    add_llamacpp_arguments,
    add_serve_arguments,
    add_spec_arguments,
    add_structured_arguments,
    add_thinking_arguments,
)


@dataclass
class EngineOptions:
    max_context: int = 8192
    kv_capacity: int | str | None = None  # tokens, or "auto" (sized by the Engine); None follows max_context
    kv_headroom_mib: int = 1024  # device memory --kv-capacity auto leaves free
    max_concurrency: int = 1  # 1..8 lanes
    max_pending_requests: int = 16
    pending_timeout_ms: int = 600_000
    prefill_chunk: int = 1024
    decode_rounds_per_prefill: int = 0  # 0 = prefill_chunk // 64
    concurrent_prefill: bool = False  # admit to free lanes while another lane prefills
    default_max_tokens: int | None = None
    kv_dtype: str = "bf16"
    device: str = "cpu"
    # process-level sampling overrides (None = model preset)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    greedy: bool = False
    cuda_graph: bool = True  # decode rounds as CUDA Graphs where the model family supports them
    # Context cache (ninfer_core.engine.cache_options): the library default is root-only;
    # `ninfer serve` turns reuse on unless --no-prefix-reuse. None capacities take the spec defaults.
    prefix_reuse: bool = False
    # Admission page leases (ninfer_core.engine.cache_lease): --kv-lease-growth reserves a window
    # of output and grows it; --reserve-continuation-pages turns the own-pages lease off.
    kv_lease_growth: bool = False
    reserve_continuation_pages: bool = False
    device_state_slots: int | None = None
    host_state_slots: int | None = None
    host_kv_mib: int | None = None
    host_cache_mib: int | None = None
    max_private_continuations: int | None = None
    max_shared_prefixes: int | None = None
    max_long_anchors_per_continuation: int | None = None
    auto_long_anchors: bool = False
    long_anchor_spacing: int = 1024
    branch_anchors: bool = False
    endpoint_anchors: bool = True
    slot_save_path: str | None = None
    auto_save_evicted: bool = False  # write an evicted session back to its bound slot file
    disk_kv_path: str | None = None  # disk tier under the Host tier (ninfer_core.engine.cache_disk)
    disk_kv_gib: float = 64
    disk_kv_restore: bool = False
    disk_kv_model: str = ""  # the artifact's identity, so one model never restores another's files
    # Speculative decoding (spec "--spec", n-gram copy drafting): the backend itself is passed to the
    # Engine; None n-gram draft tokens take the spec default (15 with a backend, else 0).
    ngram_draft_tokens: int | None = None
    ngram_min_match: int = 12
    lookup_ngram: int = 0
    ngram_archive_mib: int = 0
    ngram_session_mib: int = 128
    # Recovery (spec "Startup readiness"): a broken invariant is recovered like an out-of-memory
    # failure instead of failing the engine (--recover-invariant-failures).
    recover_invariant_failures: bool = False

    def resolved_kv_capacity(self) -> int:
        """Tokens of the pool; "auto" is resolved by the Engine (`ninfer_core.engine.budget.auto_kv_capacity`)."""
        if self.kv_capacity == "auto":
            raise ValueError("--kv-capacity auto is resolved against the loaded model's cache spec")
        return self.kv_capacity if self.kv_capacity is not None else self.max_context

    def resolved_decode_rounds(self) -> int:
        return self.decode_rounds_per_prefill or max(1, self.prefill_chunk // 64)

    def ngram_options(self, backend_drafts: int = 0):
        """The n-gram drafting settings for an engine whose backend drafts `backend_drafts` per round."""
        from ninfer_core.engine.ngram import NgramOptions

        n = self.ngram_draft_tokens
        if n is None:
            n = 15 if backend_drafts else 0
        return NgramOptions(draft_tokens=n, min_match=self.ngram_min_match, lookup=self.lookup_ngram,
                            lookup_drafts=backend_drafts or max(n, 8),
                            archive_bytes=self.ngram_archive_mib << 20, session_bytes=self.ngram_session_mib << 20)


@dataclass
class ThinkingOptions:
    """Thinking defaults (spec "Server options"): budgets, effort and post-thinking sampling."""

    default_thinking_budget: int | None = None
    thinking_budget_message: str | None = None
    default_reasoning_effort: str | None = None
    post_thinking: bool = False  # sample the answer of thinking requests with the post-thinking preset
    post_thinking_overrides: dict = field(default_factory=dict)  # sampler field -> value


def thinking_options_from_args(a: argparse.Namespace, no_thinking: bool) -> ThinkingOptions:
    """Raises ValueError for a refused combination (--default-reasoning-effort with --no-thinking)."""
    overrides = dict(getattr(a, "post_thinking_sampler", None) or {})
    for flag, name in (("post_thinking_temperature", "temperature"), ("post_thinking_top_p", "top_p"),
                       ("post_thinking_top_k", "top_k")):
        if getattr(a, flag, None) is not None:
            overrides[name] = getattr(a, flag)
    t = overrides.get("temperature")
    if t is not None and not 0 <= t <= 2:
        raise ValueError(f"the post-thinking temperature must be in 0..2, got {t}")
    effort = getattr(a, "default_reasoning_effort", None)
    if effort not in (None, "none") and no_thinking:
        raise ValueError(f"--default-reasoning-effort {effort} asks for thinking, which --no-thinking turns off")
    return ThinkingOptions(
        default_thinking_budget=getattr(a, "default_thinking_budget", None),
        thinking_budget_message=getattr(a, "thinking_budget_message", None),
        default_reasoning_effort=effort,
        post_thinking=bool(getattr(a, "post_thinking", False) or overrides),
        post_thinking_overrides=overrides,
    )


@dataclass
class ServeOptions:
    artifact: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    stats_port: int | None = None  # also serve /health, /v1/load and /metrics here (one worker of their own)
    api_key: str | None = None
    model_id: str | None = None
    cors: bool = False
    chat_template: str | None = None
    no_thinking: bool = False
    preserve_thinking: bool = False
    max_request_mib: int = 384
    log_level: str = "info"
    log_colours: bool | None = None  # None: on when stderr is a terminal
    log_stats_interval_ms: int = 5000  # console throughput line (0: off)
    log_stats_panel: bool = False  # rich statistics panel beneath the console log
    api_docs: bool = False  # /docs and /redoc (GET /openapi.json is always served)
    metrics_compat: list[str] = field(default_factory=list)  # "vllm", "sglang": gateway gauges on /metrics
    usage_chunk_choice: bool = False
    response_store_max_records: int = 1024
    response_store_max_mib: int = 256
    lenient_assistant_history: bool = False
    request_log_jsonl: str | None = None  # the machine-readable request log (ninfer_core.server.request_log)
    request_log_max_mib: int = 0  # rotate at this size (0: one unbounded file)
    request_log_keep: int = 4  # rotated copies kept
    plugins: list[str] = field(default_factory=list)
    spec: str | None = None  # --spec NAME: the speculative backend
    plugin_options: argparse.Namespace = field(default_factory=argparse.Namespace)  # what plugins added
    # weight and KV encodings applied while loading (ninfer_core.quant): the resolved --kv-dtype
    # target, --lm-head-q4|q6, --embedding-q4|q6
    kv_format: Any = None
    lm_head_q: str | None = None
    embedding_q: str | None = None
    # llama-server compatibility (add_llamacpp_arguments)
    cors_origins: list[str] | None = None  # allow only these origins (implies CORS); "*", "localhost"
    no_slots: bool = False  # GET/POST /slots answer 501, as llama-server --no-slots does
    accept_any_model: bool = False  # any requested model name is served by the one model
    aliases: list[str] = field(default_factory=list)  # further model names (--alias)
    tags: list[str] = field(default_factory=list)  # informational model tags (--tags)
    hosts: list[str] = field(default_factory=list)  # every --host address (comma-separated); host is the first
    # Structured output (ninfer_core.structured; spec "Structured output")
    structured_output: bool = False  # accept JSON / JSON Schema formats and grammars, enforced by xgrammar
    unconstrained_response_format: bool = False  # without it: generate such requests unconstrained, not 400
    # Agent clients and the WebUI (serve_options.add_client_arguments)
    drop_hosted_tools: bool = False  # Responses: remove hosted tools (web_search, ...) instead of refusing
    webui_dir: str | None = None  # a built llama.cpp WebUI served at GET /; None: the one fetch-webui.sh built
    no_webui: bool = False
    webui_mcp_proxy: bool = False  # the /cors-proxy relay for the WebUI's MCP client
    engine: EngineOptions = field(default_factory=EngineOptions)
    thinking: ThinkingOptions = field(default_factory=ThinkingOptions)
    # Pipeline stages (ninfer_core.engine.pipeline): one stage per device, layers per stage or None
    devices: list[str] | None = None
    stage_layers: list[int] | None = None
    media: Any = None  # ninfer_core.media.options.MediaOptions (None: vision off)


def _comma_list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _origins(values: list[str] | None) -> list[str] | None:
    """Origins as a browser sends them: no trailing slash (`http://ui.test/` lists `http://ui.test`)."""
    return None if values is None else [v.rstrip("/") or v for v in values]


def structured_options_from_args(a: argparse.Namespace) -> dict:
    return {"structured_output": bool(getattr(a, "structured_output", False)),
            "unconstrained_response_format": bool(getattr(a, "unconstrained_response_format", False))}


# -- agent clients and the WebUI ------------------------------------------------------------------

def client_options_from_args(a: argparse.Namespace) -> dict:
    if getattr(a, "webui_dir", None) and getattr(a, "no_webui", False):
        raise ValueError("--webui-dir and --no-webui exclude each other")
    return {"drop_hosted_tools": bool(getattr(a, "drop_hosted_tools", False)),
            "webui_dir": getattr(a, "webui_dir", None), "no_webui": bool(getattr(a, "no_webui", False)),
            "webui_mcp_proxy": bool(getattr(a, "webui_mcp_proxy", False))}


def options_from_args(a: argparse.Namespace) -> ServeOptions:
    eng = EngineOptions(
        max_context=a.max_context, kv_capacity=a.kv_capacity, max_concurrency=a.max_concurrency,
        max_pending_requests=a.max_pending_requests, pending_timeout_ms=a.pending_timeout_ms,
        prefill_chunk=a.prefill_chunk, decode_rounds_per_prefill=a.decode_rounds_per_prefill,
        concurrent_prefill=a.concurrent_prefill,
        default_max_tokens=a.default_max_tokens, kv_dtype=a.kv_dtype, device=a.device,
        temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
        presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
        seed=a.seed, greedy=a.greedy, cuda_graph=not getattr(a, "no_cuda_graph", False),
        recover_invariant_failures=bool(getattr(a, "recover_invariant_failures", False)),
    )
    if getattr(a, "kv_headroom_mib", None) is not None and a.kv_capacity != "auto":
        raise ValueError("--kv-headroom-mib requires --kv-capacity auto")
    eng.kv_headroom_mib = getattr(a, "kv_headroom_mib", None) or 1024
    from ninfer_core.engine.cache_options import apply_cache_arguments

    apply_cache_arguments(a, eng)
    ngram = getattr(a, "ngram_draft_tokens", None)
    if ngram is not None and ngram > 15 and a.max_concurrency > 1:
        raise ValueError(f"--ngram-draft-tokens {ngram} needs --max-concurrency 1 (above 15 drafts only run alone)")
    archive = getattr(a, "ngram_archive_mib", 0)
    eng.ngram_draft_tokens = ngram
    eng.ngram_min_match = getattr(a, "ngram_min_match", 12)
    eng.lookup_ngram = getattr(a, "lookup_ngram", 0)
    eng.ngram_archive_mib = archive
    # a session's share is at most the whole archive (the 128 MiB default over a smaller archive)
    eng.ngram_session_mib = min(getattr(a, "ngram_session_mib", 128), archive) if archive else getattr(
        a, "ngram_session_mib", 128)
    log_path = getattr(a, "request_log_jsonl", None)
    if getattr(a, "request_log_max_mib", 0) and not log_path:
        raise ValueError("--request-log-max-mib requires --request-log-jsonl")
    devices, stage_layers = pipeline_options_from_args(a)
    hosts = _comma_list(a.host) or ["127.0.0.1"]
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"--host {a.host}: an address is listed twice")
    return ServeOptions(
        artifact=a.artifact, host=hosts[0], hosts=hosts, port=a.port, stats_port=getattr(a, "stats_port", None),
        api_key=a.api_key, model_id=a.model_id,
        cors=a.cors or bool(getattr(a, "cors_origins", None)), chat_template=a.chat_template,
        no_thinking=a.no_thinking,
        preserve_thinking=a.preserve_thinking, max_request_mib=a.max_request_mib,
        log_level=a.log_level, usage_chunk_choice=a.usage_chunk_choice, plugins=list(a.plugin),
        lm_head_q=getattr(a, "lm_head_q", None), embedding_q=getattr(a, "embedding_q", None),
        log_colours=getattr(a, "log_colours", None), log_stats_interval_ms=getattr(a, "log_stats_interval_ms", 5000),
        log_stats_panel=bool(getattr(a, "log_stats_panel", False)), api_docs=bool(getattr(a, "api_docs", False)),
        metrics_compat=list(getattr(a, "metrics_compat", None) or []),
        response_store_max_records=getattr(a, "response_store_max_records", 1024),
        response_store_max_mib=getattr(a, "response_store_max_mib", 256),
        lenient_assistant_history=getattr(a, "lenient_assistant_history", False),
        request_log_jsonl=log_path, request_log_max_mib=getattr(a, "request_log_max_mib", 0),
        request_log_keep=getattr(a, "request_log_keep", 4),
        spec=getattr(a, "spec", None),
        engine=eng, thinking=thinking_options_from_args(a, a.no_thinking),
        cors_origins=_origins(getattr(a, "cors_origins", None)), no_slots=getattr(a, "no_slots", False),
        accept_any_model=getattr(a, "accept_any_model", False), aliases=list(getattr(a, "alias", []) or []),
        tags=list(getattr(a, "tags", []) or []),
        **structured_options_from_args(a),
        **client_options_from_args(a),
        devices=devices, stage_layers=stage_layers,
        media=media_options_from_args(a),
    )


def pipeline_options_from_args(a: argparse.Namespace) -> tuple[list[str] | None, list[int] | None]:
    """--devices / --stage-layers parsed and checked against the other options (the layer count is
    checked against the model once the artifact is open)."""
    from ninfer_core.engine.pipeline.split import parse_devices, parse_stage_layers

    text, layers_text = getattr(a, "devices", None), getattr(a, "stage_layers", None)
    if text is None:
        if layers_text is not None:
            raise ValueError("--stage-layers needs --devices (one count per listed device)")
        return None, None
    devices = parse_devices(text)
    layers = parse_stage_layers(layers_text) if layers_text is not None else None
    if layers is not None and len(layers) != len(devices):
        raise ValueError(f"--stage-layers lists {len(layers)} counts for {len(devices)} devices (one per device, in "
                         "--devices order)")
    if getattr(a, "vision_residency", None) == "overlay":
        raise ValueError("--vision-residency overlay does not run with --devices (use resident or cpu: the tower "
                         "stays on the first device)")
    return devices, layers

