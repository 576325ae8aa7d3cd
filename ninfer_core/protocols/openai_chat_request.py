"""Chat Completions request checks: from validated wire fields to a ChatPlan the adapter runs.

Pydantic (openai_models) validates scalar fields; this module checks what it cannot express
(fields with several wire shapes, capability rejections, cross-field rules) and normalises the
messages and tools into the plain dicts the chat template renders. Every failure names its field
(`param`), e.g. "messages.2.content.1.type".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ninfer_core.engine.api import EngineError
from ninfer_core.protocols.openai_models import CONSTRAINED_EXTENSIONS, ChatCompletionRequest, ChatMessage
from ninfer_core.server.context import ServerContext
from ninfer_core.server.errors import bad_request, parse_json_body

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# Template inputs the request cannot replace through chat_template_kwargs.
RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                   "continue_final_message", "add_vision_id")


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


def validate_body(raw: bytes, ctx: ServerContext) -> "ChatPlan":
    """Request bytes -> a ChatPlan, or the 400 that names the offending field."""
    data = parse_json_body(raw)
    if not isinstance(data, dict):
        raise bad_request("invalid_type", "The request body must be a JSON object.", None)
    return check_request(ChatCompletionRequest.model_validate(data), ctx)


def check_request(req: ChatCompletionRequest, ctx: ServerContext) -> ChatPlan:
    """Field checks pydantic cannot express, capability rejections, and message normalisation."""
    model_id = ctx.model.id if ctx.model else None
    if req.model not in (None, "") and req.model != model_id:
        raise EngineError(404, "model_not_found", f"The model '{req.model}' does not exist; this server "
                          f"serves '{model_id}'.", param="model")
    if req.n is not None and req.n != 1:
        if req.n > 1:
            raise bad_request("n_not_supported", "Only n=1 is supported: one request produces one choice.", "n")
        raise bad_request("invalid_value", "n must be 1.", "n")
    if req.logit_bias and any(v != 0 for v in req.logit_bias.values()):
        raise bad_request("logit_bias_not_supported", "A nonzero logit_bias is not supported: the sampler "
                          "cannot apply per-token biases.", "logit_bias")
    if req.logprobs:
        raise bad_request("logprobs_not_supported", "logprobs is not supported yet.", "logprobs")
    if req.top_logprobs:
        raise bad_request("invalid_value", "top_logprobs needs logprobs: true.", "top_logprobs")
    if req.repetition_penalty is not None and req.repetition_penalty != 1:
        raise bad_request("repetition_penalty_not_supported", "repetition_penalty is accepted only at its "
                          "neutral value 1; use presence_penalty or frequency_penalty.", "repetition_penalty")
    for name in CONSTRAINED_EXTENSIONS:
        if getattr(req, name) is not None:
            raise bad_request("unsupported_parameter", f"'{name}' (a vLLM/llama.cpp constrained-decoding "
                              "extension) is not supported; request structured JSON through "
                              "response_format.", name)
    _check_response_format(req.response_format)
    if req.functions:
        raise bad_request("functions_not_supported", "Legacy 'functions' are not supported; send 'tools'.",
                          "functions")
    if req.store:
        raise bad_request("store_not_supported", "Stored Chat Completions are not supported.", "store")
    if req.verbosity not in (None, "medium"):
        code = "verbosity_not_supported" if req.verbosity in ("low", "high") else "invalid_value"
        raise bad_request(code, "Only verbosity 'medium' is supported.", "verbosity")
    if req.web_search_options is not None:
        raise bad_request("web_search_not_supported", "Web search is not supported.", "web_search_options")
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        raise bad_request("audio_not_supported", "Only text output is supported.", "modalities")

    thinking, template_kwargs = _thinking_options(req, ctx)
    tools = _tools(req)
    stream = bool(req.stream)
    limit = req.output_limit()
    return ChatPlan(
        messages=normalize_messages(req.messages),
        tools=tools,
        thinking=thinking,
        template_kwargs=template_kwargs,
        stop=_stop_list(req.stop),
        max_tokens=None if limit is None or limit == -1 else limit,
        derived_limit=limit == -1,
        stream=stream,
        include_usage=bool(stream and req.stream_options and req.stream_options.include_usage),
        sampling_request={k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "min_p",
                                                        "presence_penalty", "frequency_penalty")},
        seed=req.seed,
        ignore_eos=bool(req.ignore_eos),
    )


def _check_response_format(rf: Any) -> None:
    if rf is None:
        return
    if not isinstance(rf, dict):
        raise bad_request("invalid_type", "response_format must be an object.", "response_format")
    kind = rf.get("type")
    if kind == "text":
        return
    if kind in ("json_object", "json_schema"):
        raise bad_request("response_format_not_supported", f"response_format '{kind}' needs a server "
                          "started with --structured-output, which this build does not offer yet.",
                          "response_format")
    raise bad_request("invalid_value", "response_format.type must be text, json_object or json_schema.",
                      "response_format.type")


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


def _thinking_options(req: ChatCompletionRequest, ctx: ServerContext) -> tuple[bool, dict[str, Any]]:
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
    if effort in ("default", "auto"):
        effort = None
    if effort is not None and effort not in EFFORTS:
        raise bad_request("invalid_value", f"reasoning_effort must be one of {', '.join(EFFORTS)}.", param)
    if effort == "none":
        if enable is True:
            raise bad_request("invalid_value", "reasoning_effort 'none' disables thinking, which "
                              "enable_thinking: true asks for.", param)
        enable = False
    thinking = enable if enable is not None else not ctx.options.no_thinking
    if effort is not None and effort != "none":
        kwargs["reasoning_effort"] = effort
    if preserve is None and ctx.options.preserve_thinking:
        preserve = True
    if preserve is not None:
        kwargs["preserve_thinking"] = preserve
    return thinking, kwargs


def _tools(req: ChatCompletionRequest) -> list[dict] | None:
    choice = req.tool_choice
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_request("invalid_value", "tool_choice must be auto, none, required or a named tool.",
                              "tool_choice")
    elif choice is not None and not isinstance(choice, dict):
        raise bad_request("invalid_type", "tool_choice must be a string or an object.", "tool_choice")
    if choice == "required" or isinstance(choice, dict):
        raise bad_request("tool_choice_not_supported", "Forcing a tool call (tool_choice required, a named "
                          "tool or allowed_tools) is not supported yet; use auto or none.", "tool_choice")
    if not req.tools or choice == "none":
        return None
    out = []
    for t in req.tools:
        if t.type == "function":
            f = t.function
            fn: dict[str, Any] = {"name": f.name}
            if f.description is not None:
                fn["description"] = f.description
            fn["parameters"] = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
        else:  # a free-form custom tool is served as a single-string-input function under its own name
            c = t.custom
            fn = {"name": c.name}
            if c.description is not None:
                fn["description"] = c.description
            fn["parameters"] = {"type": "object", "properties": {"input": {"type": "string"}},
                                "required": ["input"]}
        out.append({"type": "function", "function": fn})
    return out


def _content_text(content: Any, param: str, role: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("invalid_type", "content must be a string or a list of content parts.", param)
    pieces = []
    for j, part in enumerate(content):
        p = f"{param}.{j}"
        if isinstance(part, str):  # tolerated: a bare string part is its text
            pieces.append(part)
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
            raise bad_request("vision_disabled", "This server was started without --vision; image and "
                              "video input is not accepted.", f"{p}.type")
        elif kind in ("input_audio", "file", "audio"):
            raise bad_request("content_type_not_supported", f"'{kind}' content is not supported: the model "
                              "reads text only.", f"{p}.type")
        else:
            raise bad_request("invalid_value", f"unknown content part type {kind!r}.", f"{p}.type")
    return "".join(pieces)


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


def normalize_messages(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages -> the plain dicts the chat template renders (input order kept)."""
    out = []
    for i, m in enumerate(messages):
        p = f"messages.{i}"
        role = m.role
        d: dict[str, Any] = {"role": "tool" if role == "function" else role,
                             "content": _content_text(m.content, f"{p}.content", role)}
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
