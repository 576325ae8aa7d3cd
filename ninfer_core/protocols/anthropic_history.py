"""Anthropic Messages history lowering: system, messages and content blocks -> chat-template messages.

Spec, "Anthropic Messages": top-level system text first; consecutive user or assistant messages
joined without separators; system messages anywhere as their own system turns (never between a
tool_use turn and its results); thinking history as reasoning, restored from a
`ninfer-reasoning.v1:` signature when its text is empty; tool_use history as tool calls; tool
results matched by id to the preceding tool_use turn and put in call order (a history that begins
with results is a truncated conversation and stays valid); a final assistant message is a
text-only prefill that needs thinking disabled. Also the small field checks both request modules use.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from typing import Any

from ninfer_core.engine.api import EngineError
from ninfer_core.protocols.responses_items import BREAKPOINT_KEY
from ninfer_core.server.errors import bad_request

# On a lowered message: a cache_control hint ends in it (the shared breakpoint placement reads it).
CACHE_KEY = BREAKPOINT_KEY
SIGNATURE_PREFIX = "ninfer-reasoning.v1:"
VISIBLE_SIGNATURE_PREFIX = "ninfer-visible.v1:"
# Blocks whose meaning needs an executor or a store this server does not have.
_UNSUPPORTED_BLOCKS = {
    "document": "document blocks need a document reader",
    "search_result": "search_result blocks need search-result citations",
    "container_upload": "container_upload blocks need a code-execution container",
    "file": "file blocks need the Files API",
    "server_tool_use": "server tools need Anthropic's tool executors",
    "web_search_tool_result": "server tools need Anthropic's tool executors",
    "web_fetch_tool_result": "server tools need Anthropic's tool executors",
    "code_execution_tool_result": "server tools need Anthropic's tool executors",
    "bash_code_execution_tool_result": "server tools need Anthropic's tool executors",
    "text_editor_code_execution_tool_result": "server tools need Anthropic's tool executors",
    "tool_search_tool_result": "server tools need Anthropic's tool executors",
    "mcp_tool_use": "MCP tools need an MCP connector",
    "mcp_tool_result": "MCP tools need an MCP connector",
}
TOOL_ERROR_MARK = "[tool error] "


# -- thinking signatures ------------------------------------------------------------------------

def omitted_signature(reasoning: str) -> str:
    """The signature of a Thinking block returned with display "omitted": the reasoning itself."""
    return SIGNATURE_PREFIX + base64.b64encode(reasoning.encode("utf-8")).decode("ascii")


def visible_signature(reasoning: str) -> str:
    """An opaque, non-semantic signature for visible Thinking (request lowering ignores it)."""
    return VISIBLE_SIGNATURE_PREFIX + hashlib.sha256(reasoning.encode("utf-8")).hexdigest()[:32]


def reasoning_from_signature(signature: str, param: str) -> str | None:
    """The reasoning a `ninfer-reasoning.v1:` signature carries; None for any other signature."""
    if not signature.startswith(SIGNATURE_PREFIX):
        return None
    payload = signature[len(SIGNATURE_PREFIX):]
    try:
        return base64.b64decode(payload, validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        raise bad_request("invalid_thinking_signature", "The thinking signature starts with "
                          f"'{SIGNATURE_PREFIX}' but its payload is not Base64 of UTF-8 text.",
                          param) from None


# -- small field checks ---------------------------------------------------------------------------

def missing(param: str) -> EngineError:
    return bad_request("missing_required_parameter", f"Missing required parameter: '{param}'.", param)


def wrong_type(param: str, what: str) -> EngineError:
    return bad_request("invalid_type", f"'{param}' must be {what}.", param)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def opt_bool(data: dict, key: str, param: str | None = None) -> bool | None:
    v = data.get(key)
    if v is not None and not isinstance(v, bool):
        raise wrong_type(param or key, "a boolean")
    return v


def number_in(data: dict, key: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = data.get(key)
    if v is None:
        return None
    if not is_number(v):
        raise wrong_type(key, "a number")
    # `not lo <= v <= hi` also refuses NaN, for which every comparison is false
    if not lo <= v <= hi or (lo_open and v == lo):
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise bad_request("invalid_value", f"'{key}' must be in {rng}, got {v}.", key)
    return float(v)


def check_cache_control(block: dict, param: str) -> None:
    """cache_control is a best-effort retention hint: accepted (an object or null), never enforced."""
    cc = block.get("cache_control")
    if cc is not None and not isinstance(cc, dict):
        raise wrong_type(f"{param}.cache_control", "an object")


def text_of(block: dict, param: str) -> str:
    text = block.get("text")
    if text is None:
        raise missing(f"{param}.text")
    if not isinstance(text, str):
        raise wrong_type(f"{param}.text", "a string")
    check_cache_control(block, param)
    return text


def _blocks(content: Any, param: str) -> list[dict]:
    """Message content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise wrong_type(param, "a string or a list of content blocks")
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise wrong_type(f"{param}.{j}", "an object")
        kind = block.get("type")
        if kind is None:
            raise missing(f"{param}.{j}.type")
        if not isinstance(kind, str):
            raise wrong_type(f"{param}.{j}.type", "a string")
    return content


def _unsupported_block(kind: str, param: str, role: str) -> EngineError:
    if kind == "image":
        return bad_request("vision_disabled", "This server was started without --vision; image input is "
                           "not accepted.", param)
    if kind in _UNSUPPORTED_BLOCKS:
        return bad_request("content_type_not_supported", f"'{kind}' is not supported: "
                           f"{_UNSUPPORTED_BLOCKS[kind]}, which this server does not have.", param)
    return bad_request("invalid_value", f"A {role} message cannot contain a '{kind}' block.", param)


def _system_only_text(param: str) -> EngineError:
    return bad_request("invalid_value", "System content accepts only text blocks.", param)


def system_text(content: Any, param: str) -> str:
    pieces = []
    for j, block in enumerate(_blocks(content, param)):
        if block["type"] != "text":
            raise _system_only_text(f"{param}.{j}.type")
        pieces.append(text_of(block, f"{param}.{j}"))
    return "".join(pieces)


# -- messages ---------------------------------------------------------------------------------------

def lower_conversation(data: dict, thinking: bool, explicit: bool,
                       vision: bool = False) -> tuple[list[dict], str | None]:
    """Anthropic system + messages -> chat-template messages, and the assistant prefill text.
    With `vision`, image blocks (user turns, tool results) become media parts of a content list."""
    out: list[dict] = []
    system = data.get("system")
    if system is not None:
        text = system_text(system, "system")
        if text:
            out.append(_mark({"role": "system", "content": text}, system if isinstance(system, list) else []))
    raw = data.get("messages")
    if raw is None:
        raise missing("messages")
    if not isinstance(raw, list):
        raise wrong_type("messages", "a list")
    if not raw:
        raise bad_request("invalid_value", "'messages' must contain at least one message.", "messages")

    turns = _join_turns(raw)
    pending: list[str] | None = None  # tool_use ids of the assistant turn awaiting results
    pending_at = ""
    for n, (role, blocks, i) in enumerate(turns):
        p = f"messages.{i}"
        last = n == len(turns) - 1
        if role == "system":
            if pending:
                raise bad_request("invalid_tool_history", "A system message cannot sit between an assistant "
                                  f"tool_use turn ({pending_at}) and the user turn with its tool_result.", p)
            texts = []
            for block, q in blocks:
                if block["type"] != "text":
                    raise _system_only_text(f"{q}.type")
                texts.append(text_of(block, q))
            out.append(_mark({"role": "system", "content": "".join(texts)}, [b for b, _ in blocks]))
            pending = None
        elif role == "user":
            out.extend(_user_turn(blocks, pending, pending_at, first=n == 0 or all(
                r == "system" for r, _, _ in turns[:n]), vision=vision))
            pending = None
        else:
            if pending:
                raise bad_request("invalid_tool_history", f"The assistant tool_use turn {pending_at} must be "
                                  "followed by a user turn carrying its tool_result blocks.", p)
            if last:
                return out, _prefill(blocks, thinking, explicit)
            msg, ids = _assistant_turn(blocks)
            out.append(_mark(msg, [b for b, _ in blocks]))
            pending, pending_at = (ids or None), p
    return out, None


def _join_turns(raw: list) -> list[tuple[str, list[tuple[dict, str]], int]]:
    """[(role, [(block, param)], index of the turn's first message)], same-role neighbours joined."""
    turns: list[tuple[str, list[tuple[dict, str]], int]] = []
    for i, m in enumerate(raw):
        p = f"messages.{i}"
        if not isinstance(m, dict):
            raise wrong_type(p, "an object")
        role = m.get("role")
        if role is None:
            raise missing(f"{p}.role")
        if role not in ("user", "assistant", "system"):
            raise bad_request("invalid_value", "'role' must be user, assistant or system.", f"{p}.role")
        if "content" not in m:
            raise missing(f"{p}.content")
        blocks = [(b, f"{p}.content.{j}") for j, b in enumerate(_blocks(m["content"], f"{p}.content"))]
        if isinstance(m["content"], str):
            blocks = [(blocks[0][0], f"{p}.content")]
        if turns and role != "system" and turns[-1][0] == role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((role, blocks, i))
    return turns


def _with_media(parts: list) -> str | list:
    """Joined text, or (a media part among them) the list of text and media parts in order."""
    if all(isinstance(x, str) for x in parts):
        return "".join(parts)
    return [x if isinstance(x, dict) else {"type": "text", "text": x} for x in parts]


def _image(block: dict, p: str, vision: bool, role: str) -> dict:
    if not vision:
        raise _unsupported_block("image", f"{p}.type", role)
    from ninfer_core.media.parts import anthropic_image

    check_cache_control(block, p)
    return anthropic_image(block, p)


def _tool_result_text(block: dict, p: str, vision: bool = False) -> str | list:
    content = block.get("content")
    is_error = opt_bool(block, "is_error", f"{p}.is_error")
    pieces: list = [TOOL_ERROR_MARK] if is_error else []
    if content is None:
        pass
    elif isinstance(content, str):
        pieces.append(content)
    elif isinstance(content, list):
        for k, part in enumerate(content):
            q = f"{p}.content.{k}"
            if not isinstance(part, dict):
                raise wrong_type(q, "an object")
            kind = part.get("type")
            if kind == "text":
                pieces.append(text_of(part, q))
            elif kind == "image":
                pieces.append(_image(part, q, vision, "tool_result"))
            else:
                raise _unsupported_block(str(kind), f"{q}.type", "tool_result")
    else:
        raise wrong_type(f"{p}.content", "a string or a list of content blocks")
    check_cache_control(block, p)
    return _with_media(pieces)


def _user_turn(blocks: list[tuple[dict, str]], pending: list[str] | None, pending_at: str,
               first: bool, vision: bool = False) -> list[dict]:
    results: dict[str, str | list] = {}
    order: list[str] = []
    texts: list = []  # text, and media parts with vision
    hinted: dict[str, dict] = {}  # tool id -> its result block, for cache_control hints
    for block, p in blocks:
        kind = block["type"]
        if kind == "tool_result":
            if texts:
                raise bad_request("invalid_tool_history", "tool_result blocks must lead the user turn, "
                                  "before any other content.", p)
            tid = block.get("tool_use_id")
            if tid is None:
                raise missing(f"{p}.tool_use_id")
            if not isinstance(tid, str):
                raise wrong_type(f"{p}.tool_use_id", "a string")
            if tid in results:
                raise bad_request("invalid_tool_history", f"Two tool_result blocks answer tool_use '{tid}'.",
                                  f"{p}.tool_use_id")
            if pending is not None and tid not in pending:
                raise bad_request("invalid_tool_history", f"tool_result answers '{tid}', which the preceding "
                                  f"assistant turn ({pending_at}) did not call.", f"{p}.tool_use_id")
            if pending is None and not first:
                raise bad_request("invalid_tool_history", "tool_result blocks must answer the tool_use "
                                  "blocks of the assistant turn right before them.", p)
            results[tid] = _tool_result_text(block, p, vision)
            hinted[tid] = block
            order.append(tid)
        elif kind == "text":
            texts.append(text_of(block, p))
        elif kind == "image":
            texts.append(_image(block, p, vision, "user"))
        else:
            raise _unsupported_block(kind, f"{p}.type", "user")
    if pending is not None:
        absent = [t for t in pending if t not in results]
        if absent:
            raise bad_request("invalid_tool_history", f"The user turn after {pending_at} must carry a "
                              f"leading tool_result for every tool_use; missing: {', '.join(absent)}.",
                              blocks[0][1] if blocks else pending_at)
        order = list(pending)  # results are normalised to call order
    out = [_mark({"role": "tool", "tool_call_id": tid, "content": results[tid]}, [hinted[tid]])
           for tid in order]
    if texts or not order:
        out.append(_mark({"role": "user", "content": _with_media(texts)},
                         [b for b, _ in blocks if b["type"] != "tool_result"]))
    return out


def _mark(message: dict, blocks: list) -> dict:
    """Flag `message` when one of the blocks it was lowered from carries a cache_control hint."""
    if any(isinstance(b, dict) and b.get("cache_control") for b in blocks):
        message[CACHE_KEY] = True
    return message


def _thinking_text(block: dict, p: str) -> str:
    text = block.get("thinking")
    if text is None:
        raise missing(f"{p}.thinking")
    if not isinstance(text, str):
        raise wrong_type(f"{p}.thinking", "a string")
    signature = block.get("signature")
    if signature is not None and not isinstance(signature, str):
        raise wrong_type(f"{p}.signature", "a string")
    restored = reasoning_from_signature(signature, f"{p}.signature") if signature else None
    return text if text or restored is None else restored


def _assistant_turn(blocks: list[tuple[dict, str]]) -> tuple[dict, list[str]]:
    reasoning: list[str] = []
    texts: list[str] = []
    calls: list[dict] = []
    ids: list[str] = []
    for block, p in blocks:
        kind = block["type"]
        if kind == "text":
            texts.append(text_of(block, p))
        elif kind == "thinking":
            reasoning.append(_thinking_text(block, p))
        elif kind == "redacted_thinking":
            continue  # opaque to this server: nothing to render
        elif kind == "tool_use":
            tid, name, args = block.get("id"), block.get("name"), block.get("input", {})
            for key, value in (("id", tid), ("name", name)):
                if value is None:
                    raise missing(f"{p}.{key}")
                if not isinstance(value, str) or not value:
                    raise wrong_type(f"{p}.{key}", "a non-empty string")
            if not isinstance(args, dict):
                raise wrong_type(f"{p}.input", "an object")
            if tid in ids:
                raise bad_request("invalid_tool_history", f"tool_use id '{tid}' appears twice in one turn.",
                                  f"{p}.id")
            ids.append(tid)
            calls.append({"id": tid, "type": "function", "function": {"name": name, "arguments": args}})
        else:
            raise _unsupported_block(kind, f"{p}.type", "assistant")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg, ids


def _prefill(blocks: list[tuple[dict, str]], thinking: bool, explicit: bool) -> str:
    """The final assistant message: text continued in place (thinking must be disabled explicitly)."""
    texts = []
    for block, p in blocks:
        kind = block["type"]
        if kind == "text":
            texts.append(text_of(block, p))
        elif kind in ("thinking", "redacted_thinking", "tool_use", "image"):
            raise bad_request("assistant_prefill_not_supported", f"An assistant prefill (the final assistant "
                              f"message) must be text only; it contains a '{kind}' block.", f"{p}.type")
        else:
            raise _unsupported_block(kind, f"{p}.type", "assistant")
    if thinking or not explicit:  # the server default counts as enabled, even under --no-thinking
        why = "enables thinking" if explicit else "leaves thinking to the server default"
        raise bad_request("assistant_prefill_not_supported", "An assistant prefill (a final assistant "
                          f"message) needs thinking disabled, and this request {why}: send thinking: "
                          "{\"type\": \"disabled\"}.", "messages")
    return "".join(texts)
