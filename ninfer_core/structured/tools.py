"""Grammars for the XML tool-call envelope (`ninfer_core.tokenizer.toolcalls`), as xgrammar structural tags.

- `auto_calls(tools, parallel)`: one or more calls to declared tools; each declared parameter at
  most once, in declaration order; values are free text that cannot contain the envelope's own
  delimiters (spec "Structured output": the native tool envelope, values non-strict). Used beside a
  JSON response format when tools are active: after reasoning the answer is either the JSON value
  or the calls.
- `forced_call_rest(parameters)`: what follows the forced opener "<tool_call>\\n<function=NAME>\\n"
  the prompt ends with: the arguments under the tool's parameter schema and the closing tags, each
  value spelled the way ninfer_core.tokenizer.toolcalls reads it back (text for a declared type that
  admits strings, JSON otherwise; xgrammar's own XML-parameter style allows whitespace around values that
  the parser keeps as text). With --structured-output a forced call's arguments therefore always
  parse against the schema (NInfer's addition to the spec).
"""

from __future__ import annotations

import re

from xgrammar import structural_tag as st

from ninfer_core.structured.errors import SchemaError

CALL_OPEN = "<tool_call>\n<function={name}>\n"
CALL_CLOSE = "</function>\n</tool_call>"
_NAME_OK = re.compile(r"[^<>\n]{1,128}\Z")
_TEXT = "[^<\\x00]"  # a text value: anything but '<', so no delimiter can appear inside it
_DELIMITERS = ["</parameter>", "<parameter=", "</function>", "<function=", "<tool_call>", "</tool_call>"]


def _param(name: str) -> st.OptionalFormat:
    return st.OptionalFormat(
        content=st.TagFormat(
            begin=f"<parameter={name}>\n",
            content=st.AnyTextFormat(excludes=_DELIMITERS),
            end="\n</parameter>\n",
        )
    )


def auto_calls(tools: list[dict], parallel: bool) -> st.StructuralTag:
    tags = []
    for t in tools:
        fn = t.get("function", t)
        params = (fn.get("parameters") or {}).get("properties") or {}
        body = [_param(p) for p in params] or [st.ConstStringFormat(value="")]
        tags.append(
            st.TagFormat(
                begin=CALL_OPEN.format(name=fn["name"]),
                content=st.SequenceFormat(elements=body),
                end=CALL_CLOSE,
            )
        )
    return st.StructuralTag(
        format=st.TagsWithSeparatorFormat(
            tags=tags, separator="\n", at_least_one=True, stop_after_first=not parallel
        )
    )


def forced_call_rest(parameters: dict) -> st.StructuralTag:
    """The arguments and closing tags after a forced call's opener (parameters: a normalised schema)."""
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    required = set(parameters.get("required") or ())
    body: list = []
    for name, schema in (parameters.get("properties") or {}).items():
        if not _NAME_OK.match(name):
            raise SchemaError(
                "invalid_json_schema",
                f"the parameter name {name[:40]!r} cannot be written in an XML tool call",
                ("properties", name),
            )
        tag = st.TagFormat(
            begin=f"<parameter={name}>\n",
            content=_value(schema, defs, parameters, ("properties", name)),
            end="\n</parameter>\n",
        )
        body.append(tag if name in required else st.OptionalFormat(content=tag))
    return st.StructuralTag(
        format=st.SequenceFormat(elements=body + [st.ConstStringFormat(value=CALL_CLOSE)])
    )


def _resolve(schema, root):
    seen = 0
    while isinstance(schema, dict) and "$ref" in schema and seen < 32:
        target = root
        if schema["$ref"] != "#":
            for seg in schema["$ref"][2:].split("/"):
                target = target[int(seg)] if isinstance(target, list) else target[seg]
        schema, seen = target, seen + 1
    return schema


def _value(schema, defs: dict, root: dict, path: tuple):
    """A parameter value the way the tool-call parser reads it back: text when the declared type
    admits strings (or is absent), JSON for any other declared type."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind is not None and not (kind == "string" or (isinstance(kind, list) and "string" in kind)):
        return st.JSONSchemaFormat(
            json_schema={**defs, **schema} if defs else schema,
            style="json",
            max_whitespace_cnt=8,
            excludes=["</parameter>", "</function>"],
        )
    text = _string_branch(schema, root)
    if text is None:
        raise SchemaError(
            "json_schema_keyword_not_supported",
            "a forced call's parameter without an explicit "
            "non-string type must admit a string (the call's text is read back as one)",
            path,
        )
    return text


def _string_branch(schema, root):
    schema = _resolve(schema, root)
    if schema == {} or schema is True:
        return st.RegexFormat(pattern=_TEXT + "*")
    if not isinstance(schema, dict):
        return None
    if "anyOf" in schema:
        for branch in schema["anyOf"]:
            got = _string_branch(branch, root)
            if got is not None:
                return got
        return None
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if values is not None:
        texts = [v for v in values if isinstance(v, str) and "<" not in v and "\n" not in v]
        if not texts:
            return None
        return st.OrFormat(elements=[st.ConstStringFormat(value=v) for v in texts])
    kind = schema.get("type")
    if kind is not None and kind != "string" and not (isinstance(kind, list) and "string" in kind):
        return None
    if "pattern" in schema:
        return st.RegexFormat(pattern=schema["pattern"])
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    return st.RegexFormat(
        pattern=_TEXT + ("{%d,%s}" % (lo, "" if hi is None else hi) if (lo or hi is not None) else "*")
    )
