"""Chat Completions request checks: from validated wire fields to a ChatPlan the adapter runs.

Pydantic (openai_models) validates scalar fields; this module checks what it cannot express
(fields with several wire shapes, capability rejections, cross-field rules) and normalises the
messages and tools into the plain dicts the chat template renders. Every failure names its field
(`param`), e.g. "messages.2.content.1.type".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ninfer_core.engine.api import EngineError
from ninfer_core.protocols.logit_bias import parse_logit_bias
from ninfer_core.protocols.openai_models import CONSTRAINED_EXTENSIONS, ChatCompletionRequest, ChatMessage
from ninfer_core.protocols.raw_prompt_input import vocab_limit
from ninfer_core.server.context import ServerContext
from ninfer_core.server.errors import bad_request, parse_json_body
from ninfer_core.server.prepare import collapse_effort
from ninfer_core.structured.formats import (
    ResponseFormat,
    admit,
    chat_response_format,
    refuse_conflicts,
    with_instruction,
)

TOOL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,127}\Z")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# Template inputs the request cannot replace through chat_template_kwargs.
RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "pad_token",
                   "unk_token", "continue_final_message", "add_vision_id")


@dataclass
class ChatPlan:
    """A validated request, ready to render and submit."""

    messages: list[dict]
    tools: list[dict] | None
    thinking: bool
    template_kwargs: dict[str, Any]
    stop: list[str]
    max_tokens: int | None  # None: the default output limit
    derived_limit: bool  # max_tokens -1: the derived budget even under --default-max-tokens
    stream: bool
    include_usage: bool
    sampling_request: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    ignore_eos: bool = False
    forced_tool: str | None = None  # tool_choice forces a call to this tool (the prompt ends with its opener)
    parallel_tool_calls: bool = True
    custom_tools: frozenset[str] = frozenset()  # names of free-form custom tools (answered as custom calls)
    logprobs: int | None = None  # None: not asked; else top_logprobs
    thinking_budget: int | None = None
    post_thinking: dict[str, Any] | None = None
    effort_requested: str | None = None  # what the client named (logs)
    verbose: bool = False  # llama.cpp's __verbose: the /completion-shaped object beside the response
    response_format: ResponseFormat | None = None  # a JSON format to enforce (--structured-output)
    # llama.cpp stream extensions (the WebUI sends all three): live timings on every visible chunk,
    # prompt_progress chunks, and arming the reasoning_end control (POST .../control)
    timings_per_token: bool = False
    return_progress: bool = False
    reasoning_control: bool = False


def validate_body(raw: bytes, ctx: ServerContext) -> "ChatPlan":
    """Request bytes -> a ChatPlan, or the 400 that names the offending field."""
    data = parse_json_body(raw)
    if not isinstance(data, dict):
        raise bad_request("invalid_type", "The request body must be a JSON object.", None)
    plan = check_request(ChatCompletionRequest.model_validate(data), ctx)
    for name in ("timings_per_token", "return_progress", "reasoning_control"):
        value = data.get(name)
        if value is not None and not isinstance(value, bool):
            raise bad_request("invalid_type", f"'{name}' must be a boolean.", name)
        setattr(plan, name, bool(value))
    return plan


def check_request(req: ChatCompletionRequest, ctx: ServerContext) -> ChatPlan:
    """Field checks pydantic cannot express, capability rejections, and message normalisation."""
    model_id = ctx.model.id if ctx.model else None
    if req.model not in (None, "") and not ctx.serves_model(req.model):
        raise EngineError(404, "model_not_found", f"The model '{req.model}' does not exist; this server "
                          f"serves '{model_id}'.", param="model")
    if req.n is not None and req.n != 1:
        if req.n > 1:
            raise bad_request("n_not_supported", "Only n=1 is supported: one request produces one choice.", "n")
        raise bad_request("invalid_value", "n must be 1.", "n")
    logit_bias = parse_logit_bias(req.logit_bias, ctx.tokenizer, vocab_limit(ctx))
    if req.top_logprobs and not req.logprobs:
        raise bad_request("invalid_value", "top_logprobs needs logprobs: true.", "top_logprobs")
    if req.repetition_penalty is not None and req.repetition_penalty != 1:
        raise bad_request("repetition_penalty_not_supported", "repetition_penalty is accepted only at its "
                          "neutral value 1; use presence_penalty or frequency_penalty.", "repetition_penalty")
    for name in CONSTRAINED_EXTENSIONS:
        if getattr(req, name) is not None:
            raise bad_request("unsupported_parameter", f"'{name}' (a vLLM/llama.cpp constrained-decoding "
                              "extension) is not supported; request structured JSON through "
                              "response_format.", name)
    fmt = check_response_format(req.response_format, ctx.options)
    if req.functions:
        raise bad_request("functions_not_supported", "Legacy 'functions' are not supported; send 'tools'.",
                          "functions")
    if req.function_call is not None and req.function_call not in ("none", "auto"):
        raise bad_request("functions_not_supported", "Legacy 'function_call' can only be 'none' or 'auto' "
                          "(no legacy functions are declared); use tools and tool_choice.", "function_call")
    mm = req.mm_processor_kwargs
    if mm is not None:
        if not isinstance(mm, dict):
            raise bad_request("invalid_type", "mm_processor_kwargs must be an object.", "mm_processor_kwargs")
        for key, value in mm.items():
            if value is not None:
                raise bad_request("unsupported_parameter", "mm_processor_kwargs is accepted only empty or with "
                                  "null values: media preprocessing is fixed by the model.",
                                  f"mm_processor_kwargs.{key}")
    if req.store:
        raise bad_request("store_not_supported", "Stored Chat Completions are not supported.", "store")
    if req.verbosity not in (None, "medium"):
        code = "verbosity_not_supported" if req.verbosity in ("low", "high") else "invalid_value"
        raise bad_request(code, "Only verbosity 'medium' is supported.", "verbosity")
    if req.web_search_options is not None:
        raise bad_request("web_search_not_supported", "Web search is not supported.", "web_search_options")
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        raise bad_request("audio_not_supported", "Only text output is supported.", "modalities")

    tools, forced, custom = _tools(req)
    thinking, template_kwargs, effort = _thinking_options(req, ctx, forced is not None, fmt is not None)
    stream = bool(req.stream)
    limit = req.output_limit()
    stop = _stop_list(req.stop)
    refuse_conflicts(fmt, stop=stop, ignore_eos=bool(req.ignore_eos))
    return ChatPlan(
        messages=with_instruction(normalize_messages(req.messages, _media_flags(ctx)), fmt, tools is not None),
        tools=tools,
        thinking=thinking,
        template_kwargs=template_kwargs,
        stop=stop,
        max_tokens=None if limit is None or limit == -1 else limit,
        derived_limit=limit == -1,
        stream=stream,
        include_usage=bool(stream and req.stream_options and req.stream_options.include_usage),
        sampling_request={**{k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "min_p",
                                                           "presence_penalty", "frequency_penalty")},
                          "logit_bias": logit_bias},
        seed=req.seed,
        ignore_eos=bool(req.ignore_eos),
        forced_tool=forced,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        custom_tools=custom,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        thinking_budget=req.thinking_budget,
        post_thinking=req.post_thinking.model_dump() if req.post_thinking is not None else None,
        effort_requested=effort,
        verbose=req.verbose is True,
        response_format=fmt,
    )


def check_response_format(rf: Any, options: Any = None) -> ResponseFormat | None:
    """response_format -> the format to enforce: None for text, or when --unconstrained-response-format
    drops it; 400 response_format_not_supported without --structured-output (ninfer_core.structured)."""
    return admit(chat_response_format(rf), options)


def _stop_list(stop: Any) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list):
        raise bad_request("invalid_type", "stop must be a string or a list of strings.", "stop")
    if len(items) > 4:
        raise bad_request("invalid_value", "stop accepts at most 4 strings.", "stop")
    for i, s in enumerate(items):
        param = "stop" if isinstance(stop, str) else f"stop.{i}"
        if not isinstance(s, str):
            raise bad_request("invalid_type", "stop strings must be strings.", param)
        if s == "":
            raise bad_request("invalid_value", "stop strings must be non-empty.", param)
    return list(items)


def _thinking_options(req: ChatCompletionRequest, ctx: ServerContext, forced: bool,
                      structured: bool = False) -> tuple[bool, dict[str, Any], str | None]:
    """(thinking, template kwargs, the effort the client named).

    Request options override the server defaults (--no-thinking, --preserve-thinking,
    --default-reasoning-effort); a forced tool call switches default thinking off and leaves the
    server's effort unset; the effort is collapsed to the nearest value the template accepts."""
    kwargs = dict(req.chat_template_kwargs or {})
    for key in RESERVED_KWARGS:
        if key in kwargs:
            raise bad_request("invalid_value", f"'{key}' cannot be set through chat_template_kwargs.",
                              f"chat_template_kwargs.{key}")

    def typed(name: str, top: Any, kind: type) -> Any:
        inner = kwargs.pop(name, None)  # null standard options mean unspecified
        if inner is not None and not isinstance(inner, kind):
            raise bad_request("invalid_type", f"chat_template_kwargs.{name} must be a {kind.__name__}.",
                              f"chat_template_kwargs.{name}")
        if top is not None and inner is not None and top != inner:
            raise bad_request("invalid_value", f"chat_template_kwargs.{name} disagrees with the top-level "
                              f"{name}.", f"chat_template_kwargs.{name}")
        return top if top is not None else inner

    enable = typed("enable_thinking", req.enable_thinking, bool)
    preserve = typed("preserve_thinking", req.preserve_thinking, bool)
    effort = typed("reasoning_effort", req.reasoning_effort, str)
    param = "reasoning_effort" if req.reasoning_effort is not None else "chat_template_kwargs.reasoning_effort"
    if effort is not None and effort not in EFFORTS + ("default", "auto"):
        raise bad_request("invalid_value", f"reasoning_effort must be one of {', '.join(EFFORTS)} (or default, "
                          "auto).", param)
    requested = effort
    if effort in ("default", "auto"):
        effort = None
    if effort == "none":
        if enable is True:
            raise bad_request("invalid_value", "reasoning_effort 'none' disables thinking, which "
                              "enable_thinking: true asks for.", param)
        enable = False
    if forced:
        if enable is True:
            raise bad_request("invalid_value", "A forced tool call (tool_choice naming a tool, required, or "
                              "allowed_tools in required mode) needs thinking disabled; drop enable_thinking.",
                              "tool_choice")
        enable = False
    elif structured and enable is None and effort is None and req.thinking_budget is None:
        enable = False  # spec: structured responses default to thinking disabled unless the request asks
    elif effort is None and enable is not False:
        default = ctx.options.thinking.default_reasoning_effort
        if default == "none":
            if enable is None:
                enable = False
        elif default is not None:
            effort = default
    thinking = enable if enable is not None else not ctx.options.no_thinking
    if effort is not None and effort != "none":
        kwargs["reasoning_effort"] = collapse_effort(ctx.chat_template, effort)
    if preserve is None and ctx.options.preserve_thinking:
        preserve = True
    if preserve is not None:
        kwargs["preserve_thinking"] = preserve
    return thinking, kwargs, requested


def _declared(req: ChatCompletionRequest) -> list[tuple[str, Any]]:
    names: dict[str, int] = {}
    out = []
    for i, t in enumerate(req.tools or []):
        name = t.function.name if t.type == "function" else t.custom.name
        if not TOOL_NAME.match(name):
            raise bad_request("invalid_value", f"tool name {name[:64]!r} must be 1-128 letters, digits, '_', '-', "
                              "'.' or ':' (the model writes it inside call markup).", f"tools.{i}.{t.type}.name")
        if name in names:
            raise bad_request("invalid_value", f"tool name {name!r} is declared twice (tools.{names[name]} and "
                              f"tools.{i}).", f"tools.{i}.{t.type}.name")
        names[name] = i
        out.append((name, t))
    return out


def _choice_name(obj: Any, kind: str, param: str) -> str:
    body = obj.get(kind) if isinstance(obj, dict) else None
    name = body.get("name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise bad_request("missing_required_parameter" if name is None else "invalid_type",
                          f"tool_choice of type {kind} needs {kind}.name.", f"{param}.{kind}.name")
    return name


def _tool_choice(choice: Any, declared: dict[str, Any]) -> tuple[str, str | None, list[str] | None]:
    """(mode "auto"|"none"|"forced", forced name, narrowed tool names or None)."""
    if choice is None or choice == "auto":
        return "auto", None, None
    if choice == "none":
        return "none", None, None
    if choice == "required":
        return _require(list(declared), "tool_choice")
    if isinstance(choice, str):
        raise bad_request("invalid_value", "tool_choice must be auto, none, required or an object naming a tool.",
                          "tool_choice")
    if not isinstance(choice, dict):
        raise bad_request("invalid_type", "tool_choice must be a string or an object.", "tool_choice")
    kind = choice.get("type")
    if kind == "function":
        name = _choice_name(choice, "function", "tool_choice")
        _known(name, declared, "tool_choice.function.name")
        return "forced", name, None
    if kind == "custom":  # advisory narrowing: the model is offered that tool only, not forced to call it
        name = _choice_name(choice, "custom", "tool_choice")
        _known(name, declared, "tool_choice.custom.name")
        return "auto", None, [name]
    if kind == "allowed_tools":
        spec = choice.get("allowed_tools")
        if not isinstance(spec, dict):
            raise bad_request("missing_required_parameter" if spec is None else "invalid_type",
                              "tool_choice allowed_tools needs an allowed_tools object.", "tool_choice.allowed_tools")
        mode = spec.get("mode")
        if mode not in ("auto", "required"):
            raise bad_request("invalid_value", "allowed_tools.mode must be auto or required.",
                              "tool_choice.allowed_tools.mode")
        tools = spec.get("tools")
        if not isinstance(tools, list) or not tools:
            raise bad_request("invalid_value", "allowed_tools.tools must be a non-empty list.",
                              "tool_choice.allowed_tools.tools")
        names = []
        for j, t in enumerate(tools):
            p = f"tool_choice.allowed_tools.tools.{j}"
            kind_j = t.get("type") if isinstance(t, dict) else None
            if kind_j not in ("function", "custom"):
                raise bad_request("invalid_value", "an allowed tool is a function or custom tool reference.",
                                  f"{p}.type")
            name = t.get("name") if isinstance(t.get("name"), str) else _choice_name(t, kind_j, p)
            _known(name, declared, f"{p}.{kind_j}.name")
            names.append(name)
        if mode == "required":
            return _require(names, "tool_choice.allowed_tools")
        return "auto", None, names
    raise bad_request("invalid_value", "tool_choice.type must be function, custom or allowed_tools.",
                      "tool_choice.type")


def _known(name: str, declared: dict[str, Any], param: str) -> None:
    if name not in declared:
        raise bad_request("invalid_value", f"tool_choice names {name[:64]!r}, which is not among the declared "
                          "tools.", param)


def _require(names: list[str], param: str) -> tuple[str, str | None, list[str] | None]:
    if not names:
        raise bad_request("invalid_value", "tool_choice 'required' needs at least one tool in 'tools'.", param)
    if len(names) > 1:
        raise bad_request("tool_choice_not_supported", "tool_choice 'required' over several callable tools is "
                          "not supported: NInfer can force one named call but cannot make the model choose "
                          "among several. Name the tool, or use auto.", param)
    return "forced", names[0], names


def _tools(req: ChatCompletionRequest) -> tuple[list[dict] | None, str | None, frozenset[str]]:
    """(tools to render, forced tool name, custom tool names)."""
    declared = dict(_declared(req))
    mode, forced, narrowed = _tool_choice(req.tool_choice, declared)
    if not declared or mode == "none":
        return None, None, frozenset()
    out = []
    custom = set()
    for name, t in declared.items():
        if narrowed is not None and name not in narrowed:
            continue
        if t.type == "function":
            f = t.function
            fn: dict[str, Any] = {"name": f.name}
            if f.description is not None:
                fn["description"] = f.description
            fn["parameters"] = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
        else:  # a free-form custom tool is served as a single-string-input function under its own name
            c = t.custom
            custom.add(c.name)
            fn = {"name": c.name}
            if c.description is not None:
                fn["description"] = c.description
            fn["parameters"] = {"type": "object", "properties": {"input": {"type": "string"}},
                                "required": ["input"]}
        out.append({"type": "function", "function": fn})
    return out, forced, frozenset(custom)


def _content_text(content: Any, param: str, role: str, media: tuple[bool, bool] = (False, False)) -> str | list:
    """The message content as text, or as a list of text and media parts when it carries media
    (`media` = (vision enabled, lenient image detail))."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("invalid_type", "content must be a string or a list of content parts.", param)
    pieces: list = []
    parts: list | None = None  # set once a media part is seen
    for j, part in enumerate(content):
        p = f"{param}.{j}"
        if isinstance(part, str):  # tolerated: a bare string part is its text
            pieces.append(part)
            if parts is not None:
                parts.append({"type": "text", "text": part})
            continue
        if not isinstance(part, dict):
            raise bad_request("invalid_type", "a content part must be an object.", p)
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request("invalid_type" if text is not None else "missing_required_parameter",
                                  "a text part needs a string 'text'.", f"{p}.text")
            pieces.append(text)
        elif kind == "refusal" and role == "assistant":
            text = part.get("refusal")
            if not isinstance(text, str):
                raise bad_request("invalid_type", "a refusal part needs a string 'refusal'.", f"{p}.refusal")
            pieces.append(text)
        elif kind in ("image_url", "input_image", "video_url", "image", "video"):
            if not media[0]:
                raise bad_request("vision_disabled", "This server was started without --vision; image and "
                                  "video input is not accepted.", f"{p}.type")
            if role not in ("user", "tool", "function"):
                raise bad_request("invalid_value", f"media parts are accepted in user and tool messages, not in "
                                  f"a {role} message.", f"{p}.type")
            if kind in ("image", "video"):
                raise bad_request("invalid_value", f"unknown content part type {kind!r}: send image_url or "
                                  "video_url.", f"{p}.type")
            from ninfer_core.media.parts import openai_part

            if parts is None:
                parts = [{"type": "text", "text": t} for t in pieces]
            parts.append(openai_part(part, p, media[1]))
            continue
        elif kind in ("input_audio", "file", "audio"):
            raise bad_request("content_type_not_supported", f"'{kind}' content is not supported: the model "
                              "reads text only.", f"{p}.type")
        else:
            raise bad_request("invalid_value", f"unknown content part type {kind!r}.", f"{p}.type")
        if parts is not None:
            parts.append({"type": "text", "text": pieces[-1]})
    return "".join(pieces) if parts is None else parts


def _media_flags(ctx: ServerContext) -> tuple[bool, bool]:
    """(vision enabled, lenient image detail) of the serving process."""
    opts = getattr(ctx.options, "media", None)
    return (ctx.media is not None, bool(opts is not None and opts.lenient_image_detail))


def _arguments(raw: Any, param: str) -> dict:
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        raise bad_request("invalid_type", "function arguments must be a JSON string.", param)
    try:
        value = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        raise bad_request("invalid_value", "function arguments are not valid JSON.", param) from None
    if not isinstance(value, dict):
        raise bad_request("invalid_value", "function arguments must encode a JSON object.", param)
    return value


def _tool_calls(calls: Any, param: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request("invalid_type", "tool_calls must be a list.", param)
    out = []
    for k, call in enumerate(calls):
        p = f"{param}.{k}"
        if not isinstance(call, dict):
            raise bad_request("invalid_type", "a tool call must be an object.", p)
        fn = call.get("function") if call.get("type", "function") == "function" else call.get("custom")
        if not isinstance(fn, dict):
            raise bad_request("missing_required_parameter", "a tool call needs its 'function'.", f"{p}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("invalid_value", "a tool call needs a function name.", f"{p}.function.name")
        if "input" in fn and "arguments" not in fn:
            args = {"input": fn["input"]}
        else:
            args = _arguments(fn.get("arguments", "{}"), f"{p}.function.arguments")
        entry = {"type": "function", "function": {"name": name, "arguments": args}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def normalize_messages(messages: list[ChatMessage], media: tuple[bool, bool] = (False, False)) -> list[dict]:
    """OpenAI messages -> the plain dicts the chat template renders (input order kept).
    `media`: (vision enabled, lenient image detail)."""
    out = []
    for i, m in enumerate(messages):
        p = f"messages.{i}"
        role = m.role
        d: dict[str, Any] = {"role": "tool" if role == "function" else role,
                             "content": _content_text(m.content, f"{p}.content", role, media)}
        if m.name is not None:
            if not isinstance(m.name, str):
                raise bad_request("invalid_type", "name must be a string.", f"{p}.name")
            if role not in ("tool", "function") and m.name != "":
                raise bad_request("invalid_value", "a participant name is not supported on this role: the chat "
                                  "template cannot represent it.", f"{p}.name")
        if role == "assistant":
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise bad_request("invalid_type", "reasoning_content must be a string.",
                                      f"{p}.reasoning_content")
                d["reasoning_content"] = reasoning
            calls = []
            if m.tool_calls:
                calls += _tool_calls(m.tool_calls, f"{p}.tool_calls")
            if m.function_call is not None:
                calls += _tool_calls([{"type": "function", "function": m.function_call}], f"{p}.function_call")
            if calls:
                d["tool_calls"] = calls
        elif role in ("tool", "function"):
            if m.tool_call_id is not None:
                if not isinstance(m.tool_call_id, str):
                    raise bad_request("invalid_type", "tool_call_id must be a string.", f"{p}.tool_call_id")
                d["tool_call_id"] = m.tool_call_id
            if role == "function" and isinstance(m.name, str):
                d["name"] = m.name
        out.append(d)
    return out
