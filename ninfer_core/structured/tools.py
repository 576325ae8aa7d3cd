"""Grammars for the Qwen tool-call envelope, as xgrammar structural tags.

- `auto_calls(tools, parallel)`: one or more calls to declared tools; each declared parameter at
  most once, in declaration order; values are free text that cannot contain the envelope's own
  delimiters (spec "Structured output": the native tool envelope, values non-strict). Used beside a
  JSON response format when tools are active: after reasoning the answer is either the JSON value
  or the calls.
- `forced_call_rest(parameters)`: what follows the forced opener "<tool_call>\\n<function=NAME>\\n"
  the prompt ends with: the arguments under the tool's parameter schema (xgrammar's qwen_xml style:
  strings raw, other values as JSON) and the closing tags. With --structured-output a forced call's
  arguments therefore always parse against the schema (NInfer's addition to the spec).
"""

from __future__ import annotations

from xgrammar import structural_tag as st

CALL_OPEN = "<tool_call>\n<function={name}>\n"
CALL_CLOSE = "</function>\n</tool_call>"
_DELIMITERS = ["</parameter>", "<parameter=", "</function>", "<function=", "<tool_call>", "</tool_call>"]


def _param(name: str) -> st.OptionalFormat:
    return st.OptionalFormat(content=st.TagFormat(
        begin=f"<parameter={name}>\n", content=st.AnyTextFormat(excludes=_DELIMITERS), end="\n</parameter>\n"))


def auto_calls(tools: list[dict], parallel: bool) -> st.StructuralTag:
    tags = []
    for t in tools:
        fn = t.get("function", t)
        params = (fn.get("parameters") or {}).get("properties") or {}
        body = [_param(p) for p in params] or [st.ConstStringFormat(value="")]
        tags.append(st.TagFormat(begin=CALL_OPEN.format(name=fn["name"]), content=st.SequenceFormat(elements=body),
                                 end=CALL_CLOSE))
    return st.StructuralTag(format=st.TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True,
                                                               stop_after_first=not parallel))


def forced_call_rest(parameters: dict) -> st.StructuralTag:
    return st.StructuralTag(format=st.SequenceFormat(elements=[
        st.JSONSchemaFormat(json_schema=parameters, style="qwen_xml", max_whitespace_cnt=8),
        st.ConstStringFormat(value="\n" + CALL_CLOSE)]))
