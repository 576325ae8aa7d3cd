"""The command-line options of `ninfer serve` (spec "Server options"), each with its help and default.

Ranges are the ones a request field of the same name accepts (sampling overrides, --top-k, the
port), checked when the command line is parsed, so a bad value fails startup with `error: ...`
and status 1 instead of starting a server whose requests then fail. `ninfer_core.config` turns
the parsed namespace into ServeOptions; the context-cache options live beside the cache
(engine/cache_options.py), speculative backends add their own through `ninfer_add_serve_options`.
"""

from __future__ import annotations

import argparse

from ninfer_core.cli_support import integer, number, on_off

EFFORT_VALUES = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "critical", "off")
METRICS_COMPAT = ("vllm", "sglang")
_POST_THINKING_KEYS = {"temp": "temperature", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                       "min_p": "min_p", "presence": "presence_penalty", "frequency": "frequency_penalty"}
# Request ranges of the sampling fields (Chat Completions' own), shared by the process overrides.
_SAMPLING_TYPES = {"temperature": number(0, 2), "top_p": number(0, 1, lo_open=True), "top_k": integer(0, 20),
                   "min_p": number(0, 1), "presence_penalty": number(-2, 2), "frequency_penalty": number(-2, 2)}


def _kv_capacity(text: str):
    """--kv-capacity: a positive token count or "auto"."""
    if text == "auto":
        return "auto"
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count or auto, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _positive(lo: int, hi: int | None = None):
    return integer(lo, hi)


def _comma_list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _metrics_compat(s: str) -> list[str]:
    names = _comma_list(s)
    bad = [n for n in names if n not in METRICS_COMPAT]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected vllm, sglang or vllm,sglang, got {s!r}")
    return names


def post_thinking_sampler(text: str) -> dict:
    out: dict = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        name = _POST_THINKING_KEYS.get(key.strip())
        if not sep or name is None:
            raise argparse.ArgumentTypeError(f"expected temp=F,top_p=F,top_k=N[,min_p=F,presence=F,frequency=F], "
                                             f"got {item!r}")
        try:
            out[name] = _SAMPLING_TYPES[name](value)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{key.strip()}: {e}") from None
    return out


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", nargs="?",
                   help="the .ninfer artifact (default: the embedded small model; env NINFER_ARTIFACT)")
    g = p.add_argument_group("listening and access")
    g.add_argument("--host", default="127.0.0.1", metavar="ADDR",
                   help="address to listen on; a comma-separated list listens on each (127.0.0.1,::1)")
    g.add_argument("--port", type=_positive(0, 65535), default=8080, metavar="N", help="port to listen on, 0..65535 (0: a free "
                   "port, announced in the log)")
    g.add_argument("--stats-port", type=_positive(0, 65535), default=None, metavar="N",
                   help="also serve GET /health, /stats, /v1/load and /metrics on port N of the same address, with a "
                        "worker of their own (0: a free port, announced in the log; default: off)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require this key as 'Authorization: Bearer KEY' or 'x-api-key: KEY' on every route but GET "
                        "/health; set NINFER_API_KEY instead to keep it out of the process list (default: unset)")
    g.add_argument("--model-id", default=None, metavar="ID",
                   help="the public model id requests name (default: the first --alias, else the artifact's id)")
    g.add_argument("--cors", action="store_true", help="permissive browser CORS headers (the Origin reflected)")
    g.add_argument("--max-request-mib", type=_positive(1), default=384, metavar="N",
                   help="request-body limit in MiB, checked before JSON parsing (413 above it)")
    g.add_argument("--api-docs", action="store_true",
                   help="serve the interactive API documentation at /docs and /redoc (GET /openapi.json is "
                        "always served)")
    g.add_argument("--metrics-compat", type=_metrics_compat, default=[], metavar="vllm|sglang",
                   help="GET /metrics also carries the gateway gauges under vLLM's names (vllm:num_requests_waiting, "
                        "num_requests_running, kv_cache_usage_perc, cache_config_info) or SGLang's, for the Gateway "
                        "API Inference Extension's endpoint picker; a comma list gives both (default: off)")

    g = p.add_argument_group("model and chat format")
    g.add_argument("--chat-template", default=None, metavar="NAME|FILE",
                   help="a built-in template name (those the installed family plugins register: "
                        "`ninfer plugins` lists them), a Jinja file, or inline Jinja source (default: the "
                        "artifact's, else its model family's)")
    g.add_argument("--no-thinking", action="store_true", help="requests that do not ask think without a "
                   "reasoning block (default: thinking on)")
    g.add_argument("--preserve-thinking", action="store_true",
                   help="keep closed-turn assistant reasoning in the prompt by default")
    g.add_argument("--usage-chunk-choice", action="store_true",
                   help="the streamed usage chunk carries a zero-delta choice (strict client parsers)")
    g.add_argument("--response-store-max-records", type=_positive(0), default=1024, metavar="N",
                   help="most Responses kept for retrieval and previous_response_id (LRU)")
    g.add_argument("--response-store-max-mib", type=_positive(0), default=256, metavar="N",
                   help="total size of the stored Responses in MiB (LRU)")
    g.add_argument("--lenient-assistant-history", action="store_true",
                   help="Responses: assistant content or reasoning after function_call Items joins that turn")
    g.add_argument("--plugin", action="append", default=[], metavar="NAME",
                   help="load only this plugin (repeatable); a dotted module path loads that module (default: every "
                        "installed plugin, or the NINFER_PLUGINS list)")

    g = p.add_argument_group("logging")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="console (stderr) verbosity; info logs one line per request, rejected ones included")
    g.add_argument("--log-colours", type=on_off, default=None, metavar="on|off",
                   help="colour the console log's levels and statistics (default: on when stderr is a terminal; a "
                        "redirected stderr is always plain)")
    g.add_argument("--log-stats-interval-ms", type=_positive(0), default=5000, metavar="N",
                   help="console aggregate throughput report interval in ms; 0 disables it")
    g.add_argument("--log-stats-panel", type=on_off, default=False, metavar="on|off",
                   help="pin the session statistics panel beneath the console log on an interactive terminal "
                        "(default: off)")
    g.add_argument("--request-log-jsonl", default=None, metavar="FILE",
                   help="append full-precision server/request records as JSON lines, no prompts or outputs "
                        "(default: off)")
    g.add_argument("--request-log-max-mib", type=_positive(0), default=0, metavar="N",
                   help="rotate the request log at N MiB to FILE.1..FILE.<keep> (0: one unbounded file)")
    g.add_argument("--request-log-keep", type=_positive(0), default=4, metavar="N",
                   help="rotated request logs kept; 0 keeps none")

    g = p.add_argument_group("requests and scheduling")
    g.add_argument("--max-context", type=_positive(1), default=8192, metavar="N",
                   help="logical context ceiling of each sequence, prompt and output; above the model's native window "
                        "it is accepted with a warning")
    g.add_argument("--kv-capacity", type=_kv_capacity, default=None, metavar="N|auto",
                   help="tokens of the shared KV pool, or auto: as many as the device memory left after the weights "
                        "holds at the --kv-dtype's bytes per token, less --kv-headroom-mib (default: --max-context)")
    g.add_argument("--kv-headroom-mib", "--vram-headroom-mib", type=_positive(0), default=None, metavar="N",
                   help="device memory --kv-capacity auto leaves free after sizing the KV pool; requires auto "
                        "(default: 1024)")
    g.add_argument("--max-concurrency", type=_positive(1, 8), default=1, metavar="N",
                   help="requests running at once (execution lanes), 1..8")
    g.add_argument("--max-pending-requests", type=_positive(0), default=16, metavar="N",
                   help="further requests that may wait for admission; beyond them a request gets 429 (529 on "
                        "/v1/messages)")
    g.add_argument("--pending-timeout-ms", type=_positive(1), default=600_000, metavar="N",
                   help="longest preparation-plus-admission wait before 503 request_queue_timeout")
    g.add_argument("--prefill-chunk", type=_positive(1), default=1024, metavar="N", help="prompt tokens per prefill "
                   "chunk")
    g.add_argument("--decode-rounds-per-prefill", type=_positive(0), default=0, metavar="N",
                   help="decode rounds before each prefill chunk while other requests generate (0: --prefill-chunk "
                        "/ 64)")
    g.add_argument("--concurrent-prefill", action="store_true",
                   help="admit waiting requests to free lanes while another request prefills")
    g.add_argument("--default-max-tokens", type=_positive(1), default=None, metavar="N",
                   help="output limit of a request that names none (default: the largest budget that keeps every "
                        "lane admissible)")
    g.add_argument("--recover-invariant-failures", action="store_true",
                   help="a broken internal invariant in the engine worker fails the running and admitting requests "
                        "and leaves the waiting ones queued, as recovery from out of memory does, instead of "
                        "failing the engine; eight consecutive recoveries still fail it")
    g.add_argument("--kv-dtype", default="bf16", metavar="NAME",
                   help="KV-cache storage: bf16, int8, fp8 (e4m3) or k8v4 (int8 keys, int4 values), each quantised "
                        "per token and KV head (a registered KV dtype; rk8v4, rk4v4, rk4v4-e8, rk2v4-e8 and nvfp4 are "
                        "not built yet)")
    g.add_argument("--lm-head-q4", dest="lm_head_q", action="store_const", const="q4", default=None,
                   help="store the output head as groupwise Q4 while loading (default: off)")
    g.add_argument("--lm-head-q6", dest="lm_head_q", action="store_const", const="q6",
                   help="store the output head as groupwise Q6 while loading (default: off)")
    g.add_argument("--embedding-q4", dest="embedding_q", action="store_const", const="q4", default=None,
                   help="store the token embedding as groupwise Q4 while loading (default: off)")
    g.add_argument("--embedding-q6", dest="embedding_q", action="store_const", const="q6",
                   help="store the token embedding as groupwise Q6 while loading (default: off)")
    g.add_argument("--device", default="auto", metavar="DEV", help="cpu, cuda, cuda:N or auto (cuda when torch sees a GPU)")
    g.add_argument("--devices", default=None, metavar="A,B,...",
                   help="one pipeline stage per listed device (2 to 8: cuda:0,cuda:1 ...; cpu,cpu for a CPU test); "
                        "overrides --device")
    g.add_argument("--stage-layers", default=None, metavar="A,B,...",
                   help="decoder layers per stage, in --devices order (default: a split from each device's free "
                        "memory)")
    g.add_argument("--no-cuda-graph", action="store_true",
                   help="run decode rounds eagerly instead of replaying captured CUDA Graphs")

    g = p.add_argument_group("sampling overrides (the request's ranges)")
    g.add_argument("--temperature", type=_SAMPLING_TYPES["temperature"], default=None, metavar="F",
                   help="process-level temperature, 0..2 (default: the model's preset)")
    g.add_argument("--top-p", type=_SAMPLING_TYPES["top_p"], default=None, metavar="F",
                   help="process-level top-p, (0, 1] (default: the model's preset)")
    g.add_argument("--top-k", type=_SAMPLING_TYPES["top_k"], default=None, metavar="N",
                   help="process-level top-k, 0..20; 0 selects the top-20 cap (default: the model's preset)")
    g.add_argument("--min-p", type=_SAMPLING_TYPES["min_p"], default=None, metavar="F",
                   help="process-level min-p, 0..1 (default: the model's preset)")
    g.add_argument("--presence-penalty", type=_SAMPLING_TYPES["presence_penalty"], default=None, metavar="F",
                   help="process-level presence penalty, -2..2 (default: the model's preset)")
    g.add_argument("--frequency-penalty", type=_SAMPLING_TYPES["frequency_penalty"], default=None, metavar="F",
                   help="process-level frequency penalty, -2..2 (default: the model's preset)")
    g.add_argument("--seed", type=integer(-(2**63), 2**63 - 1), default=None, metavar="N",
                   help="seed of a request that names none, signed 64-bit (default: a fresh random seed per request)")
    g.add_argument("--greedy", action="store_true", help="force exact argmax for every request")
    from ninfer_core.engine.cache_options import add_cache_arguments

    add_cache_arguments(p)
    add_thinking_arguments(p)
    add_spec_arguments(p)
    add_llamacpp_arguments(p)
    add_structured_arguments(p)
    add_client_arguments(p)
    from ninfer_core.media.options import add_media_arguments

    add_media_arguments(p)
    from ninfer_core.router.options import add_router_arguments

    add_router_arguments(p)


def add_thinking_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("thinking")
    g.add_argument("--default-thinking-budget", type=_positive(1), default=None, metavar="N",
                   help="thinking-token cap for requests that think and name no budget (default: none)")
    g.add_argument("--thinking-budget-message", default=None, metavar="TEXT",
                   help="guidance inserted at the thinking budget; the chat format's reasoning close is "
                        "appended when missing (default: a built-in notice)")
    g.add_argument("--default-reasoning-effort", choices=EFFORT_VALUES, default=None,
                   help="effort for requests that name none (default: unset)")
    g.add_argument("--post-thinking", action="store_true",
                   help="sample the answer of every thinking request with the post-thinking preset")
    g.add_argument("--post-thinking-temperature", type=_SAMPLING_TYPES["temperature"], default=None, metavar="F",
                   help="post-thinking temperature, 0..2; implies --post-thinking (default: the preset's 0.2)")
    g.add_argument("--post-thinking-top-p", type=_SAMPLING_TYPES["top_p"], default=None, metavar="F",
                   help="post-thinking top-p, (0, 1]; implies --post-thinking (default: the preset's)")
    g.add_argument("--post-thinking-top-k", type=_SAMPLING_TYPES["top_k"], default=None, metavar="N",
                   help="post-thinking top-k, 0..20; implies --post-thinking (default: the preset's)")
    g.add_argument("--post-thinking-sampler", type=post_thinking_sampler, default=None,
                   metavar="temp=F,top_p=F,top_k=N[,min_p=F,presence=F,frequency=F]",
                   help="the post-thinking overrides in one flag; implies --post-thinking (default: the preset)")


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


def add_llamacpp_arguments(p: argparse.ArgumentParser) -> None:
    """Options scripts written for llama-server pass (docs/llamacpp.md, "Server options").
    --host (above) also takes llama-server's comma list of addresses."""
    g = p.add_argument_group("llama-server compatibility")
    g.add_argument("--cors-origins", type=_comma_list, default=None, metavar="LIST",
                   help="allow CORS only from these comma-separated origins ('*' any, 'localhost' a page served "
                        "from this machine); implies --cors (default: every origin with --cors)")
    g.add_argument("--metrics", action="store_true",
                   help="accepted for llama-server scripts: GET /metrics is always served")
    g.add_argument("--slots", dest="no_slots", action="store_false", default=False,
                   help="serve GET /slots (the default)")
    g.add_argument("--no-slots", dest="no_slots", action="store_true", default=False,
                   help="answer GET and POST /slots with 501, as llama-server --no-slots does")
    g.add_argument("--chat-template-file", dest="chat_template", metavar="FILE",
                   help="llama-server's spelling of --chat-template FILE (default: the artifact's template)")
    g.add_argument("--accept-any-model", action="store_true",
                   help="serve a request naming any model with the loaded one (clients that send a fixed name)")
    g.add_argument("--alias", type=_comma_list, default=[], metavar="NAMES",
                   help="comma-separated model names requests may use (reported as aliases); the first is the "
                        "public model id unless --model-id is given (default: none)")
    g.add_argument("--jinja", action="store_true",
                   help="accepted for llama-server scripts: chat templates are always Jinja")
    g.add_argument("--tags", type=_comma_list, default=[], metavar="TAGS",
                   help="comma-separated informational model tags, reported by /v1/models (default: none)")


def add_structured_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured output")
    g.add_argument("--structured-output", action="store_true",
                   help="accept JSON and JSON Schema response formats (and llama.cpp json_schema/grammar), "
                        "enforced token by token with xgrammar; forced tool calls follow their parameter schema")
    g.add_argument("--unconstrained-response-format", action="store_true",
                   help="without --structured-output, generate a JSON or JSON Schema request unconstrained "
                        "instead of refusing it")


def add_client_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("agent clients and the WebUI")
    g.add_argument("--drop-hosted-tools", action="store_true",
                   help="Responses: remove hosted tools (web_search, file_search, code_interpreter, image_generation, "
                        "computer use, mcp, local_shell) from a request instead of refusing it (default: refused)")
    g.add_argument("--webui-dir", default=None, metavar="DIR",
                   help="serve the built llama.cpp WebUI in DIR at GET / (default: the one scripts/fetch-webui.sh "
                        "built, when present)")
    g.add_argument("--no-webui", action="store_true", help="do not serve a WebUI")
    g.add_argument("--webui-mcp-proxy", action="store_true",
                   help="relay the WebUI's MCP traffic at /cors-proxy (http targets, no API key; default off)")
