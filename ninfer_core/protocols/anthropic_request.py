"""Anthropic Messages request checks: from the wire body to a MessagesPlan the adapter runs.

Validation is written out by hand rather than with pydantic because Messages content is a list
of differently shaped blocks whose rules depend on the role, the position in the conversation and
the request's thinking mode; every failure names its field (`param`, e.g. "tools.0.input_schema")
and a NInfer error code. This module reads the top-level fields, thinking and tools; the history
(system, messages, content blocks) is lowered by anthropic_history.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ninfer_core.protocols import anthropic_models
from ninfer_core.protocols.anthropic_history import (
    check_cache_control,
    is_int,
    is_number,
    lower_conversation,
    missing,
    opt_bool,
    wrong_type,
)
from ninfer_core.protocols.anthropic_context import ContextEdits, parse_context_management
from ninfer_core.server.context import ServerContext
from ninfer_core.server.errors import bad_request
from ninfer_core.server.prepare import collapse_effort
from ninfer_core.structured.formats import (
    ResponseFormat,
    anthropic_output_format,
    refuse_conflicts,
    with_instruction,
)

MIN_THINKING_BUDGET = 1024
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
# Template inputs the request cannot replace through chat_template_kwargs.
RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                   "continue_final_message", "add_vision_id")


@dataclass
class MessagesPlan:
    """A validated Messages request, ready to render and submit."""

    model: str | None  # None: a token count that names no model
    messages: list[dict]  # chat-template messages
    tools: list[dict] | None  # OpenAI-form function tools as rendered (None: no tools offered)
    thinking: bool
    display_omitted: bool = False
    thinking_budget: int | None = None
    prefill: str | None = None  # text the final assistant turn already has (continued in place)
    forced_tool: str | None = None  # the tool a forced selection calls (the prompt ends in its opener)
    parallel_tool_calls: bool = True
    tools_cached: bool = False  # a tool definition carries a cache_control hint
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    max_tokens: int | None = None  # None: the default output limit
    stream: bool = False
    sampling_request: dict[str, Any] = field(default_factory=dict)
    post_thinking: dict[str, Any] | None = None
    response_format: Any = None  # ninfer_core.structured ResponseFormat to enforce (--structured-output)
    # context_management (anthropic_context): applied to `source` at render time, where the
    # rendered prompt's token counts decide what the edits clear; `thinking_explicit` re-lowers it.
    context_edits: ContextEdits | None = None
    source: dict | None = None
    thinking_explicit: bool = False


# -- the request ----------------------------------------------------------------------------------

def parse_request(data: Any, ctx: ServerContext, count_only: bool = False) -> MessagesPlan:
    """A Messages (or count_tokens) body -> MessagesPlan, or the 400 naming the offending field.

    `count_only`: output-only fields (max_tokens, stream, sampling, stop_sequences, display,
    output_config.format) are not read, so they cannot change or fail a token count.
    """
    if not isinstance(data, dict):
        raise bad_request("invalid_type", "The request body must be a JSON object.", None)
    # the top-level field types and ranges (model, max_tokens, sampling, stop_sequences, stream,
    # thinking's shape): pydantic, mapped by the one error mapper to the same codes and params
    anthropic_models.validate(data, count_only)
    model = data.get("model")  # required by Messages (validated above); a count may omit it
    _refuse_executors(data)
    _graft(data)

    thinking, explicit, budget, omitted = _thinking(data, ctx, count_only)
    fmt = None if count_only else _output_format(data, ctx)
    if fmt is not None and not explicit and not (isinstance(data.get("output_config"), dict)
                                                 and data["output_config"].get("effort") is not None):
        thinking = False  # spec: structured responses default to thinking disabled unless the request asks
    kwargs, thinking, explicit = _template_kwargs(data, ctx, thinking, explicit)
    tools, forced, parallel, thinking = _tools(data, thinking, explicit)
    messages, prefill = lower_conversation(data, thinking, explicit, vision=ctx.media is not None)
    if fmt is not None and prefill:
        raise bad_request("assistant_prefill_not_supported", "An assistant prefill cannot be continued under a "
                          f"structured output format ({fmt.param}): the document must start with the answer.",
                          "messages")
    messages = with_instruction(messages, fmt, bool(tools))
    plan = MessagesPlan(model=model, messages=messages, tools=tools, thinking=thinking,
                        tools_cached=any(isinstance(t, dict) and t.get("cache_control")
                                         for t in data.get("tools") or []),
                        display_omitted=omitted, thinking_budget=budget if thinking else None,
                        prefill=prefill, forced_tool=forced, parallel_tool_calls=parallel,
                        template_kwargs=kwargs)
    plan.context_edits = parse_context_management(data)
    if plan.context_edits is not None:
        plan.source, plan.thinking_explicit = data, explicit
    if count_only:
        return plan
    plan.max_tokens = _max_tokens(data)
    plan.stream = bool(data.get("stream"))
    plan.stop = list(data.get("stop_sequences") or [])
    plan.sampling_request = {"temperature": _float(data.get("temperature")), "top_p": _float(data.get("top_p")),
                             "top_k": data.get("top_k")}
    plan.post_thinking = _post_thinking(data.get("post_thinking"))
    refuse_conflicts(fmt, stop=plan.stop, stop_param="stop_sequences")
    plan.response_format = fmt
    return plan


def _refuse_executors(data: dict) -> None:
    if data.get("container") is not None:
        raise bad_request("container_not_supported", "Containers are not supported: this server has no "
                          "code-execution container.", "container")
    if data.get("mcp_servers"):
        raise bad_request("mcp_not_supported", "MCP servers are not supported: this server has no MCP "
                          "connector.", "mcp_servers")


def _graft(data: dict) -> None:
    graft = data.get("graft")
    if graft is None or graft == "":
        return
    if not isinstance(graft, str):
        raise wrong_type("graft", "a string")
    raise bad_request("unknown_graft", f"No prompt graft named '{graft}' is loaded on this server.", "graft")


def _max_tokens(data: dict) -> int | None:
    """max_tokens (checked by anthropic_models: an integer >= 1), or None for the default limit."""
    return data.get("max_tokens")


def _float(v: Any) -> float | None:
    return None if v is None else float(v)


def _thinking(data: dict, ctx: ServerContext, count_only: bool) -> tuple[bool, bool, int | None, bool]:
    """(thinking, explicitly chosen, budget, display omitted)."""
    cfg = data.get("thinking")
    if cfg is None:
        return not ctx.options.no_thinking, False, None, False
    if not isinstance(cfg, dict):
        raise wrong_type("thinking", "an object")
    kind = cfg.get("type")
    if kind is None:
        raise missing("thinking.type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad_request("invalid_value", "'thinking.type' must be enabled, disabled or adaptive.",
                          "thinking.type")
    display = cfg.get("display")
    if display is not None and display not in ("summarized", "omitted"):
        raise bad_request("invalid_value", "'thinking.display' must be summarized or omitted.",
                          "thinking.display")
    omitted = display == "omitted" and not count_only
    if kind == "disabled":
        return False, True, None, False
    budget = None
    if kind == "enabled":
        budget = cfg.get("budget_tokens")
        if budget is None:
            raise missing("thinking.budget_tokens")
        if not is_int(budget):
            raise wrong_type("thinking.budget_tokens", "an integer")
        if budget < MIN_THINKING_BUDGET:
            raise bad_request("invalid_value", f"'thinking.budget_tokens' must be at least "
                              f"{MIN_THINKING_BUDGET}, got {budget}.", "thinking.budget_tokens")
    return True, True, budget, omitted


def _template_kwargs(data: dict, ctx: ServerContext, thinking: bool,
                     explicit: bool) -> tuple[dict[str, Any], bool, bool]:
    raw = data.get("chat_template_kwargs")
    if raw is not None and not isinstance(raw, dict):
        raise wrong_type("chat_template_kwargs", "an object")
    kwargs = dict(raw or {})
    for key in RESERVED_KWARGS:
        if key in kwargs:
            raise bad_request("invalid_value", f"'{key}' cannot be set through chat_template_kwargs.",
                              f"chat_template_kwargs.{key}")
    enable = kwargs.pop("enable_thinking", None)
    if enable is not None:
        if not isinstance(enable, bool):
            raise wrong_type("chat_template_kwargs.enable_thinking", "a boolean")
        if explicit and enable != thinking:
            raise bad_request("invalid_value", "chat_template_kwargs.enable_thinking disagrees with "
                              "'thinking'.", "chat_template_kwargs.enable_thinking")
        thinking, explicit = enable, True
    preserve = opt_bool(data, "preserve_thinking")
    inner = kwargs.pop("preserve_thinking", None)
    if inner is not None:
        if not isinstance(inner, bool):
            raise wrong_type("chat_template_kwargs.preserve_thinking", "a boolean")
        if preserve is not None and preserve != inner:
            raise bad_request("invalid_value", "chat_template_kwargs.preserve_thinking disagrees with "
                              "'preserve_thinking'.", "chat_template_kwargs.preserve_thinking")
        preserve = inner
    if preserve is None and ctx.options.preserve_thinking:
        preserve = True
    if preserve is not None:
        kwargs["preserve_thinking"] = preserve

    effort = None
    oc = data.get("output_config")
    if oc is not None:
        if not isinstance(oc, dict):
            raise wrong_type("output_config", "an object")
        effort = oc.get("effort")
        if effort is not None and effort not in EFFORTS:
            raise bad_request("invalid_value", f"'output_config.effort' must be one of {', '.join(EFFORTS)}.",
                              "output_config.effort")
    inner_effort = kwargs.pop("reasoning_effort", None)
    if inner_effort is not None and effort is not None and inner_effort != effort:
        raise bad_request("invalid_value", "chat_template_kwargs.reasoning_effort disagrees with "
                          "'output_config.effort'.", "chat_template_kwargs.reasoning_effort")
    effort = effort if effort is not None else inner_effort
    if effort is None and (thinking or not explicit):  # --default-reasoning-effort yields to the request
        default = ctx.options.thinking.default_reasoning_effort
        if default == "none":
            if not explicit:
                thinking = False
        elif default is not None:
            effort = default
    if effort is not None:
        kwargs["reasoning_effort"] = collapse_effort(ctx.chat_template, effort)
    return kwargs, thinking, explicit


def _output_format(data: dict, ctx: ServerContext) -> ResponseFormat | None:
    """output_config.format (and the older top-level output_format) ask for enforced JSON: the format
    to enforce with --structured-output (ninfer_core.structured), else output_format_not_supported."""
    oc = data.get("output_config")
    found = None
    for param, fmt in (("output_config.format", oc.get("format") if isinstance(oc, dict) else None),
                       ("output_format", data.get("output_format"))):
        if fmt is None:
            continue
        parsed = anthropic_output_format(fmt, param)
        if found is None:
            found = parsed
    if found is not None and not ctx.options.structured_output:
        if ctx.options.unconstrained_response_format:
            return None
        raise bad_request("output_format_not_supported", f"{found.param} needs a server started with "
                          "--structured-output, which enforces it token by token; this server was started "
                          "without it.", found.param)
    return found


_POST_THINKING = {"temperature": (0.0, 1.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0),
                  "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}


def _post_thinking(obj: Any) -> dict[str, Any] | None:
    """The post_thinking object (temperature 0..1 on Messages), validated field by field."""
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise wrong_type("post_thinking", "an object")
    out: dict[str, Any] = {}
    for key, value in obj.items():
        param = f"post_thinking.{key}"
        if value is None:
            continue
        if key in _POST_THINKING:
            lo, hi = _POST_THINKING[key]
            if not is_number(value):
                raise wrong_type(param, "a number")
            if not lo <= value <= hi or (key == "top_p" and value == 0):
                raise bad_request("invalid_value", f"'{param}' is out of range.", param)
        elif key == "top_k":
            if not is_int(value):
                raise wrong_type(param, "an integer")
            if value < 0:
                raise bad_request("invalid_value", f"'{param}' must be non-negative.", param)
        elif key == "seed":
            if not is_int(value):
                raise wrong_type(param, "an integer")
        else:
            raise bad_request("invalid_value", f"'{key}' is not a post_thinking field.", param)
        out[key] = value
    return out


# -- tools ------------------------------------------------------------------------------------------

def _tools(data: dict, thinking: bool, explicit: bool) -> tuple[list[dict] | None, str | None, bool, bool]:
    """(tools as rendered, the forced tool's name, parallel calls allowed, thinking)."""
    raw = data.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise wrong_type("tools", "a list")
    tools: list[dict] = []
    names: set[str] = set()
    for i, t in enumerate(raw or []):
        p = f"tools.{i}"
        if not isinstance(t, dict):
            raise wrong_type(p, "an object")
        kind = t.get("type")
        if kind not in (None, "custom"):
            if kind == "mcp_toolset":
                raise bad_request("mcp_not_supported", "MCP toolsets are not supported: this server has no "
                                  "MCP connector.", f"{p}.type")
            raise bad_request("tool_type_not_supported", f"Tool type '{kind}' is an Anthropic-provided "
                              "server tool; this server has no executor for it. Declare a custom tool with "
                              "an input_schema instead.", f"{p}.type")
        name = t.get("name")
        if name is None:
            raise missing(f"{p}.name")
        if not isinstance(name, str):
            raise wrong_type(f"{p}.name", "a string")
        if not TOOL_NAME.match(name):
            raise bad_request("invalid_value", "A tool name must match ^[a-zA-Z0-9_-]{1,128}$.", f"{p}.name")
        if name in names:
            raise bad_request("invalid_value", f"Tool name '{name}' is declared twice.", f"{p}.name")
        names.add(name)
        if t.get("strict") is True:
            raise bad_request("strict_tools_not_supported", "strict: true needs schema-constrained decoding "
                              "of tool input, which this server does not provide.", f"{p}.strict")
        if t.get("defer_loading") is True:
            raise bad_request("deferred_tools_not_supported", "Deferred tools need a tool-search executor, "
                              "which this server does not have.", f"{p}.defer_loading")
        callers = t.get("allowed_callers")
        if callers is not None and (not isinstance(callers, list) or "direct" not in callers):
            raise bad_request("tool_callers_not_supported", "A tool the model may not call directly needs a "
                              "programmatic tool executor, which this server does not have.",
                              f"{p}.allowed_callers")
        schema = t.get("input_schema")
        if schema is None:
            raise missing(f"{p}.input_schema")
        if not isinstance(schema, dict):
            raise wrong_type(f"{p}.input_schema", "an object")
        if schema.get("type", "object") != "object":
            raise bad_request("invalid_value", "input_schema must describe an object (type: object).",
                              f"{p}.input_schema.type")
        desc = t.get("description")
        if desc is not None and not isinstance(desc, str):
            raise wrong_type(f"{p}.description", "a string")
        examples = t.get("input_examples")
        if examples is not None and not isinstance(examples, list):
            raise wrong_type(f"{p}.input_examples", "a list")
        check_cache_control(t, p)
        fn: dict[str, Any] = {"name": name}
        if desc is not None:
            fn["description"] = desc
        fn["parameters"] = schema
        if examples:
            fn["input_examples"] = examples
        tools.append({"type": "function", "function": fn})

    choice = data.get("tool_choice")
    parallel = True
    forced: str | None = None
    if choice is None:
        return (tools or None), None, True, thinking
    if not isinstance(choice, dict):
        raise wrong_type("tool_choice", "an object")
    kind = choice.get("type")
    if kind not in ("auto", "none", "tool", "any"):
        raise bad_request("invalid_value", "'tool_choice.type' must be auto, none, tool or any.",
                          "tool_choice.type")
    if opt_bool(choice, "disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use"):
        parallel = False
    if kind == "none":
        return None, None, parallel, thinking
    target = None
    if kind == "tool":
        name = choice.get("name")
        if name is None:
            raise missing("tool_choice.name")
        if not isinstance(name, str):
            raise wrong_type("tool_choice.name", "a string")
        if name not in names:
            raise bad_request("invalid_value", f"tool_choice names '{name}', which is not a declared tool.",
                              "tool_choice.name")
        target = name
    elif kind == "any":
        if not tools:
            raise bad_request("invalid_value", "tool_choice 'any' needs at least one tool.", "tool_choice")
        if len(tools) == 1:  # one callable tool: executable; several: advisory, stays automatic
            target = tools[0]["function"]["name"]
    if target is not None:
        if thinking and explicit:
            raise bad_request("thinking_not_supported_with_forced_tool", "Forcing a tool call (tool_choice "
                              f"'{kind}') needs thinking disabled for the request: send thinking: "
                              "{\"type\": \"disabled\"}.", "tool_choice")
        thinking = False  # the server's default thinking gives way to the forced call
        forced = target
    return (tools or None), forced, parallel, thinking


