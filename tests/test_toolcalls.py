"""Tool-call parser (ninfer_core.tokenizer.toolcalls) over a corpus of model outputs."""

import json

import pytest

from ninfer_core.tokenizer.toolcalls import (
    MALFORMED_TOOL,
    find_markers,
    marker_prefix_len,
    opens_function,
    parse_tool_calls,
    schema_map,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"},
        "tags": {"type": "array"}, "flag": {"type": "boolean"}, "either": {"type": ["string", "null"]},
        "ratio": {"type": "number"}}}}},
    {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
        "cmd": {"type": "string"}}}}},
]
SCHEMAS = schema_map(TOOLS)


def calls(res):
    return [(c.name, json.loads(c.arguments)) for c in res.calls]


def qwen(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_schema_map_accepts_openai_flat_and_anthropic_shapes():
    m = schema_map([{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
                     {"name": "b", "parameters": {"x": 1}}, {"name": "c", "input_schema": {"y": 2}},
                     {"name": "d"}, "junk"])
    assert m == {"a": {"type": "object"}, "b": {"x": 1}, "c": {"y": 2}, "d": {}}


def test_qwen_form_with_typed_values_and_member_order():
    text = ("Let me check.\n\n" + qwen("get_weather", days="3", city="Paris", opts='{"z": 1, "a": [2, 3]}',
                                       flag="true", ratio="0.5", tags='["x"]'))
    res = parse_tool_calls(text, SCHEMAS)
    assert res.content == "Let me check."
    assert res.calls[0].name == "get_weather"
    # member order as generated, nested object order too
    assert res.calls[0].arguments == ('{"days": 3, "city": "Paris", "opts": {"z": 1, "a": [2, 3]}, '
                                      '"flag": true, "ratio": 0.5, "tags": ["x"]}')
    assert res.fallback == "none" and not res.recovered


def test_string_admitting_types_stay_strings_and_no_coercion():
    text = qwen("get_weather", city="42", either="null", days="3.5", flag="yes")
    args = calls(parse_tool_calls(text, SCHEMAS))[0][1]
    assert args == {"city": "42", "either": "null", "days": 3.5, "flag": "yes"}
    # undeclared parameters stay strings
    assert calls(parse_tool_calls(qwen("run", extra="12"), SCHEMAS))[0][1] == {"extra": "12"}


def test_empty_non_string_values_are_omitted_and_empty_strings_kept():
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n\n</parameter>\n<parameter=city>\n\n" \
           "</parameter>\n</function>\n</tool_call>"
    assert calls(parse_tool_calls(text, SCHEMAS)) == [("get_weather", {"city": ""})]


def test_duplicate_parameters_keep_the_last_value():
    text = qwen("run", cmd="ls") .replace("</function>", "<parameter=cmd>\npwd\n</parameter>\n</function>")
    res = parse_tool_calls(text, SCHEMAS)
    assert calls(res) == [("run", {"cmd": "pwd"})]
    assert res.duplicate_parameters == 1


def test_several_calls_in_order():
    text = qwen("run", cmd="a") + "\n" + qwen("get_weather", city="b")
    assert calls(parse_tool_calls(text, SCHEMAS)) == [("run", {"cmd": "a"}), ("get_weather", {"city": "b"})]


@pytest.mark.parametrize("text", [
    '<function_calls>\n<invoke name="run">\n<parameter name="cmd">ls -l</parameter>\n</invoke>\n</function_calls>',
    '<invoke name="run"><param name="cmd">ls -l</param></invoke>',
    '<function name="run">\n<parameter name="cmd">ls -l</parameter>\n</function>',
    "<function=run>\n<parameter=cmd>\nls -l\n</parameter>\n</function>",
    "<tool_call>\n<function name='run'>\n<param name='cmd'>ls -l</param>\n</function>\n</tool_call>",
])
def test_agent_variants(text):
    res = parse_tool_calls(text, SCHEMAS)
    assert calls(res) == [("run", {"cmd": "ls -l"})]
    assert res.content == ""


def test_function_calls_container_with_two_invokes():
    text = ('<function_calls>\n<invoke name="run"><parameter name="cmd">a</parameter></invoke>\n'
            '<invoke name="run"><parameter name="cmd">b</parameter></invoke>\n</function_calls>')
    assert calls(parse_tool_calls(text, SCHEMAS)) == [("run", {"cmd": "a"}), ("run", {"cmd": "b"})]


def test_mismatched_closing_kind_is_malformed():
    text = '<invoke name="run"><parameter name="cmd">a</parameter></function>'
    res = parse_tool_calls(text, SCHEMAS)
    assert [c.name for c in res.calls] == [MALFORMED_TOOL]


def test_values_keep_markup_and_balanced_nested_parameters():
    value = "use <tool_call> and <parameter=x>\ninner\n</parameter> here"
    text = f"<tool_call>\n<function=run>\n<parameter=cmd>\n{value}\n</parameter>\n</function>\n</tool_call>"
    assert calls(parse_tool_calls(text, SCHEMAS)) == [("run", {"cmd": value})]


def test_closing_tag_followed_by_text_is_value_text():
    value = "echo '</parameter> is a tag'"
    text = f"<function=run>\n<parameter=cmd>\n{value}\n</parameter>\n</function>"
    assert calls(parse_tool_calls(text, SCHEMAS)) == [("run", {"cmd": value})]


def test_unmatched_nested_opener_makes_the_call_malformed():
    text = "<function=run>\n<parameter=cmd>\nx <parameter=y> z\n</parameter>\n</function>"
    res = parse_tool_calls(text, SCHEMAS)
    assert [c.name for c in res.calls] == [MALFORMED_TOOL]
    assert "not closed" in json.loads(res.calls[0].arguments)["error"]


def test_quoted_markup_before_the_real_call_stays_content():
    quoted = "The format is <tool_call><function=run>...</function></tool_call>, so:\n\n"
    res = parse_tool_calls(quoted + qwen("run", cmd="ls"), SCHEMAS)
    assert res.content == quoted.rstrip()
    assert calls(res) == [("run", {"cmd": "ls"})]
    assert not res.recovered


def test_markup_that_never_opens_a_function_is_content():
    for text in ("Write <tool_call> then stop.", "<function_calls> are cool", "a <function name=x> b"):
        res = parse_tool_calls(text, SCHEMAS)
        assert res.content == text and res.calls == [], text
    res = parse_tool_calls("<tool_call>\nhello\n</tool_call>", SCHEMAS)
    assert res.content == "<tool_call>\nhello\n</tool_call>" and not res.calls


def test_recovery_keeps_complete_calls_then_one_malformed_call():
    text = qwen("run", cmd="a") + "\n<tool_call>\n<function=run>\n<parameter=cmd>\nb"
    res = parse_tool_calls(text, SCHEMAS)
    assert [c.name for c in res.calls] == ["run", MALFORMED_TOOL]
    assert res.recovered and res.malformed and res.fallback == "malformed_structure"
    err = json.loads(res.calls[1].arguments)
    assert err["tool_name"] == "run" and "error" in err


def test_recovery_drops_trailing_text_after_complete_calls():
    text = "Calling.\n" + qwen("run", cmd="a") + "\nDone, and more prose."
    res = parse_tool_calls(text, SCHEMAS)
    assert res.content == "Calling."
    assert calls(res) == [("run", {"cmd": "a"})]
    assert res.trailing_dropped and res.fallback == "trailing_content"


def test_invalid_and_undeclared_names_become_malformed_calls():
    res = parse_tool_calls("<function=>\n</function>", SCHEMAS)
    assert [c.name for c in res.calls] == [MALFORMED_TOOL] and res.fallback == "invalid_tool_name"
    res = parse_tool_calls(qwen("rm_rf", path="/"), SCHEMAS)
    assert [c.name for c in res.calls] == [MALFORMED_TOOL] and res.fallback == "undeclared_tool"
    assert "rm_rf" in json.loads(res.calls[0].arguments)["error"]


def test_at_most_sixteen_markers_are_tried():
    junk = "<tool_call> " * 16
    res = parse_tool_calls(junk + qwen("run", cmd="a"), SCHEMAS)
    assert res.calls == [] and res.content == junk + qwen("run", cmd="a")
    junk = "<tool_call> " * 15
    res = parse_tool_calls(junk + qwen("run", cmd="a"), SCHEMAS)
    assert calls(res) == [("run", {"cmd": "a"})] and res.content == junk.rstrip()


def test_marker_helpers():
    assert find_markers("a <tool_call> <function=x> <invoke name=") == [2, 14, 27]
    assert marker_prefix_len("abc <tool_c") == len("<tool_c")
    assert marker_prefix_len("abc <b") == 0 and marker_prefix_len("x <") == 1
    assert marker_prefix_len("abc <tool_call>") == 0
    assert opens_function("<tool_call>\n<function=run>", 0) is True
    assert opens_function("<tool_call>\n<func", 0) is None
    assert opens_function("<tool_call>\n", 0) is None
    assert opens_function("<tool_call>\nhello", 0) is False
    assert opens_function('<invoke name="x"', 0) is None
    assert opens_function('<invoke name="x">', 0) is True


def test_a_complete_first_call_is_the_turn_even_before_more_text():
    text = "Note " + qwen("run", cmd="a") + " and prose, then " + qwen("run", cmd="b")
    res = parse_tool_calls(text, SCHEMAS)
    assert res.content == "Note" and calls(res) == [("run", {"cmd": "a"})]
    assert res.trailing_dropped and res.recovered
    # an incomplete first marker does not claim the turn: the later complete region does
    text = "Write <tool_call>\n<function=run> like so. " + qwen("run", cmd="b")
    res = parse_tool_calls(text, SCHEMAS)
    assert calls(res) == [("run", {"cmd": "b"})] and res.content == "Write <tool_call>\n<function=run> like so."
