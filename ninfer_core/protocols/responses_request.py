"""Responses create and input-token-count request checks: wire JSON -> a CreatePlan.

Every top-level field of the spec's create table is read here; an unknown field fails with
unknown_parameter, a recognized but unsupported one with a field-specific code that names the
value and its location. Input Items are normalized later (responses_items), once the parent
Response is known, because Item ids must be unique across the whole conversation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ninfer_core.engine.api import EngineError
from ninfer_core.protocols import responses_models
from ninfer_core.protocols.responses_items import show
from ninfer_core.protocols.responses_tools import ToolSet, drop_hosted_tools, parse_tools
from ninfer_core.server.context import ServerContext
from ninfer_core.server.errors import bad_request, parse_json_body
from ninfer_core.structured.formats import ResponseFormat, admit, responses_text_format

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
SUMMARIES = ("auto", "concise", "detailed")
INCLUDES = ("reasoning.encrypted_content", "message.output_text.logprobs")

CREATE_FIELDS = {
    "model", "input", "instructions", "previous_response_id", "max_output_tokens", "stream", "store",
    "temperature", "top_p", "metadata", "client_metadata", "reasoning", "chat_template_kwargs",
    "preserve_thinking", "graft", "thinking_budget", "text", "tools", "tool_choice", "parallel_tool_calls",
    "max_tool_calls", "truncation", "top_logprobs", "service_tier", "background", "include", "stream_options",
    "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "safety_identifier", "user",
    "post_thinking",
}
COUNT_FIELDS = {"model", "input", "instructions", "previous_response_id", "reasoning", "tools", "tool_choice",
                "parallel_tool_calls", "text", "truncation", "preserve_thinking", "chat_template_kwargs", "graft"}
# Recognized Responses features NInfer does not offer: rejected by name, never ignored.
UNSUPPORTED_FIELDS = {
    "conversation": ("conversation_not_supported", ("Conversations are not supported; chain Responses with "
                     "previous_response_id.")),
    "prompt": ("prompt_not_supported", "Stored prompt templates are not supported; send instructions and input."),
    "context_management": ("context_management_not_supported", ("Server-side context management (compaction) is "
                           "not supported.")),
    "moderation": ("moderation_not_supported", "Hosted moderation is not supported."),
}


@dataclass
class CreatePlan:
    model: str
    input: Any
    instructions: str | None
    previous_response_id: str | None
    max_output_tokens: int | None
    stream: bool
    store: bool
    temperature: float | None
    top_p: float | None
    metadata: dict[str, str]
    effort: str | None
    summary: str | None
    template_kwargs: dict[str, Any]  # chat_template_kwargs as sent (standard options resolved later)
    preserve_thinking: bool | None  # explicit value (top-level or kwargs), None: inherit / default
    enable_thinking: bool | None  # chat_template_kwargs.enable_thinking
    thinking_budget: int | None
    post_thinking: dict[str, Any] | None
    text: dict[str, Any]
    tools: ToolSet
    max_tool_calls: int | None
    top_logprobs: int | None
    logprobs: bool
    include: list[str]
    encrypted_reasoning: bool
    echo: dict[str, Any] = field(default_factory=dict)  # hints echoed in the Response object
    response_format: ResponseFormat | None = None  # text.format to enforce (--structured-output)
    dropped_tools: list[str] = field(default_factory=list)  # hosted tool types --drop-hosted-tools removed


def load_body(raw: bytes) -> dict:
    data = parse_json_body(raw)
    if not isinstance(data, dict):
        raise bad_request("invalid_type", "The request body must be a JSON object.", None)
    return data


def _type(v: Any, kind: type | tuple, name: str, what: str) -> Any:
    if kind in (int, (int,)) and isinstance(v, bool):
        raise bad_request("invalid_type", f"'{name}' must be {what}, got {show(v)}.", name)
    if not isinstance(v, kind) or (kind is float and isinstance(v, bool)):
        raise bad_request("invalid_type", f"'{name}' must be {what}, got {show(v)}.", name)
    return v


def _number(data: dict, name: str, lo: float, hi: float) -> float | None:
    v = data.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request("invalid_type", f"'{name}' must be a number, got {show(v)}.", name)
    if not math.isfinite(v) or not lo <= v <= hi:
        raise bad_request("invalid_value", f"'{name}' must be a finite number in [{lo:g}, {hi:g}], got {show(v)}.",
                          name)
    return float(v)


def _int(data: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = data.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request("invalid_type", f"'{name}' must be an integer, got {show(v)}.", name)
    if v < lo or (hi is not None and v > hi):
        rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise bad_request("invalid_value", f"'{name}' must be an integer {rng}, got {v}.", name)
    return v


def _opt_str(data: dict, name: str, max_len: int | None = None) -> str | None:
    v = data.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad_request("invalid_type", f"'{name}' must be a string, got {show(v)}.", name)
    if max_len is not None and len(v) > max_len:
        raise bad_request("invalid_value", f"'{name}' is {len(v)} characters; at most {max_len} are allowed.", name)
    return v


def _bool(data: dict, name: str) -> bool | None:
    v = data.get(name)
    if v is None:
        return None
    return _type(v, bool, name, "a boolean")


def _metadata(v: Any) -> dict[str, str]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad_request("invalid_type", f"'metadata' must be an object of strings, got {show(v)}.", "metadata")
    if len(v) > 16:
        raise bad_request("invalid_value", f"'metadata' has {len(v)} pairs; at most 16 are allowed.", "metadata")
    for k, val in v.items():
        if len(k) > 64:
            raise bad_request("invalid_value", f"metadata key {show(k)} is {len(k)} characters; at most 64 are "
                              "allowed.", f"metadata.{k}")
        if not isinstance(val, str):
            raise bad_request("invalid_type", f"metadata value for {show(k)} must be a string, got {show(val)}.",
                              f"metadata.{k}")
        if len(val) > 512:
            raise bad_request("invalid_value", f"metadata value for {show(k)} is {len(val)} characters; at most 512 "
                              "are allowed.", f"metadata.{k}")
    return dict(v)


def _reasoning(v: Any) -> tuple[str | None, str | None, dict]:
    if v is None:
        return None, None, {"effort": None, "summary": None}
    if not isinstance(v, dict):
        raise bad_request("invalid_type", f"'reasoning' must be an object, got {show(v)}.", "reasoning")
    for key in v:
        if key in ("context", "mode"):
            if v[key] is not None:
                raise bad_request("reasoning_option_not_supported", f"reasoning.{key} {show(v[key])} is not "
                                  "supported.", f"reasoning.{key}")
        elif key not in ("effort", "summary", "generate_summary"):
            raise bad_request("unknown_parameter", f"Unknown parameter: 'reasoning.{key}'.", f"reasoning.{key}")
    effort = v.get("effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise bad_request("invalid_type", f"'reasoning.effort' must be a string, got {show(effort)}.",
                              "reasoning.effort")
        if effort not in EFFORTS:
            raise bad_request("invalid_value", f"reasoning.effort {show(effort)} is not one of "
                              f"{', '.join(EFFORTS)}.", "reasoning.effort")
    summary = None
    for key in ("summary", "generate_summary"):
        s = v.get(key)
        if s is None:
            continue
        if not isinstance(s, str) or s not in SUMMARIES:
            raise bad_request("invalid_value", f"reasoning.{key} {show(s)} is not one of auto, concise, detailed.",
                              f"reasoning.{key}")
        if summary is not None and s != summary:
            raise bad_request("invalid_value", f"reasoning.generate_summary {show(s)} disagrees with "
                              f"reasoning.summary {show(summary)}.", "reasoning.generate_summary")
        summary = s
    echo = {"effort": effort, "summary": summary}
    return effort, summary, echo


def _format_echo(fmt: ResponseFormat | None) -> dict:
    """text.format as the Response object reports it."""
    if fmt is None:
        return {"type": "text"}
    if fmt.kind == "json_object":
        return {"type": "json_object"}
    echo: dict[str, Any] = {"type": "json_schema", "name": fmt.name, "schema": fmt.schema, "strict": fmt.strict}
    if fmt.description is not None:
        echo["description"] = fmt.description
    return echo


def _text(v: Any) -> dict:
    if v is None:
        return {"format": {"type": "text"}}
    if not isinstance(v, dict):
        raise bad_request("invalid_type", f"'text' must be an object, got {show(v)}.", "text")
    for key in v:
        if key not in ("format", "verbosity"):
            raise bad_request("unknown_parameter", f"Unknown parameter: 'text.{key}'.", f"text.{key}")
    fmt = v.get("format") or {"type": "text"}
    parsed = responses_text_format(fmt)  # ninfer_core.structured: text, json_object or flat json_schema
    out: dict[str, Any] = {"format": _format_echo(parsed)}
    verbosity = v.get("verbosity")
    if verbosity is not None:
        if verbosity != "medium":
            code = "verbosity_not_supported" if verbosity in ("low", "high") else "invalid_value"
            raise bad_request(code, f"text.verbosity {show(verbosity)} is not supported; only medium is.",
                              "text.verbosity")
        out["verbosity"] = "medium"
    return out


def _include(v: Any) -> list[str]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise bad_request("invalid_type", f"'include' must be an array of strings, got {show(v)}.", "include")
    for i, s in enumerate(v):
        if not isinstance(s, str):
            raise bad_request("invalid_type", f"'include.{i}' must be a string, got {show(s)}.", f"include.{i}")
        if s not in INCLUDES:
            raise bad_request("include_not_supported", f"include value {show(s)} at 'include.{i}' is not supported; "
                              f"only {' and '.join(INCLUDES)} are.", f"include.{i}")
    return list(dict.fromkeys(v))


def _post_thinking(v: Any) -> dict[str, Any] | None:
    """The post_thinking sampler object, checked by the shared Chat Completions model."""
    if v is None:
        return None
    from pydantic import ValidationError

    from ninfer_core.protocols.openai_models import PostThinking

    if not isinstance(v, dict):
        raise bad_request("invalid_type", f"'post_thinking' must be an object, got {show(v)}.", "post_thinking")
    try:
        return PostThinking.model_validate(v).model_dump()
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = ".".join(["post_thinking", *(str(p) for p in err["loc"])])
        kind = err["type"]
        code = ("unknown_parameter" if kind == "extra_forbidden" else
                "invalid_type" if kind.endswith("_type") or kind in ("int_from_float", "int_parsing", "float_parsing")
                else "invalid_value")
        raise bad_request(code, f"Invalid value for '{param}': {err['msg']}.", param) from None


def parse_request(data: dict, ctx: ServerContext, count_only: bool = False) -> CreatePlan:
    allowed = COUNT_FIELDS if count_only else CREATE_FIELDS
    for key, value in data.items():
        if key in UNSUPPORTED_FIELDS and value is not None:
            code, msg = UNSUPPORTED_FIELDS[key]
            raise bad_request(code, msg, key)
        if key not in allowed and key not in UNSUPPORTED_FIELDS:
            if count_only and key in CREATE_FIELDS:
                raise bad_request("unsupported_parameter", f"'{key}' is not accepted by input token count, which "
                                  "does not generate.", key)
            raise bad_request("unknown_parameter", f"Unknown parameter: '{key}'.", key)
    # the top-level scalar types and ranges: pydantic (responses_models), mapped to the same codes and params
    responses_models.validate(data, count_only)

    model_id = ctx.model.id if ctx.model else ""
    model = data.get("model")
    if model is not None and not ctx.serves_model(model):
        raise EngineError(404, "model_not_found", f"The model {show(model)} does not exist; this server serves "
                          f"{show(model_id)}.", param="model")

    instructions = data.get("instructions")
    prev = data.get("previous_response_id")
    max_out = data.get("max_output_tokens")
    stream = bool(data.get("stream"))
    store = data.get("store")
    temperature = None if data.get("temperature") is None else float(data["temperature"])
    top_p = None if data.get("top_p") is None else float(data["top_p"])
    metadata = _metadata(data.get("metadata"))
    cm = data.get("client_metadata")
    if cm is not None and not isinstance(cm, dict):
        raise bad_request("invalid_type", f"'client_metadata' must be an object or null, got {show(cm)}.",
                          "client_metadata")
    effort, summary, reasoning_echo = _reasoning(data.get("reasoning"))

    kwargs = data.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad_request("invalid_type", "'chat_template_kwargs' must be an object.", "chat_template_kwargs")
    kwargs = dict(kwargs)
    preserve = _bool(data, "preserve_thinking")
    inner = kwargs.pop("preserve_thinking", None)
    if inner is not None and not isinstance(inner, bool):
        raise bad_request("invalid_type", "chat_template_kwargs.preserve_thinking must be a boolean.",
                          "chat_template_kwargs.preserve_thinking")
    if preserve is not None and inner is not None and preserve != inner:
        raise bad_request("invalid_value", f"chat_template_kwargs.preserve_thinking {show(inner)} disagrees with "
                          f"preserve_thinking {show(preserve)}.", "chat_template_kwargs.preserve_thinking")
    preserve = preserve if preserve is not None else inner
    enable = kwargs.pop("enable_thinking", None)
    if enable is not None and not isinstance(enable, bool):
        raise bad_request("invalid_type", "chat_template_kwargs.enable_thinking must be a boolean.",
                          "chat_template_kwargs.enable_thinking")
    inner_effort = kwargs.pop("reasoning_effort", None)
    if inner_effort is not None:
        if not isinstance(inner_effort, str) or inner_effort not in EFFORTS:
            raise bad_request("invalid_value", f"chat_template_kwargs.reasoning_effort {show(inner_effort)} is not "
                              f"one of {', '.join(EFFORTS)}.", "chat_template_kwargs.reasoning_effort")
        if effort is not None and effort != inner_effort:
            raise bad_request("invalid_value", f"chat_template_kwargs.reasoning_effort {show(inner_effort)} "
                              f"disagrees with reasoning.effort {show(effort)}.",
                              "chat_template_kwargs.reasoning_effort")
        effort = inner_effort
    if effort == "none" and enable is True:
        raise bad_request("invalid_value", "reasoning.effort none disables thinking, which "
                          "chat_template_kwargs.enable_thinking: true asks for.", "reasoning.effort")
    from ninfer_core.protocols.openai_chat_request import RESERVED_KWARGS

    for key in RESERVED_KWARGS:
        if key in kwargs:
            raise bad_request("invalid_value", f"'{key}' cannot be set through chat_template_kwargs.",
                              f"chat_template_kwargs.{key}")

    graft = data.get("graft")
    if graft is not None:
        _type(graft, str, "graft", "a string or null")
        raise bad_request("unknown_graft", f"graft {show(graft)} is not loaded by this server (it loads no "
                          "grafts).", "graft")
    budget = _int(data, "thinking_budget", 1)
    post_thinking = _post_thinking(data.get("post_thinking"))

    text = _text(data.get("text"))
    response_format = None
    if not count_only and isinstance(data.get("text"), dict):
        response_format = admit(responses_text_format(data["text"].get("format")), ctx.options)
    raw_tools, dropped = data.get("tools"), []
    if getattr(ctx.options, "drop_hosted_tools", False):
        raw_tools, dropped = drop_hosted_tools(raw_tools)
    tools = parse_tools(raw_tools, data.get("tool_choice"), data.get("parallel_tool_calls"))
    max_tool_calls = _int(data, "max_tool_calls", 0)
    trunc = data.get("truncation")
    if trunc is not None and trunc != "disabled":
        code = "truncation_not_supported" if trunc == "auto" else "invalid_value"
        raise bad_request(code, f"truncation {show(trunc)} is not supported: overlong input fails instead of "
                          "dropping Items (send disabled or omit it).", "truncation")
    top_logprobs = _int(data, "top_logprobs", 0, 20)
    tier = data.get("service_tier")
    if tier is not None and tier not in ("auto", "default"):
        code = "service_tier_not_supported" if isinstance(tier, str) else "invalid_type"
        raise bad_request(code, f"service_tier {show(tier)} is not supported; only auto and default are.",
                          "service_tier")
    bg = data.get("background")
    if bg is not None:
        _type(bg, bool, "background", "a boolean")
        if bg:
            raise bad_request("background_not_supported", "background: true is not supported: Responses run in "
                              "the foreground of their request.", "background")
    include = _include(data.get("include"))
    logprobs = "message.output_text.logprobs" in include or bool(top_logprobs)
    so = data.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("invalid_type", "'stream_options' must be an object.", "stream_options")
        for key, val in so.items():
            if key != "include_obfuscation":
                raise bad_request("unknown_parameter", f"Unknown parameter: 'stream_options.{key}'.",
                                  f"stream_options.{key}")
            if val is not None:
                _type(val, bool, "stream_options.include_obfuscation", "a boolean")
    echo: dict[str, Any] = {"reasoning": reasoning_echo}
    for name in ("prompt_cache_key", "safety_identifier", "user"):
        echo[name] = _opt_str(data, name, 512)
    retention = data.get("prompt_cache_retention")
    if retention is not None and retention not in ("in_memory", "in-memory", "24h"):
        raise bad_request("invalid_value", f"prompt_cache_retention {show(retention)} is not in_memory or 24h.",
                          "prompt_cache_retention")
    echo["prompt_cache_retention"] = retention
    pco = data.get("prompt_cache_options")
    if pco is not None and not isinstance(pco, dict):
        raise bad_request("invalid_type", "'prompt_cache_options' must be an object.", "prompt_cache_options")

    return CreatePlan(
        model=model or model_id, input=data.get("input"), instructions=instructions, previous_response_id=prev,
        max_output_tokens=max_out, stream=stream, store=True if store is None else store,
        temperature=temperature, top_p=top_p, metadata=metadata, effort=effort, summary=summary,
        template_kwargs=kwargs, preserve_thinking=preserve, enable_thinking=enable, thinking_budget=budget,
        post_thinking=post_thinking,
        text=text, tools=tools, max_tool_calls=max_tool_calls, top_logprobs=top_logprobs, logprobs=logprobs,
        include=include, encrypted_reasoning="reasoning.encrypted_content" in include, echo=echo,
        response_format=response_format, dropped_tools=dropped)


def resolve_thinking(plan: CreatePlan, ctx: ServerContext, preserve: bool | None) -> tuple[bool, dict[str, Any]]:
    """Thinking mode and template kwargs. A forced call switches default thinking off and refuses
    thinking the request itself enables (tool_choice_not_supported)."""
    from ninfer_core.server.prepare import collapse_effort

    kwargs = dict(plan.template_kwargs)
    enable = plan.enable_thinking
    effort = plan.effort
    if effort == "none":
        enable = False
    if plan.tools.forced is not None:
        if enable is True:
            raise bad_request("tool_choice_not_supported", "a forced tool call needs a prompt without a thinking "
                              "block, but chat_template_kwargs.enable_thinking: true asks for one.", "tool_choice")
        enable = False
    elif plan.response_format is not None and enable is None and effort is None and plan.thinking_budget is None:
        enable = False  # spec: structured responses default to thinking disabled unless the request asks
    elif effort is None and enable is not False:
        default = ctx.options.thinking.default_reasoning_effort  # yields to everything the request decides
        if default == "none":
            if enable is None:
                enable = False
        elif default is not None:
            effort = default
    if effort is not None and effort != "none":
        kwargs["reasoning_effort"] = collapse_effort(ctx.chat_template, effort)
    thinking = enable if enable is not None else not ctx.options.no_thinking
    if preserve is None and ctx.options.preserve_thinking:
        preserve = True
    if preserve is not None:
        kwargs["preserve_thinking"] = preserve
    return thinking, kwargs
