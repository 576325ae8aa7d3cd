"""Serve options: one dataclass shared by the CLI, the engine and the HTTP server."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass
class EngineOptions:
    max_context: int = 8192
    kv_capacity: int | None = None  # tokens; None follows max_context
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

    def resolved_kv_capacity(self) -> int:
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


EFFORT_VALUES = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_POST_THINKING_KEYS = {"temp": "temperature", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                       "min_p": "min_p", "presence": "presence_penalty", "frequency": "frequency_penalty"}


@dataclass
class ThinkingOptions:
    """Thinking defaults (spec "Server options"): budgets, effort and post-thinking sampling."""

    default_thinking_budget: int | None = None
    thinking_budget_message: str | None = None
    default_reasoning_effort: str | None = None
    post_thinking: bool = False  # sample the answer of thinking requests with the post-thinking preset
    post_thinking_overrides: dict = field(default_factory=dict)  # sampler field -> value


def _post_thinking_sampler(text: str) -> dict:
    out: dict = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        name = _POST_THINKING_KEYS.get(key.strip())
        if not sep or name is None:
            raise argparse.ArgumentTypeError(f"expected temp=F,top_p=F,top_k=N[,min_p=F,presence=F,frequency=F], "
                                             f"got {item!r}")
        try:
            out[name] = int(value) if name == "top_k" else float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{key.strip()} needs a number, got {value!r}") from None
    return out


def add_thinking_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--default-thinking-budget", type=_positive(1), default=None,
                   help="thinking-token cap for requests that think and name no budget")
    p.add_argument("--thinking-budget-message", default=None, metavar="TEXT",
                   help="guidance inserted at the thinking budget (the </think> close is appended when missing)")
    p.add_argument("--default-reasoning-effort", choices=EFFORT_VALUES, default=None,
                   help="effort for requests that name none")
    p.add_argument("--post-thinking", action="store_true",
                   help="sample the answer of every thinking request with the post-thinking preset")
    p.add_argument("--post-thinking-temperature", type=float, default=None)
    p.add_argument("--post-thinking-top-p", type=float, default=None)
    p.add_argument("--post-thinking-top-k", type=_positive(0), default=None)
    p.add_argument("--post-thinking-sampler", type=_post_thinking_sampler, default=None,
                   metavar="temp=F,top_p=F,top_k=N[,min_p=F,presence=F,frequency=F]")


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
    # Agent clients and the WebUI (add_client_arguments)
    drop_hosted_tools: bool = False  # Responses: remove hosted tools (web_search, ...) instead of refusing
    webui_dir: str | None = None  # a built llama.cpp WebUI served at GET /; None: the one fetch-webui.sh built
    no_webui: bool = False
    webui_mcp_proxy: bool = False  # the /cors-proxy relay for the WebUI's MCP client
    engine: EngineOptions = field(default_factory=EngineOptions)
    thinking: ThinkingOptions = field(default_factory=ThinkingOptions)


def _positive(lo: int, hi: int | None = None):
    def parse(s: str) -> int:
        v = int(s)
        if v < lo or (hi is not None and v > hi):
            rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be in {rng}, got {v}")
        return v

    return parse


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", nargs="?", help="the .ninfer artifact (default: the embedded small model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; a comma-separated list listens on each (127.0.0.1,::1)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--stats-port", type=_positive(0, 65535), default=None, metavar="N",
                   help="also serve GET /health, /stats, /v1/load and /metrics on port N of the same address, with a "
                        "worker of their own (0: a free port, announced in the log)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model-id", default=None)
    p.add_argument("--cors", action="store_true")
    p.add_argument("--chat-template", default=None, metavar="NAME|FILE",
                   help="a built-in template name (chatml, qwen35), a Jinja file, or inline Jinja source")
    p.add_argument("--no-thinking", action="store_true")
    p.add_argument("--preserve-thinking", action="store_true")
    p.add_argument("--max-request-mib", type=_positive(1), default=384)
    p.add_argument("--log-level", default="info",
                   choices=["trace", "debug", "info", "warning", "error", "critical", "off"])
    p.add_argument("--usage-chunk-choice", action="store_true")
    p.add_argument("--response-store-max-records", type=_positive(0), default=1024,
                   help="most Responses kept for retrieval and previous_response_id (LRU)")
    p.add_argument("--response-store-max-mib", type=_positive(0), default=256,
                   help="total size of the stored Responses (LRU)")
    p.add_argument("--lenient-assistant-history", action="store_true",
                   help="Responses: assistant content or reasoning after function_call Items joins that turn")
    p.add_argument("--request-log-jsonl", default=None, metavar="FILE",
                   help="append full-precision server/request records as JSON lines (no prompts or outputs)")
    p.add_argument("--request-log-max-mib", type=_positive(0), default=0, metavar="N",
                   help="rotate the request log at N MiB to FILE.1..FILE.<keep> (0: one unbounded file)")
    p.add_argument("--request-log-keep", type=_positive(0), default=4, metavar="N",
                   help="rotated request logs kept; 0 keeps none")
    p.add_argument("--plugin", action="append", default=[], metavar="NAME",
                   help="load only this plugin (repeatable); a dotted module path loads that module")
    p.add_argument("--max-context", type=_positive(1), default=8192)
    p.add_argument("--kv-capacity", type=_positive(1), default=None)
    p.add_argument("--max-concurrency", type=_positive(1, 8), default=1)
    p.add_argument("--max-pending-requests", type=_positive(0), default=16)
    p.add_argument("--pending-timeout-ms", type=_positive(1), default=600_000)
    p.add_argument("--prefill-chunk", type=_positive(1), default=1024)
    p.add_argument("--decode-rounds-per-prefill", type=_positive(0), default=0)
    p.add_argument("--concurrent-prefill", action="store_true",
                   help="admit waiting requests to free lanes while another request prefills")
    p.add_argument("--default-max-tokens", type=_positive(1), default=None)
    p.add_argument("--kv-dtype", default="bf16")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=_positive(0, 20), default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="run decode rounds eagerly instead of replaying captured CUDA Graphs")
    from ninfer_core.engine.cache_options import add_cache_arguments

    add_cache_arguments(p)
    add_thinking_arguments(p)
    add_spec_arguments(p)
    add_llamacpp_arguments(p)
    add_structured_arguments(p)
    add_client_arguments(p)


def add_spec_arguments(p: argparse.ArgumentParser) -> None:
    """--spec (the backend is a plugin that adds its own options) and core's n-gram copy drafting."""
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--spec", default=None, metavar="NAME",
                   help="speculative backend (mtp from ninfer-spec-mtp; dflash, dflash2); default off")
    g.add_argument("--ngram-draft-tokens", type=_positive(0, 63), default=None, metavar="N",
                   help="copy drafting: up to N tokens (1..63; above 15 only at --max-concurrency 1) copied from "
                        "earlier prompt or output text the last --ngram-min-match tokens match; 0 disables it "
                        "(default 15 with --spec, else 0)")
    g.add_argument("--ngram-min-match", type=_positive(4, 64), default=12, metavar="N",
                   help="shortest match a copy is drawn from, 4..64 (default 12)")
    g.add_argument("--lookup-ngram", type=_positive(0, 64), default=0, metavar="N",
                   help="context-lookup drafting: the last N tokens are matched against the sequence so far and "
                        "what followed is proposed (default 0: off)")
    g.add_argument("--ngram-archive-mib", type=_positive(0), default=0, metavar="N",
                   help="RAM archive keeping finished requests' copy sources for later requests naming the same "
                        "X-NInfer-Draft-Session (default 0: off)")
    g.add_argument("--ngram-session-mib", type=_positive(1), default=128, metavar="N",
                   help="per-session share of that archive, 1 MiB up to the archive size (default 128)")


def _comma_list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _origins(values: list[str] | None) -> list[str] | None:
    """Origins as a browser sends them: no trailing slash (`http://ui.test/` lists `http://ui.test`)."""
    return None if values is None else [v.rstrip("/") or v for v in values]


def add_llamacpp_arguments(p: argparse.ArgumentParser) -> None:
    """Options scripts written for llama-server pass (docs/llamacpp.md, "Server options").
    --host (above) also takes llama-server's comma list of addresses."""
    g = p.add_argument_group("llama-server compatibility")
    g.add_argument("--cors-origins", type=_comma_list, default=None, metavar="LIST",
                   help="allow CORS only from these comma-separated origins ('*' any, 'localhost' a page served "
                        "from this machine); implies --cors")
    g.add_argument("--metrics", action="store_true",
                   help="accepted for llama-server scripts: GET /metrics is always served")
    g.add_argument("--slots", dest="no_slots", action="store_false", default=False, help="serve GET /slots (the default)")
    g.add_argument("--no-slots", dest="no_slots", action="store_true", default=False,
                   help="answer GET and POST /slots with 501, as llama-server --no-slots does")
    g.add_argument("--chat-template-file", dest="chat_template", metavar="FILE",
                   help="llama-server's spelling of --chat-template FILE")
    g.add_argument("--accept-any-model", action="store_true",
                   help="serve a request naming any model with the loaded one (clients that send a fixed name)")
    g.add_argument("--alias", type=_comma_list, default=[], metavar="NAMES",
                   help="comma-separated model names requests may use (reported as aliases); the first is the "
                        "public model id unless --model-id is given")
    g.add_argument("--jinja", action="store_true",
                   help="accepted for llama-server scripts: chat templates are always Jinja")
    g.add_argument("--tags", type=_comma_list, default=[], metavar="TAGS",
                   help="comma-separated informational model tags (reported by /v1/models)")


# -- structured output (ninfer_core.structured) ---------------------------------------------------

def add_structured_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--structured-output", action="store_true",
                   help="accept JSON and JSON Schema response formats (and llama.cpp json_schema/grammar), "
                        "enforced token by token with xgrammar; forced tool calls follow their parameter schema")
    p.add_argument("--unconstrained-response-format", action="store_true",
                   help="without --structured-output, generate a JSON or JSON Schema request unconstrained "
                        "instead of refusing it")


def structured_options_from_args(a: argparse.Namespace) -> dict:
    return {"structured_output": bool(getattr(a, "structured_output", False)),
            "unconstrained_response_format": bool(getattr(a, "unconstrained_response_format", False))}


# -- agent clients and the WebUI ------------------------------------------------------------------

def add_client_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drop-hosted-tools", action="store_true",
                   help="Responses: remove hosted tools (web_search, file_search, code_interpreter, image_generation, "
                        "computer use, mcp, local_shell) from a request instead of refusing it")
    p.add_argument("--webui-dir", default=None, metavar="DIR",
                   help="serve the built llama.cpp WebUI in DIR at GET / (default: the one scripts/fetch-webui.sh "
                        "built, when present)")
    p.add_argument("--no-webui", action="store_true", help="do not serve a WebUI")
    p.add_argument("--webui-mcp-proxy", action="store_true",
                   help="relay the WebUI's MCP traffic at /cors-proxy (http targets, no API key)")


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
    )
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
    )

