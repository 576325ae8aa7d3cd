"""Reading tool calls out of generated answer text (the XML function form and the agent variants).

Forms (spec, "OpenAI Chat Completions"; every opening tag is closed by its own kind):
- XML:    <tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>
- agents: <function name="NAME"> ... </function> or <invoke name="NAME"> ... </invoke>, with
          <parameter name="ARG">value</parameter> or <param name="ARG">value</param>,
          bare or inside a <function_calls> ... </function_calls> (or <tool_call>) container.

`parse_tool_calls(text, schemas)` splits a finished answer into its content prefix and the calls:
1. when the first marker's region opens with a complete call, that region is the structured turn
   (recovered as in 2 if it does not parse to the end); otherwise markers (the first 16
   occurrences of an opener) are tried in order, the first region that parses completely and
   consumes the rest of the answer is the structured turn, and quoted markup before it stays
   content;
2. otherwise the first region that opens a function is recovered: complete calls are kept, a call
   that cannot be read becomes a call to `malformed_tool_call` whose arguments say what went
   wrong, and text after it is dropped;
3. otherwise everything is content.

Values: one format newline after the opening and before the closing parameter tag is stripped. A
`</parameter>` inside a value ends it only when followed (after optional whitespace) by "<" or
the end of the text; balanced nested parameter tags stay value text. A declared JSON-schema type
that admits strings keeps the text; any other declared type is JSON-decoded without coercion
(text that is not JSON stays a string for the consumer to validate); an empty value of a non-string
type is omitted; an undeclared parameter stays a string. Duplicates keep the last value. The
arguments are JSON text with the members in the order the model wrote them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

MAX_MARKERS = 16
MALFORMED_TOOL = "malformed_tool_call"

# Openers that start a tool-call region, in the text the model writes.
MARKERS = ("<tool_call>", "<function_calls>", "<function=", "<function name=", "<invoke name=")
_LONGEST_MARKER = max(len(m) for m in MARKERS)
CONTAINERS = {"<tool_call>": "</tool_call>", "<function_calls>": "</function_calls>"}
_NAME_OK = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,127}\Z")
_WS = " \t\r\n"

# A function opener: (regex at the position, closing tag). Name in group 1 or 2.
_FUNC_OPENERS = (
    (re.compile(r'<function=([^>\n]*)>'), "</function>"),
    (re.compile(r'<function\s+name\s*=\s*(?:"([^"\n]*)"|\'([^\'\n]*)\')\s*>'), "</function>"),
    (re.compile(r'<invoke\s+name\s*=\s*(?:"([^"\n]*)"|\'([^\'\n]*)\')\s*>'), "</invoke>"),
)
_PARAM_OPENERS = (
    (re.compile(r'<parameter=([^>\n]*)>'), "</parameter>"),
    (re.compile(r'<parameter\s+name\s*=\s*(?:"([^"\n]*)"|\'([^\'\n]*)\')\s*>'), "</parameter>"),
    (re.compile(r'<param\s+name\s*=\s*(?:"([^"\n]*)"|\'([^\'\n]*)\')\s*>'), "</param>"),
)
_NESTED_OPEN = {"</parameter>": re.compile(r'<parameter(?:=|\s+name\s*=)'),
                "</param>": re.compile(r'<param\s+name\s*=')}


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON object text, members in generated order


@dataclass
class ParseResult:
    content: str  # the answer text before the structured region (all of it when no calls)
    calls: list[ParsedCall] = field(default_factory=list)
    marker_seen: bool = False
    recovered: bool = False  # the strict pass failed and the recovery pass produced the calls
    malformed: bool = False  # a call became a call to malformed_tool_call
    trailing_dropped: bool = False
    duplicate_parameters: int = 0
    fallback: str = "none"  # none | malformed_structure | invalid_tool_name | undeclared_tool | trailing_content


class _Fail(Exception):
    def __init__(self, reason: str, message: str, name: str | None = None):
        super().__init__(message)
        self.reason, self.message, self.name = reason, message, name


def find_markers(text: str, start: int = 0, limit: int = MAX_MARKERS) -> list[int]:
    """Positions of the first `limit` tool-call markers in `text` at or after `start`."""
    out: list[int] = []
    i = start
    while len(out) < limit:
        j = text.find("<", i)
        if j < 0:
            break
        if text.startswith(MARKERS, j):
            out.append(j)
        i = j + 1
    return out


def marker_prefix_len(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some marker (0 if none)."""
    for k in range(min(_LONGEST_MARKER - 1, len(text)), 0, -1):
        tail = text[-k:]
        if tail[0] == "<" and any(m.startswith(tail) and m != tail for m in MARKERS):
            return k
    return 0


def schema_map(tools: list[dict] | None) -> dict[str, dict]:
    """{tool name: its parameters JSON schema} from OpenAI ({"type":"function","function":{...}}),
    flat ({"name", "parameters"}) or Anthropic ({"name", "input_schema"}) tool definitions."""
    out: dict[str, dict] = {}
    for t in tools or []:
        if not isinstance(t, dict):
            continue
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        name = fn.get("name")
        if not isinstance(name, str):
            continue
        schema = fn.get("parameters", fn.get("input_schema"))
        out[name] = schema if isinstance(schema, dict) else {}
    return out


def opens_function(text: str, pos: int) -> bool | None:
    """Whether the region at marker `pos` opens a function: True, False, or None (not yet known)."""
    i = pos
    for opener, _closer in CONTAINERS.items():
        if text.startswith(opener, i):
            i += len(opener)
            while i < len(text) and text[i] in _WS:
                i += 1
            break
    rest = text[i:i + 256]
    if not rest:
        return None
    if any(rx.match(text, i) for rx, _ in _FUNC_OPENERS):
        return True
    if ">" in rest or len(rest) >= 256:
        return False
    for head in ("<function", "<invoke"):
        if head.startswith(rest) or rest.startswith(head):
            return None
    return False


def parse_tool_calls(text: str, schemas: dict[str, dict] | None = None, *,
                     max_markers: int = MAX_MARKERS, undeclared_as_text: bool = False) -> ParseResult:
    """Split a finished answer into content and tool calls (see the module docstring).

    With `undeclared_as_text` a region that calls a function outside `schemas` stays ordinary
    text (Responses: only the effective tool set becomes structured calls) instead of becoming a
    call to malformed_tool_call.
    """
    markers = find_markers(text, 0, max_markers)
    res = ParseResult(content=text, marker_seen=bool(markers))
    first_complete = bool(markers) and _opens_with_complete_call(text, markers[0], schemas)
    for pos in markers[:1] if first_complete else markers:
        try:
            calls, dups = _parse_region(text, pos, schemas, strict=True)
        except _Fail:
            continue
        res.content = _strip_before(text[:pos])
        res.calls = calls
        res.duplicate_parameters = dups
        return res
    for pos in markers[:1] if first_complete else markers:
        if opens_function(text, pos):
            calls, dups, failure, trailing = _recover(text, pos, schemas)
            if undeclared_as_text and failure is not None and failure.reason == "undeclared_tool":
                res.fallback = "undeclared_tool"
                return res
            res.content = _strip_before(text[:pos])
            res.calls = calls
            res.duplicate_parameters = dups
            res.recovered = True
            res.malformed = failure is not None
            res.trailing_dropped = trailing
            res.fallback = failure.reason if failure is not None else "trailing_content"
            return res
    if markers:
        res.fallback = "malformed_structure"
    return res


def _opens_with_complete_call(text: str, pos: int, schemas) -> bool:
    i = pos
    for opener in CONTAINERS:
        if text.startswith(opener, i):
            i = _skip_ws(text, i + len(opener))
            break
    try:
        _parse_function(text, i, schemas)
    except _Fail:
        return False
    return True


def _strip_before(content: str) -> str:
    return content.rstrip(_WS)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _parse_region(text: str, pos: int, schemas, strict: bool):
    """Calls from `pos` to the end of the text; raises _Fail where the structure breaks."""
    calls: list[ParsedCall] = []
    dups = 0
    i = pos
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            if not calls:
                raise _Fail("malformed_structure", "the tool call region is empty")
            return calls, dups
        closer = None
        for opener, close in CONTAINERS.items():
            if text.startswith(opener, i):
                closer = close
                i += len(opener)
                break
        got_one = False
        while True:
            j = _skip_ws(text, i)
            if closer is not None and text.startswith(closer, j):
                if not got_one:
                    raise _Fail("malformed_structure", f"{closer[:1]}{closer[2:]} holds no function call")
                i = j + len(closer)
                break
            if closer is None and got_one:
                break
            call, i, d = _parse_function(text, j, schemas)
            calls.append(call)
            dups += d
            got_one = True
            if closer is None:
                break


def _recover(text: str, pos: int, schemas):
    """The recovery pass: complete calls, then one malformed call or dropped trailing text."""
    calls: list[ParsedCall] = []
    dups = 0
    i = pos
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return calls, dups, None, False
        closer = None
        for opener, close in CONTAINERS.items():
            if text.startswith(opener, i):
                closer, i = close, i + len(opener)
                break
        j = _skip_ws(text, i)
        if not any(rx.match(text, j) for rx, _ in _FUNC_OPENERS):
            if calls:  # ordinary text (or a stray container) after the last complete call
                return calls, dups, None, True
            raise AssertionError("recovery starts at a region that opens a function")
        i = j
        while True:
            try:
                call, i, d = _parse_function(text, i, schemas)
            except _Fail as f:
                calls.append(_malformed_call(f))
                return calls, dups, f, False
            calls.append(call)
            dups += d
            j = _skip_ws(text, i)
            if closer is not None and text.startswith(closer, j):
                i = j + len(closer)
                break
            if closer is not None and any(rx.match(text, j) for rx, _ in _FUNC_OPENERS):
                i = j
                continue
            if closer is not None:  # a container left open: tolerated at the end of the output
                i = j
            break


def _malformed_call(f: _Fail) -> ParsedCall:
    args: dict[str, Any] = {"error": f.message}
    if f.name:
        args["tool_name"] = f.name
    args["hint"] = ("Write the call again in exactly this form: <tool_call>\n<function=NAME>\n"
                    "<parameter=ARG>\nvalue\n</parameter>\n</function>\n</tool_call>")
    return ParsedCall(MALFORMED_TOOL, json.dumps(args, ensure_ascii=False))


def _match_name(m: re.Match) -> str:
    return next((g for g in m.groups() if g is not None), "").strip()


def _parse_function(text: str, i: int, schemas):
    """One function element at `i` -> (call, end index, duplicate count)."""
    m = None
    fclose = ""
    for rx, close in _FUNC_OPENERS:
        m = rx.match(text, i)
        if m:
            fclose = close
            break
    if not m:
        raise _Fail("malformed_structure", "expected a function opening tag such as <function=NAME>")
    name = _match_name(m)
    if not _NAME_OK.match(name):
        raise _Fail("invalid_tool_name", f"the function name {name[:64]!r} is not a valid tool name")
    if schemas is not None and name not in schemas:
        raise _Fail("undeclared_tool", f"the function {name!r} is not one of the declared tools", name)
    schema = (schemas or {}).get(name) or {}
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    args: dict[str, Any] = {}
    dups = 0
    i = m.end()
    while True:
        i = _skip_ws(text, i)
        if text.startswith(fclose, i):
            i += len(fclose)
            break
        pm = None
        pclose = ""
        for rx, close in _PARAM_OPENERS:
            pm = rx.match(text, i)
            if pm:
                pclose = close
                break
        if not pm:
            if i >= len(text):
                raise _Fail("malformed_structure", f"the call to {name} is not closed with {fclose}", name)
            raise _Fail("malformed_structure", f"unexpected text inside the call to {name}; expected a "
                        f"parameter tag or {fclose}", name)
        pname = _match_name(pm)
        if not pname:
            raise _Fail("malformed_structure", f"a parameter of {name} has no name", name)
        value, i = _read_value(text, pm.end(), pclose, name, pname)
        typed = _typed(value, props.get(pname))
        if pname in args:
            dups += 1
        if typed is _OMIT:
            args.pop(pname, None)
        else:
            args[pname] = typed
    return ParsedCall(name, json.dumps(args, ensure_ascii=False)), i, dups


def _read_value(text: str, start: int, close: str, fname: str, pname: str) -> tuple[str, int]:
    nested = _NESTED_OPEN[close]
    depth = 0
    i = start
    while True:
        c = text.find(close, i)
        o = nested.search(text, i)
        if c < 0:
            raise _Fail("malformed_structure", f"the value of parameter {pname!r} of {fname} is not closed "
                        f"with {close}", fname)
        if o is not None and o.start() < c:
            depth += 1
            i = o.end()
            continue
        after = c + len(close)
        if depth > 0:
            depth -= 1
            i = after
            continue
        k = _skip_ws(text, after)
        if k >= len(text) or text[k] == "<":
            value = text[start:c]
            if value.startswith("\n"):
                value = value[1:]
            if value.endswith("\n"):
                value = value[:-1]
            return value, after
        i = after


_OMIT = object()


def _admits_string(kind: Any) -> bool:
    if kind is None:
        return True
    if isinstance(kind, str):
        return kind == "string"
    if isinstance(kind, list):
        return "string" in kind or not kind
    return True


def _typed(value: str, schema: Any) -> Any:
    """Apply a parameter's explicit top-level JSON-schema type (see the module docstring)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if _admits_string(kind):
        return value
    if value.strip() == "":
        return _OMIT
    try:
        return json.loads(value)
    except (json.JSONDecodeError, RecursionError):
        return value
