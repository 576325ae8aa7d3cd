"""Anthropic context editing (`context_management.edits`): clear old thinking and tool uses.

Anthropic applies these edits on the server before the prompt reaches the model, and the client
keeps its full history; NInfer does the same on the wire messages before they are lowered to the
chat template, so the rendered prompt (and its prefix-cache identity) is the edited one:

- `clear_thinking_20251015`: `keep` "all", or {"type": "thinking_turns", "value": N} (default
  1): the thinking blocks of every assistant message but the last N that carry thinking are
  removed. It must be the first edit, as Anthropic requires.
- `clear_tool_uses_20250919`: once `trigger` is exceeded ({"type": "input_tokens"} over the
  rendered prompt, default 100000, or {"type": "tool_uses"} over the conversation's tool uses),
  the results of all but the most recent `keep` tool uses (default 3; `exclude_tools` are never
  cleared) are replaced with a placeholder, oldest first; `clear_tool_inputs` (true, or a list of
  tool names) also empties those calls' inputs. `clear_at_least` {"type": "input_tokens"} leaves
  the prompt unedited when the clearing would free fewer tokens.

An edit that clears something is reported in the response's `context_management.applied_edits`
with what it cleared, counted in tokens of the rendered prompt. Any other edit type, or a value
this server cannot honour, is a 400 that names it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

from ninfer_core.protocols.anthropic_history import is_int, missing, wrong_type
from ninfer_core.server.errors import bad_request

CLEAR_THINKING = "clear_thinking_20251015"
CLEAR_TOOL_USES = "clear_tool_uses_20250919"
TOOL_RESULT_PLACEHOLDER = "[This tool result was cleared from the context to save space.]"
DEFAULT_TRIGGER_TOKENS = 100_000
DEFAULT_KEEP_TOOL_USES = 3


@dataclass
class ThinkingEdit:
    keep_turns: int | None  # None: keep every thinking turn


@dataclass
class ToolUsesEdit:
    trigger_kind: str = "input_tokens"  # or "tool_uses"
    trigger_value: int = DEFAULT_TRIGGER_TOKENS
    keep: int = DEFAULT_KEEP_TOOL_USES
    clear_at_least: int = 0
    exclude: frozenset[str] = frozenset()
    clear_inputs: bool | frozenset[str] = False  # True: every cleared call; a set: calls of these tools


@dataclass
class ContextEdits:
    edits: list[Any] = field(default_factory=list)


def _threshold(value: Any, param: str, kinds: tuple[str, ...]) -> tuple[str, int]:
    if not isinstance(value, dict):
        raise wrong_type(param, "an object")
    for key in value:
        if key not in ("type", "value"):
            raise bad_request("unknown_parameter", f"Unknown parameter: '{param}.{key}'.", f"{param}.{key}")
    kind = value.get("type")
    if kind is None:
        raise missing(f"{param}.type")
    if kind not in kinds:
        raise bad_request("invalid_value", f"'{param}.type' must be {' or '.join(kinds)}, got {kind!r}.",
                          f"{param}.type")
    n = value.get("value")
    if n is None:
        raise missing(f"{param}.value")
    if not is_int(n) or n < 0:
        raise bad_request("invalid_value", f"'{param}.value' must be a non-negative integer.", f"{param}.value")
    return kind, n


def _names(value: Any, param: str) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise wrong_type(param, "a list of tool names")
    return frozenset(value)


def _only_keys(edit: dict, param: str, keys: tuple[str, ...]) -> None:
    for key in edit:
        if key not in keys:
            raise bad_request("unknown_parameter", f"Unknown parameter: '{param}.{key}'.", f"{param}.{key}")


def _thinking_edit(edit: dict, param: str) -> ThinkingEdit:
    _only_keys(edit, param, ("type", "keep"))
    keep = edit.get("keep")
    if keep is None:
        return ThinkingEdit(1)
    if keep == "all":
        return ThinkingEdit(None)
    if isinstance(keep, str):
        raise bad_request("invalid_value", f"'{param}.keep' must be \"all\" or a thinking_turns object.",
                          f"{param}.keep")
    _, n = _threshold(keep, f"{param}.keep", ("thinking_turns",))
    return ThinkingEdit(n)


def _tool_uses_edit(edit: dict, param: str) -> ToolUsesEdit:
    _only_keys(edit, param, ("type", "trigger", "keep", "clear_at_least", "exclude_tools", "clear_tool_inputs"))
    out = ToolUsesEdit()
    if edit.get("trigger") is not None:
        out.trigger_kind, out.trigger_value = _threshold(edit["trigger"], f"{param}.trigger",
                                                         ("input_tokens", "tool_uses"))
    if edit.get("keep") is not None:
        _, out.keep = _threshold(edit["keep"], f"{param}.keep", ("tool_uses",))
    if edit.get("clear_at_least") is not None:
        _, out.clear_at_least = _threshold(edit["clear_at_least"], f"{param}.clear_at_least", ("input_tokens",))
    if edit.get("exclude_tools") is not None:
        out.exclude = _names(edit["exclude_tools"], f"{param}.exclude_tools")
    inputs = edit.get("clear_tool_inputs")
    if isinstance(inputs, bool):
        out.clear_inputs = inputs
    elif inputs is not None:
        out.clear_inputs = _names(inputs, f"{param}.clear_tool_inputs")
    return out


def parse_context_management(data: dict) -> ContextEdits | None:
    """The request's `context_management`, validated; None when it is absent or null."""
    cm = data.get("context_management")
    if cm is None:
        return None
    if not isinstance(cm, dict):
        raise wrong_type("context_management", "an object")
    _only_keys(cm, "context_management", ("edits",))
    raw = cm.get("edits")
    if raw is None:
        return ContextEdits()
    if not isinstance(raw, list):
        raise wrong_type("context_management.edits", "a list")
    out = ContextEdits()
    for i, edit in enumerate(raw):
        param = f"context_management.edits.{i}"
        if not isinstance(edit, dict):
            raise wrong_type(param, "an object")
        kind = edit.get("type")
        if kind is None:
            raise missing(f"{param}.type")
        if kind == CLEAR_THINKING:
            if i != 0:
                raise bad_request("invalid_value", f"'{CLEAR_THINKING}' must be the first context edit; it is "
                                  f"edit {i}.", f"{param}.type")
            out.edits.append(_thinking_edit(edit, param))
        elif kind == CLEAR_TOOL_USES:
            out.edits.append(_tool_uses_edit(edit, param))
        else:
            raise bad_request("context_edit_not_supported", f"The context edit {str(kind)[:64]!r} is not supported: "
                              f"this server applies {CLEAR_THINKING} and {CLEAR_TOOL_USES}.", f"{param}.type")
    return out


# -- applying the edits to the wire messages -----------------------------------------------------------

def _blocks(message: dict) -> list | None:
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, list) else None


def _is_thinking(block: Any) -> bool:
    return isinstance(block, dict) and block.get("type") in ("thinking", "redacted_thinking")


def clear_thinking(messages: list, edit: ThinkingEdit) -> tuple[list, int]:
    """(messages, assistant turns whose thinking was removed); the final message (a prefill) is kept."""
    if edit.keep_turns is None:
        return messages, 0
    turns = [i for i, m in enumerate(messages[:-1]) if m.get("role") == "assistant"
             and any(_is_thinking(b) for b in _blocks(m) or [])]
    cleared = turns[: max(0, len(turns) - edit.keep_turns)]
    if not cleared:
        return messages, 0
    out = list(messages)
    for i in cleared:
        m = dict(out[i])
        m["content"] = [b for b in m["content"] if not _is_thinking(b)]
        out[i] = m
    return out, len(cleared)


def _tool_uses(messages: list) -> list[tuple[int, int, dict]]:
    """(message index, block index, block) of every tool_use, in conversation order."""
    return [(i, j, b) for i, m in enumerate(messages) if m.get("role") == "assistant"
            for j, b in enumerate(_blocks(m) or []) if isinstance(b, dict) and b.get("type") == "tool_use"]


def clear_tool_uses(messages: list, edit: ToolUsesEdit) -> tuple[list, int]:
    """(messages with the older tool results replaced, tool uses cleared); untriggered callers skip it."""
    uses = [u for u in _tool_uses(messages) if u[2].get("name") not in edit.exclude]
    victims = uses[: max(0, len(uses) - edit.keep)]
    if not victims:
        return messages, 0
    out = copy.deepcopy(messages)
    ids = {}
    for i, j, block in victims:
        ids[block.get("id")] = block.get("name")
        inputs = edit.clear_inputs
        if inputs is True or (isinstance(inputs, frozenset) and block.get("name") in inputs):
            out[i]["content"][j]["input"] = {}
    for m in out:
        if m.get("role") != "user":
            continue
        for b in _blocks(m) or []:
            if isinstance(b, dict) and b.get("type") == "tool_result" and b.get("tool_use_id") in ids:
                b["content"] = TOOL_RESULT_PLACEHOLDER
                b.pop("is_error", None)
    return out, len(victims)


def apply_edits(edits: ContextEdits, messages: list,
                count: Callable[[list], int]) -> tuple[list, list[dict], int | None]:
    """Run the edits in order over the wire `messages`.

    `count(messages)` renders a candidate conversation and returns its prompt tokens (host work,
    called only where an edit needs a count). Returns (edited messages, applied_edits for the
    response, the unedited prompt's tokens when they were counted).
    """
    original: int | None = None
    tokens: int | None = None
    applied: list[dict] = []

    def current() -> int:
        nonlocal original, tokens
        if tokens is None:
            tokens = original = count(messages)
        return tokens

    for edit in edits.edits:
        if isinstance(edit, ThinkingEdit):
            edited, n = clear_thinking(messages, edit)
            if not n:
                continue
        else:
            if edit.trigger_kind == "input_tokens":
                triggered = current() > edit.trigger_value
            else:
                triggered = len(_tool_uses(messages)) > edit.trigger_value
            if not triggered:
                continue
            edited, n = clear_tool_uses(messages, edit)
            if not n:
                continue
        before, after = current(), count(edited)
        if isinstance(edit, ToolUsesEdit) and before - after < edit.clear_at_least:
            continue  # too little to be worth the invalidated prefix (Anthropic's clear_at_least)
        key = "cleared_thinking_turns" if isinstance(edit, ThinkingEdit) else "cleared_tool_uses"
        applied.append({"type": CLEAR_THINKING if isinstance(edit, ThinkingEdit) else CLEAR_TOOL_USES,
                        key: n, "cleared_input_tokens": max(0, before - after)})
        messages, tokens = edited, after
    return messages, applied, original
