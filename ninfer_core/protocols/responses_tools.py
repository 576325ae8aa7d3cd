"""Responses function tools: direct and namespaced definitions, tool_choice, allowed_tools.

A namespace member gets the Engine identity `namespace.name` (see responses_items.internal_name);
`ToolSet.identity` maps it back so output Items carry separate namespace and name fields.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ninfer_core.protocols.responses_items import internal_name, show
from ninfer_core.server.errors import bad_request

_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}\Z")
_HOSTED = ("web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
           "file_search", "code_interpreter", "computer_use_preview", "computer", "image_generation",
           "local_shell", "shell", "apply_patch", "tool_search")
# --drop-hosted-tools removes these (and their dated variants) from a request's tools: the hosted
# tools a client such as Codex offers by default, which no local server can execute.
DROPPABLE_HOSTED = ("web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
                    "file_search", "code_interpreter", "image_generation", "computer_use_preview", "computer",
                    "mcp", "local_shell")
_FUNCTION_KEYS = {"type", "name", "description", "parameters", "strict", "defer_loading", "output_schema",
                  "allowed_callers"}


@dataclass
class ToolSet:
    declared: list[dict] = field(default_factory=list)  # canonical echo for the Response object
    template_tools: list[dict] = field(default_factory=list)  # effective set, as the template renders it
    identity: dict[str, tuple[str | None, str]] = field(default_factory=dict)  # internal -> (namespace, name)
    callable: list[str] = field(default_factory=list)  # internal names that may become calls, declared order
    forced: str | None = None  # internal name of a forced call
    tool_choice: Any = "auto"  # echo
    parallel_tool_calls: bool = True


def _function(t: dict, param: str, namespace: str | None, ns_desc: str | None) -> tuple[dict, dict]:
    """-> (canonical echo, template tool)."""
    for key in t:
        if key not in _FUNCTION_KEYS:
            raise bad_request("unknown_parameter", f"Unknown parameter: '{param}.{key}'.", f"{param}.{key}")
    name = t.get("name")
    if name is None:
        raise bad_request("missing_required_parameter", f"Missing required parameter: '{param}.name'.",
                          f"{param}.name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request("invalid_value", f"function name {show(name)} at '{param}.name' must be 1-128 letters, "
                          "digits, underscores or dashes.", f"{param}.name")
    desc = t.get("description")
    if desc is not None and not isinstance(desc, str):
        raise bad_request("invalid_type", f"'{param}.description' must be a string.", f"{param}.description")
    params = t.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request("invalid_type", f"'{param}.parameters' must be a JSON Schema object, got {show(params)}.",
                          f"{param}.parameters")
    strict = t.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("invalid_type", f"'{param}.strict' must be a boolean.", f"{param}.strict")
    if strict:
        raise bad_request("strict_tools_not_supported", f"strict: true at '{param}.strict' (function {show(name)}) "
                          "is not supported: NInfer does not constrain tool arguments to their JSON Schema.",
                          f"{param}.strict")
    if t.get("defer_loading"):
        raise bad_request("tool_option_not_supported", f"defer_loading at '{param}.defer_loading' (function "
                          f"{show(name)}) is not supported: there is no tool search.", f"{param}.defer_loading")
    if t.get("output_schema") is not None:
        raise bad_request("tool_option_not_supported", f"output_schema at '{param}.output_schema' (function "
                          f"{show(name)}) is not supported.", f"{param}.output_schema")
    callers = t.get("allowed_callers")
    if callers is not None and (not isinstance(callers, list) or "direct" not in callers):
        raise bad_request("tool_option_not_supported", f"allowed_callers {show(callers)} at "
                          f"'{param}.allowed_callers' excludes direct invocation, the only kind NInfer serves.",
                          f"{param}.allowed_callers")
    echo: dict[str, Any] = {"type": "function", "name": name, "description": desc,
                            "parameters": params, "strict": strict}
    fn: dict[str, Any] = {"name": internal_name(name, namespace)}
    full_desc = " ".join(d for d in (ns_desc, desc) if d)
    if full_desc:
        fn["description"] = full_desc
    fn["parameters"] = params if params is not None else {"type": "object", "properties": {}}
    return echo, {"type": "function", "function": fn}


def _unsupported_tool(kind: Any, param: str) -> Exception:
    if kind in _HOSTED:
        return bad_request("tool_type_not_supported", f"hosted tool {show(kind)} at '{param}.type' is not "
                           "supported: NInfer executes no hosted tools; declare a function instead.", f"{param}.type")
    if kind == "mcp":
        return bad_request("tool_type_not_supported", f"remote MCP tools (at '{param}.type') are not supported; "
                           "declare the server's tools as functions in a namespace.", f"{param}.type")
    if kind == "custom":
        return bad_request("tool_type_not_supported", f"custom free-form tools (at '{param}.type') are not "
                           "supported; declare a function.", f"{param}.type")
    if kind is None:
        return bad_request("missing_required_parameter", f"Missing required parameter: '{param}.type'.",
                           f"{param}.type")
    return bad_request("invalid_value", f"unknown tool type {show(kind)} at '{param}.type'.", f"{param}.type")


def drop_hosted_tools(tools: Any) -> tuple[Any, list[str]]:
    """(the tools without the droppable hosted ones, the types dropped in order); anything that is
    not a list of tool objects is returned as it is for parse_tools to refuse."""
    if not isinstance(tools, list):
        return tools, []
    kept, dropped = [], []
    for t in tools:
        if isinstance(t, dict) and t.get("type") in DROPPABLE_HOSTED:
            dropped.append(t["type"])
        else:
            kept.append(t)
    return kept, dropped


def parse_tools(tools: Any, tool_choice: Any, parallel: Any) -> ToolSet:
    ts = ToolSet()
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise bad_request("invalid_type", f"'tools' must be an array, got {show(tools)}.", "tools")
    all_tools: list[tuple[str, dict]] = []  # (internal, template tool) in declaration order
    for i, t in enumerate(tools):
        param = f"tools.{i}"
        if not isinstance(t, dict):
            raise bad_request("invalid_type", f"'{param}' must be a tool object.", param)
        kind = t.get("type")
        if kind == "function":
            echo, tpl = _function(t, param, None, None)
            entries = [(echo["name"], None, tpl, param)]
            ts.declared.append(echo)
        elif kind == "namespace":
            ns = t.get("name")
            if not isinstance(ns, str) or not _NAME.match(ns):
                raise bad_request("invalid_value", f"namespace name {show(ns)} at '{param}.name' must be 1-128 "
                                  "letters, digits, underscores or dashes.", f"{param}.name")
            desc = t.get("description")
            if desc is not None and not isinstance(desc, str):
                raise bad_request("invalid_type", f"'{param}.description' must be a string.", f"{param}.description")
            members = t.get("tools")
            if not isinstance(members, list) or not members:
                raise bad_request("invalid_value", f"'{param}.tools' must be a non-empty array of functions.",
                                  f"{param}.tools")
            for key in t:
                if key not in ("type", "name", "description", "tools"):
                    raise bad_request("unknown_parameter", f"Unknown parameter: '{param}.{key}'.", f"{param}.{key}")
            entries, echoes = [], []
            for j, m in enumerate(members):
                mp = f"{param}.tools.{j}"
                if not isinstance(m, dict):
                    raise bad_request("invalid_type", f"'{mp}' must be a tool object.", mp)
                if m.get("type") != "function":
                    raise _unsupported_tool(m.get("type"), mp)
                echo, tpl = _function(m, mp, ns, desc)
                echoes.append(echo)
                entries.append((echo["name"], ns, tpl, mp))
            ts.declared.append({"type": "namespace", "name": ns, "description": desc, "tools": echoes})
        else:
            raise _unsupported_tool(kind, param)
        for name, ns, tpl, p in entries:
            key = internal_name(name, ns)
            if key in ts.identity:
                where = f"namespace {show(ns)}" if ns else "the direct tools"
                raise bad_request("duplicate_tool", f"function {show(name)} is declared twice in {where} "
                                  f"(again at '{p}.name').", f"{p}.name")
            ts.identity[key] = (ns, name)
            all_tools.append((key, tpl))
    _choice(ts, all_tools, tool_choice)
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("invalid_type", f"'parallel_tool_calls' must be a boolean, got {show(parallel)}.",
                          "parallel_tool_calls")
    if parallel is False and ts.callable:
        raise bad_request("parallel_tool_calls_not_supported", "parallel_tool_calls: false is accepted only when no "
                          f"tool is callable; this request can call {len(ts.callable)} function(s) and NInfer cannot "
                          "stop the model from writing several calls.", "parallel_tool_calls")
    ts.parallel_tool_calls = parallel is not False
    return ts


def _ref(sel: dict, param: str, ts: ToolSet) -> str:
    """A {"type": "function", "name", "namespace"?} selection -> its internal name."""
    if sel.get("type") != "function":
        kind = sel.get("type")
        raise bad_request("tool_choice_not_supported", f"tool_choice type {show(kind)} at '{param}.type' is not "
                          "supported: only functions can be selected.", f"{param}.type")
    name, ns = sel.get("name"), sel.get("namespace")
    if not isinstance(name, str):
        raise bad_request("missing_required_parameter" if name is None else "invalid_type",
                          f"'{param}.name' must name a declared function.", f"{param}.name")
    if ns is not None and not isinstance(ns, str):
        raise bad_request("invalid_type", f"'{param}.namespace' must be a string.", f"{param}.namespace")
    key = internal_name(name, ns)
    if key not in ts.identity:
        what = f"{show(name)} in namespace {show(ns)}" if ns else show(name)
        raise bad_request("invalid_value", f"tool_choice selects function {what} (at '{param}.name'), which the "
                          "request's tools do not declare.", f"{param}.name")
    return key


def _choice(ts: ToolSet, all_tools: list[tuple[str, dict]], choice: Any) -> None:
    ts.tool_choice = "auto" if choice is None else choice
    effective = [k for k, _ in all_tools]
    mode = "auto"
    if choice is None or choice == "auto":
        pass
    elif choice == "none":
        effective = []
    elif choice == "required":
        mode = "required"
    elif isinstance(choice, str):
        raise bad_request("invalid_value", f"tool_choice {show(choice)} is not auto, none, required or an object.",
                          "tool_choice")
    elif isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            effective = [_ref(choice, "tool_choice", ts)]
            mode = "required"
        elif kind == "allowed_tools":
            m = choice.get("mode", "auto")
            if m not in ("auto", "required"):
                raise bad_request("invalid_value", f"allowed_tools mode {show(m)} is not auto or required.",
                                  "tool_choice.mode")
            refs = choice.get("tools")
            if not isinstance(refs, list):
                raise bad_request("invalid_type", "'tool_choice.tools' must be an array of function selections.",
                                  "tool_choice.tools")
            allowed = set()
            for j, r in enumerate(refs):
                if not isinstance(r, dict):
                    raise bad_request("invalid_type", f"'tool_choice.tools.{j}' must be an object.",
                                      f"tool_choice.tools.{j}")
                allowed.add(_ref(r, f"tool_choice.tools.{j}", ts))
            effective = [k for k in effective if k in allowed]
            mode = m
        else:
            raise bad_request("tool_choice_not_supported", f"tool_choice type {show(kind)} is not supported: only "
                              "auto, none, required, a function and function-only allowed_tools are.",
                              "tool_choice.type")
    else:
        raise bad_request("invalid_type", f"tool_choice must be a string or an object, got {show(choice)}.",
                          "tool_choice")
    if mode == "required":
        if not effective:
            raise bad_request("invalid_value", "tool_choice requires a call but no function is callable.",
                              "tool_choice")
        if len(effective) > 1:
            raise bad_request("tool_choice_not_supported", f"tool_choice required over {len(effective)} callable "
                              "functions is not supported: NInfer forces a call by writing its opener, so exactly "
                              "one function must be selected.", "tool_choice")
        ts.forced = effective[0]
    ts.callable = effective
    keep = set(effective)
    ts.template_tools = [tpl for k, tpl in all_tools if k in keep]
