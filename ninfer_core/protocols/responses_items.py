"""Responses Input Items: validation into canonical Items, and grouping into template messages.

`normalize_input` turns the wire `input` (a string or an Item array) into canonical Items (every
one with an id, client order kept) that are stored, listed by GET .../input_items and replayed by
previous_response_id. `to_messages` groups a whole context (history + this request's Items) into
the plain message dicts the chat template renders: contiguous assistant-owned Items become one
assistant turn in the order reasoning -> content -> calls, and function_call_output Items are
matched to that turn's calls by call_id and reordered to declaration order.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from ninfer_core.engine.api import EngineError
from ninfer_core.server.errors import bad_request

ROLES = ("user", "assistant", "system", "developer")
PREFIXES = {"message": "msg_", "reasoning": "rs_", "function_call": "fc_", "function_call_output": "fco_"}
_UNSUPPORTED_ITEMS = {
    "item_reference": "item references", "file_search_call": "hosted file search calls",
    "web_search_call": "hosted web search calls", "computer_call": "computer-use calls",
    "computer_call_output": "computer-use results", "image_generation_call": "image generation calls",
    "code_interpreter_call": "code interpreter calls", "local_shell_call": "local shell calls",
    "local_shell_call_output": "local shell results", "shell_call": "shell calls",
    "shell_call_output": "shell results", "apply_patch_call": "apply_patch calls",
    "apply_patch_call_output": "apply_patch results", "mcp_list_tools": "MCP tool lists",
    "mcp_approval_request": "MCP approvals", "mcp_approval_response": "MCP approvals",
    "mcp_call": "remote MCP calls", "custom_tool_call": "custom tool calls",
    "custom_tool_call_output": "custom tool results", "compaction": "compaction Items",
    "tool_search_call": "tool search calls", "tool_search_output": "tool search results",
}
_UNSUPPORTED_PARTS = {"input_file": "file input", "input_audio": "audio input"}


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def show(value: Any, limit: int = 64) -> str:
    """A request value for an error message: JSON, ASCII-escaped, truncated."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = ascii(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _str(d: dict, key: str, param: str, required: bool = True, empty_ok: bool = False) -> str | None:
    v = d.get(key)
    if v is None:
        if required:
            raise bad_request("missing_required_parameter", f"Missing required parameter: '{param}.{key}'.",
                              f"{param}.{key}")
        return None
    if not isinstance(v, str):
        raise bad_request("invalid_type", f"'{param}.{key}' must be a string, got {show(v)}.", f"{param}.{key}")
    if not v and not empty_ok:
        raise bad_request("invalid_value", f"'{param}.{key}' must not be empty.", f"{param}.{key}")
    return v


def _vision_refusal(param: str) -> EngineError:
    return bad_request("vision_disabled", "This server was started without --vision; image and video input "
                       f"is not accepted (at '{param}').", param)


def _part(part: Any, param: str, role: str, vision: bool) -> dict:
    """One message content part -> its canonical dict."""
    if not isinstance(part, dict):
        raise bad_request("invalid_type", f"'{param}' must be a content part object, got {show(part)}.", param)
    kind = part.get("type")
    if kind == "input_text" or (kind == "output_text" and role == "assistant"):
        text = _str(part, "text", param, empty_ok=True)
        out = {"type": kind, "text": text}
        if kind == "output_text":
            out["annotations"] = []
        _breakpoint(part, param, out)
        return out
    if kind == "refusal" and role == "assistant":
        return {"type": "refusal", "refusal": _str(part, "refusal", param, empty_ok=True)}
    if kind in ("input_image", "input_video"):
        if role in ("system", "developer"):
            raise bad_request("invalid_value", f"a {role} message cannot carry {kind} (at '{param}.type').",
                              f"{param}.type")
        if not vision:
            raise _vision_refusal(f"{param}.type")
        from ninfer_core.media.parts import openai_part

        ref = openai_part(part, param, vision == "lenient")["media"]  # field checks; fetched at render
        field = "video_url" if ref.kind == "video" else "image_url"
        out = {"type": kind, field: ref.url}
        if ref.kind == "image":
            out["detail"] = ref.detail
        _breakpoint(part, param, out)
        return out
    if kind in _UNSUPPORTED_PARTS:
        raise bad_request("content_type_not_supported", f"{_UNSUPPORTED_PARTS[kind]} ({kind}) is not supported: "
                          f"the model reads text only (at '{param}.type').", f"{param}.type")
    if kind in ("output_text", "refusal"):
        raise bad_request("invalid_value", f"{kind} parts belong to assistant messages, not {role} "
                          f"(at '{param}.type').", f"{param}.type")
    if kind is None:
        raise bad_request("missing_required_parameter", f"Missing required parameter: '{param}.type'.",
                          f"{param}.type")
    raise bad_request("invalid_value", f"unknown content part type {show(kind)} at '{param}.type'.",
                      f"{param}.type")


def _breakpoint(src: dict, param: str, out: dict) -> None:
    """prompt_cache_breakpoint: {"mode": "explicit"}: a reuse hint kept on the canonical part."""
    bp = src.get("prompt_cache_breakpoint")
    if bp is None:
        return
    if not isinstance(bp, dict) or bp.get("mode") != "explicit" or set(bp) - {"mode"}:
        raise bad_request("invalid_value", f"prompt_cache_breakpoint must be {{\"mode\": \"explicit\"}}, "
                          f"got {show(bp)} (at '{param}.prompt_cache_breakpoint').",
                          f"{param}.prompt_cache_breakpoint")
    out["prompt_cache_breakpoint"] = {"mode": "explicit"}


def _message(item: dict, param: str, vision: bool) -> dict:
    role = item.get("role")
    if role is None:
        raise bad_request("missing_required_parameter", f"Missing required parameter: '{param}.role'.",
                          f"{param}.role")
    if role not in ROLES:
        raise bad_request("invalid_value", f"message role {show(role)} is not one of user, assistant, system, "
                          f"developer (at '{param}.role').", f"{param}.role")
    content = item.get("content")
    if isinstance(content, str):
        parts = [{"type": "output_text", "text": content, "annotations": []} if role == "assistant"
                 else {"type": "input_text", "text": content}]
    elif isinstance(content, list):
        parts = [_part(p, f"{param}.content.{j}", role, vision) for j, p in enumerate(content)]
    elif content is None:
        raise bad_request("missing_required_parameter", f"Missing required parameter: '{param}.content'.",
                          f"{param}.content")
    else:
        raise bad_request("invalid_type", f"'{param}.content' must be a string or a list of parts, got "
                          f"{show(content)}.", f"{param}.content")
    out = {"type": "message", "role": role, "content": parts}
    for meta in ("status", "phase"):
        if item.get(meta) is not None:
            out[meta] = _str(item, meta, param, required=False, empty_ok=True)
    return out


def _reasoning(item: dict, param: str) -> dict:
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise bad_request("invalid_value", "a reasoning Item must carry its raw reasoning_text content; summary "
                          "or encrypted_content alone cannot replace it (NInfer replays raw reasoning) "
                          f"(at '{param}.content').", f"{param}.content")
    parts = []
    for j, p in enumerate(content):
        pp = f"{param}.content.{j}"
        if not isinstance(p, dict) or p.get("type") != "reasoning_text":
            raise bad_request("invalid_value", f"reasoning content parts must be reasoning_text, got {show(p)} "
                              f"(at '{pp}').", pp)
        parts.append({"type": "reasoning_text", "text": _str(p, "text", pp, empty_ok=True)})
    summary = item.get("summary")
    if summary is None:
        summary = []
    if not isinstance(summary, list):
        raise bad_request("invalid_type", f"'{param}.summary' must be a list.", f"{param}.summary")
    for j, s in enumerate(summary):
        if not isinstance(s, dict) or not isinstance(s.get("text"), str):
            raise bad_request("invalid_value", f"a summary part needs type summary_text and a string text "
                              f"(at '{param}.summary.{j}').", f"{param}.summary.{j}")
    out = {"type": "reasoning", "summary": [{"type": "summary_text", "text": s["text"]} for s in summary],
           "content": parts}
    enc = item.get("encrypted_content")
    if enc is not None:
        out["encrypted_content"] = _str(item, "encrypted_content", param, required=False, empty_ok=True)
    return out


def _status(item: dict, param: str, kind: str) -> None:
    st = item.get("status")
    if st is not None and st != "completed":
        raise bad_request("invalid_value", f"only completed {kind} Items can be replayed; status {show(st)} is a "
                          f"partial Item (at '{param}.status').", f"{param}.status")


def _function_call(item: dict, param: str) -> dict:
    _status(item, param, "function_call")
    call_id = _str(item, "call_id", param)
    name = _str(item, "name", param)
    args = item.get("arguments")
    if args is None:
        raise bad_request("missing_required_parameter", f"Missing required parameter: '{param}.arguments'.",
                          f"{param}.arguments")
    if not isinstance(args, str):
        raise bad_request("invalid_type", f"'{param}.arguments' must be a JSON-object string, got {show(args)}.",
                          f"{param}.arguments")
    try:
        decoded = json.loads(args) if args.strip() else {}
    except json.JSONDecodeError:
        raise bad_request("invalid_value", f"'{param}.arguments' is not valid JSON: {show(args)}.",
                          f"{param}.arguments") from None
    if not isinstance(decoded, dict):
        raise bad_request("invalid_value", f"'{param}.arguments' must encode a JSON object, got {show(args)}.",
                          f"{param}.arguments")
    out = {"type": "function_call", "call_id": call_id, "name": name, "arguments": args}
    ns = _str(item, "namespace", param, required=False)
    if ns is not None:
        out["namespace"] = ns
    out["status"] = "completed"
    return out


def _function_output(item: dict, param: str, vision: bool) -> dict:
    _status(item, param, "function_call_output")
    out: dict[str, Any] = {"type": "function_call_output", "call_id": _str(item, "call_id", param)}
    for key in ("name", "namespace"):
        v = _str(item, key, param, required=False)
        if v is not None:
            out[key] = v
    output = item.get("output")
    if isinstance(output, str):
        out["output"] = output
    elif isinstance(output, list):
        if not output:
            raise bad_request("invalid_value", f"'{param}.output' must be a string or a non-empty list of parts.",
                              f"{param}.output")
        parts = []
        for j, p in enumerate(output):
            pp = f"{param}.output.{j}"
            if isinstance(p, dict) and p.get("type") not in ("input_text", "input_image"):
                if p.get("type") in _UNSUPPORTED_PARTS:
                    raise bad_request("content_type_not_supported", f"{_UNSUPPORTED_PARTS[p['type']]} is not "
                                      f"supported in a tool result (at '{pp}.type').", f"{pp}.type")
                raise bad_request("invalid_value", f"a tool result part must be input_text or input_image, got "
                                  f"{show(p.get('type'))} (at '{pp}.type').", f"{pp}.type")
            parts.append(_part(p, pp, "user", vision))
        out["output"] = parts
    elif output is None:
        raise bad_request("missing_required_parameter", f"Missing required parameter: '{param}.output'.",
                          f"{param}.output")
    else:
        raise bad_request("invalid_type", f"'{param}.output' must be a string or a list of parts, got "
                          f"{show(output)}.", f"{param}.output")
    return out


def normalize_input(value: Any, vision: bool | str, taken_ids: set[str]) -> list[dict]:
    """The wire `input` -> canonical Items with ids (client order). `taken_ids`: ids already in context.
    `vision`: media parts are accepted (True, or "lenient" to read an unknown image detail as auto)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "id": new_id("msg_"), "role": "user",
                 "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list):
        raise bad_request("invalid_type", f"'input' must be a string or an array of Items, got {show(value)}.",
                          "input")
    seen = set(taken_ids)
    items = []
    for i, item in enumerate(value):
        param = f"input.{i}"
        if not isinstance(item, dict):
            raise bad_request("invalid_type", f"'{param}' must be an Item object, got {show(item)}.", param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind is not None and not isinstance(kind, str):  # (a dict here was a TypeError, a 500)
            raise bad_request("invalid_type", f"'{param}.type' must be a string, got {show(kind)}.", f"{param}.type")
        if kind == "message":
            out = _message(item, param, vision)
        elif kind == "reasoning":
            out = _reasoning(item, param)
        elif kind == "function_call":
            out = _function_call(item, param)
        elif kind == "function_call_output":
            out = _function_output(item, param, vision)
        elif kind in _UNSUPPORTED_ITEMS:
            raise bad_request("item_type_not_supported", f"{_UNSUPPORTED_ITEMS[kind]} ({kind}) are not supported "
                              f"as input Items (at '{param}.type').", f"{param}.type")
        elif kind is None:
            raise bad_request("missing_required_parameter", f"Missing required parameter: '{param}.type'.",
                              f"{param}.type")
        else:
            raise bad_request("invalid_value", f"unknown Item type {show(kind)} at '{param}.type'.", f"{param}.type")
        given = item.get("id")
        if given is not None:
            if not isinstance(given, str) or not given:
                raise bad_request("invalid_type", f"'{param}.id' must be a non-empty string, got {show(given)}.",
                                  f"{param}.id")
            if given in seen:
                raise bad_request("duplicate_item_id", f"the Item id {show(given)} at '{param}.id' is already used "
                                  "in this conversation.", f"{param}.id")
            item_id = given
        else:
            item_id = new_id(PREFIXES[kind])
        seen.add(item_id)
        items.append({"id": item_id, **out})
    return items


# -- grouping -----------------------------------------------------------------------------------


def internal_name(name: str, namespace: str | None) -> str:
    """The Engine identity of a function: namespace members are `namespace.name` (dots are not legal in
    OpenAI function names, so a namespaced identity never collides with a direct one)."""
    return f"{namespace}.{name}" if namespace else name


def _text(parts: list[dict] | str, param: str | None = None) -> str | list:
    """Canonical parts -> template content: their text, or with media parts a list of text and
    media parts (ninfer_core.media.prompt), in order."""
    if isinstance(parts, str):
        return parts
    out: list = []
    media = False
    for j, p in enumerate(parts):
        if p["type"] in ("input_text", "output_text"):
            out.append(p["text"])
        elif p["type"] == "refusal":
            out.append(p["refusal"])
        elif p["type"] in ("input_image", "input_video"):
            from ninfer_core.media.parts import openai_part

            out.append(openai_part(p, f"{param}.{j}" if param else "input", True))
            media = True
    if not media:
        return "".join(out)
    return [x if isinstance(x, dict) else {"type": "text", "text": x} for x in out]


BREAKPOINT_KEY = "_ninfer_cache_breakpoint"  # on a template message: a client prompt_cache_breakpoint ends it
MAX_BREAKPOINTS = 4


def _has_breakpoint(parts: list[dict] | str) -> bool:
    return not isinstance(parts, str) and any("prompt_cache_breakpoint" in p for p in parts)


def breakpoint_markers(ids: list[int], opener: int | None, messages: list[dict],
                       has_tools: bool) -> list[int]:
    """Token positions where messages carrying a prompt_cache_breakpoint end (the next message start).

    `opener` is the control token every message starts with (the chat format's `turn_opener`).
    Follows the common layout: a tools block first (merging a leading system/developer message),
    consecutive tool results in one user turn. When the rendered prompt does not have the message
    starts that layout predicts (another template), no marker is given. The last four breakpoints
    of the conversation are kept.
    """
    if opener is None or not any(m.get(BREAKPOINT_KEY) for m in messages):
        return []
    starts = [i for i, t in enumerate(ids) if t == opener]
    block = 1 if has_tools else 0
    where: list[int] = []
    for k, m in enumerate(messages):
        if has_tools and k == 0 and m["role"] in ("system", "developer"):
            where.append(0)
        elif m["role"] == "tool" and k > 0 and messages[k - 1]["role"] == "tool":
            where.append(where[-1])
        else:
            where.append(block)
            block += 1
    if block + 1 != len(starts):  # blocks + the generation opener
        return []
    marks = sorted({starts[where[k] + 1] for k, m in enumerate(messages) if m.get(BREAKPOINT_KEY)})
    return marks[-MAX_BREAKPOINTS:]


@dataclass
class _Turn:
    first_param: str
    reasoning: list[str]
    content: list[str]
    calls: list[tuple[dict, str]]  # (canonical call Item, param)
    stage: int = 0  # 0 reasoning, 1 content, 2 calls


def to_messages(context: list[tuple[dict, str]], instructions: str | None, lenient: bool) -> list[dict]:
    """Canonical Items (each with the param that names it) -> template messages.

    `instructions` becomes a leading developer turn. Raises invalid_assistant_history for an assistant
    run that would need rearranging, invalid_tool_history for unknown/duplicate/partial results.
    """
    messages: list[dict] = []
    if instructions:
        messages.append({"role": "developer", "content": instructions})
    turn: _Turn | None = None
    last_calls: list[tuple[dict, str]] = []  # calls of the assistant turn just closed
    results: list[tuple[dict, str]] = []

    def close_turn() -> None:
        nonlocal turn, last_calls
        if turn is None:
            return
        if all(isinstance(c, str) for c in turn.content):
            content: str | list = "".join(turn.content)
        else:  # media in an assistant message: one list of text and media parts
            content = [p for c in turn.content for p in ([{"type": "text", "text": c}] if isinstance(c, str) else c)]
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if turn.reasoning:
            msg["reasoning_content"] = "\n".join(turn.reasoning)
        if turn.calls:
            msg["tool_calls"] = [{"type": "function", "id": c["call_id"], "function": {
                "name": internal_name(c["name"], c.get("namespace")),
                "arguments": json.loads(c["arguments"]) if c["arguments"].strip() else {}}}
                for c, _ in turn.calls]
        messages.append(msg)
        last_calls = list(turn.calls)
        turn = None

    def close_results() -> None:
        nonlocal results, last_calls
        if not results:
            return
        by_id = {c["call_id"]: (c, p) for c, p in last_calls}
        got: dict[str, dict] = {}
        for r, p in results:
            cid = r["call_id"]
            if cid not in by_id:
                raise bad_request("invalid_tool_history", f"function_call_output {show(cid)} at '{p}.call_id' "
                                  "answers no function_call of the assistant turn right before it.", f"{p}.call_id")
            if cid in got:
                raise bad_request("invalid_tool_history", f"function_call_output {show(cid)} at '{p}.call_id' "
                                  "answers a call that already has a result.", f"{p}.call_id")
            call = by_id[cid][0]
            for key in ("name", "namespace"):
                if key in r and r[key] != call.get(key):
                    raise bad_request("invalid_tool_history", f"'{p}.{key}' {show(r[key])} does not match the "
                                      f"call's {key} {show(call.get(key))}.", f"{p}.{key}")
            got[cid] = r
        missing = [c["call_id"] for c, _ in last_calls if c["call_id"] not in got]
        if missing:
            p = results[0][1]
            raise bad_request("invalid_tool_history", f"the results starting at '{p}' answer {len(got)} of "
                              f"{len(last_calls)} calls; missing {show(missing)}. A partial result set cannot be "
                              "represented in the prompt.", p)
        for c, _ in last_calls:  # declaration order
            out = got[c["call_id"]]["output"]
            msg = {"role": "tool", "tool_call_id": c["call_id"], "content": _text(out, f"{by_id[c['call_id']][1]}")}
            if _has_breakpoint(out):
                msg[BREAKPOINT_KEY] = True
            messages.append(msg)
        results = []
        last_calls = []

    for item, param in context:
        kind = item["type"]
        role = item.get("role")
        if kind in ("reasoning", "function_call") or (kind == "message" and role == "assistant"):
            close_results()
            if turn is None:
                turn = _Turn(param, [], [], [])
                last_calls = []
            stage = {"reasoning": 0, "message": 1, "function_call": 2}[kind]
            if stage < turn.stage:
                late_after_calls = turn.stage == 2
                if not (lenient and late_after_calls):
                    what = "reasoning" if kind == "reasoning" else "assistant message content"
                    before = "function_call Items" if turn.stage == 2 else "assistant message content"
                    hint = " (--lenient-assistant-history accepts it)" if late_after_calls else ""
                    raise bad_request("invalid_assistant_history", f"{what} at '{param}' follows {before} in the "
                                      f"same assistant turn; the prompt can only represent reasoning -> content -> "
                                      f"calls{hint}.", param)
            else:
                turn.stage = stage
            if kind == "reasoning":
                turn.reasoning.append("".join(p["text"] for p in item["content"]))
            elif kind == "message":
                turn.content.append(_text(item["content"], f"{param}.content"))
            else:
                turn.calls.append((item, param))
        elif kind == "function_call_output":
            close_turn()
            results.append((item, param))
        else:  # user / system / developer message
            close_turn()
            close_results()
            last_calls = []
            msg = {"role": role, "content": _text(item["content"], f"{param}.content")}
            if _has_breakpoint(item["content"]):
                msg[BREAKPOINT_KEY] = True
            messages.append(msg)
    close_turn()
    close_results()
    return messages
