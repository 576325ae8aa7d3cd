"""Gemma 4's chat format: reasoning in a thought channel, tool calls in Gemma's own object syntax.

Reasoning: `<|channel>thought\\n ... <channel|>`, the answer follows the close directly.
Tool calls: `<|tool_call>call:NAME{key:value,...}<tool_call|>`, one after another; values are
`<|"|>`-delimited strings, numbers, true/false/null, `[...]` lists and `{...}` objects whose keys are
bare (or `<|"|>`-delimited). `GemmaToolSyntax` implements the output decoder's ToolSyntax contract
(`ninfer_core.tokenizer.chat_format`): a finished answer whose first call region runs to the end
is the structured turn; otherwise the complete calls are kept and a call that cannot be read
becomes a call to `malformed_tool_call` saying why; text after the calls is dropped.
"""

from __future__ import annotations

import importlib.resources
import json
import re

from ninfer_core.tokenizer.chat_format import ChatFormat, JudgePrompt
from ninfer_core.tokenizer.toolcalls import MALFORMED_TOOL, MAX_MARKERS, ParsedCall, ParseResult

CALL_OPEN, CALL_CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_HEAD = CALL_OPEN + "call:"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
_WS = " \t\r\n"
_SCALAR_END = ",}]"

GEMMA4_TEMPLATE: str = importlib.resources.files("ninfer_gemma4").joinpath("templates/gemma4.jinja").read_text(
    encoding="utf-8")


class _Fail(Exception):
    def __init__(self, reason: str, message: str, name: str | None = None):
        super().__init__(message)
        self.reason, self.message, self.name = reason, message, name


def _ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def parse_value(text: str, i: int):
    """One Gemma value at `i` -> (python value, end index); _Fail when it is not one."""
    i = _ws(text, i)
    if text.startswith(QUOTE, i):
        end = text.find(QUOTE, i + len(QUOTE))
        if end < 0:
            raise _Fail("malformed_structure", "a string value is not closed")
        return text[i + len(QUOTE): end], end + len(QUOTE)
    if text.startswith("{", i):
        obj, i = {}, _ws(text, i + 1)
        if text.startswith("}", i):
            return obj, i + 1
        while True:
            i = _ws(text, i)
            if text.startswith(QUOTE, i):
                key, i = parse_value(text, i)
            else:
                colon = text.find(":", i)
                if colon < 0:
                    raise _Fail("malformed_structure", "an object member has no ':'")
                key = text[i:colon].strip()
                i = colon
                if not key or any(c in key for c in "{}[],"):
                    raise _Fail("malformed_structure", f"bad object key {key[:40]!r}")
            i = _ws(text, i)
            if not text.startswith(":", i):
                raise _Fail("malformed_structure", "an object member has no ':'")
            obj[key], i = parse_value(text, i + 1)
            i = _ws(text, i)
            if text.startswith(",", i):
                i += 1
                continue
            if text.startswith("}", i):
                return obj, i + 1
            raise _Fail("malformed_structure", "an object is not closed")
    if text.startswith("[", i):
        arr, i = [], _ws(text, i + 1)
        if text.startswith("]", i):
            return arr, i + 1
        while True:
            v, i = parse_value(text, i)
            arr.append(v)
            i = _ws(text, i)
            if text.startswith(",", i):
                i += 1
                continue
            if text.startswith("]", i):
                return arr, i + 1
            raise _Fail("malformed_structure", "a list is not closed")
    j = i
    while j < len(text) and text[j] not in _SCALAR_END and not text.startswith(CALL_CLOSE, j):
        j += 1
    raw = text[i:j].strip()
    if not raw:
        raise _Fail("malformed_structure", "a value is missing")
    if raw in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[raw], j
    try:
        num = json.loads(raw)
        if isinstance(num, (int, float)):
            return num, j
    except ValueError:
        pass
    return raw, j  # a bare word: kept as a string for the consumer to validate


class GemmaToolSyntax:
    markers = (CALL_OPEN,)
    forced_closers = ("", "}" + CALL_CLOSE, CALL_CLOSE, QUOTE + "}" + CALL_CLOSE)

    def find_markers(self, text: str, start: int = 0, limit: int | None = None) -> list[int]:
        out, i = [], start
        limit = MAX_MARKERS if limit is None else limit
        while len(out) < limit:
            j = text.find(CALL_OPEN, i)
            if j < 0:
                break
            out.append(j)
            i = j + 1
        return out

    def marker_prefix_len(self, text: str) -> int:
        for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
            if CALL_OPEN.startswith(text[-k:]):
                return k
        return 0

    def opens_function(self, text: str, pos: int) -> bool | None:
        rest = text[pos: pos + len(_HEAD) + 130]
        if len(rest) < len(_HEAD):
            return None if _HEAD.startswith(rest) else False
        if not rest.startswith(_HEAD):
            return False
        m = _NAME.match(rest, len(_HEAD))
        if m is None:
            return False
        if m.end() == len(rest):
            return None
        return rest[m.end()] == "{"

    def _call(self, text: str, i: int, schemas):
        """One call at `i` (at its marker) -> (ParsedCall, end)."""
        if not text.startswith(_HEAD, i):
            raise _Fail("malformed_structure", "a tool call does not start with call:NAME")
        m = _NAME.match(text, i + len(_HEAD))
        if m is None:
            raise _Fail("invalid_tool_name", "the tool call has no valid function name")
        name = m.group(0)
        if schemas is not None and name not in schemas:
            raise _Fail("undeclared_tool", f"no tool named {name!r} was declared", name)
        if not text.startswith("{", m.end()):
            raise _Fail("malformed_structure", f"the call to {name} has no argument object", name)
        try:
            args, j = parse_value(text, m.end())
        except _Fail as f:
            raise _Fail(f.reason, f"the arguments of {name}: {f.message}", name) from None
        j = _ws(text, j)
        if not text.startswith(CALL_CLOSE, j):
            raise _Fail("malformed_structure", f"the call to {name} is not closed by {CALL_CLOSE}", name)
        return ParsedCall(name, json.dumps(args, ensure_ascii=False)), j + len(CALL_CLOSE)

    def parse(self, text: str, schemas, *, max_markers: int | None = None,
              undeclared_as_text: bool = False) -> ParseResult:
        markers = self.find_markers(text, 0, max_markers)
        res = ParseResult(content=text, marker_seen=bool(markers))
        if not markers:
            return res
        pos = markers[0]
        calls, i, failure = [], pos, None
        while True:
            i = _ws(text, i)
            if i >= len(text) or not text.startswith(CALL_OPEN, i):
                break
            try:
                call, i = self._call(text, i, schemas)
            except _Fail as f:
                failure = f
                break
            calls.append(call)
        trailing = failure is None and _ws(text, i) < len(text)
        if failure is not None and failure.reason == "undeclared_tool" and undeclared_as_text:
            res.fallback = "undeclared_tool"
            return res
        if failure is not None and not self.opens_function(text, i) and not calls:
            res.fallback = "malformed_structure"
            return res
        res.content = text[:pos].rstrip(_WS)
        if failure is not None:
            args = {"error": failure.message, "hint": "Write the call again in exactly this form: "
                    f"{_HEAD}NAME{{key:{QUOTE}value{QUOTE}}}{CALL_CLOSE}"}
            if failure.name:
                args["tool_name"] = failure.name
            calls.append(ParsedCall(MALFORMED_TOOL, json.dumps(args, ensure_ascii=False)))
            res.recovered = res.malformed = True
            res.fallback = failure.reason
        elif trailing:
            res.recovered = res.trailing_dropped = True
            res.fallback = "trailing_content"
        res.calls = calls
        return res

    def forced_opener(self, name: str) -> str:
        return f"{_HEAD}{name}{{"

    def forced_ids(self, tokenizer, name: str) -> list[int]:
        return tokenizer.encode(CALL_OPEN, allow_special=True) + tokenizer.encode(f"call:{name}{{", allow_special=False)


# Google's recommended sampling for Gemma 4 (the published generation_config.json), both modes
SAMPLING_PRESET = {"temperature": 1.0, "top_p": 0.95, "top_k": 64, "min_p": 0.0,
                   "presence_penalty": 0.0, "frequency_penalty": 0.0}

GEMMA4_CHAT_FORMAT = ChatFormat(
    "gemma4", reasoning_open="<|channel>thought", reasoning_close="<channel|>", close_needs_space=False,
    tools=GemmaToolSyntax(), turn_opener="<|turn>", assistant_role="model",
    # tool results are written inside the model turn (`<|tool_response>`), never as a user turn
    tool_result_open=None,
    judge=JudgePrompt(head="<bos><|turn>system\n{system}<turn|>\n<|turn>user\n",
                      tail="<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"),
    sampling={"thinking": SAMPLING_PRESET, "non_thinking": SAMPLING_PRESET},
)
