"""The project's Qwen3.5 chat template, the sandboxed renderer, and prompt encoding."""

import pytest
from qwen_format import QWEN35_TEMPLATE, qwen35_tokenizer_section, with_format

from ninfer_core.tokenizer import Tokenizer
from ninfer_core.tokenizer.chat_template import ChatTemplate, TemplateError, render_ids

IM_START, IM_END, THINK, END_THINK = 248045, 248046, 248068, 248069

TOOL_RULES = (
    "To call a function, answer with a block in exactly this form and write nothing after it:\n\n"
    "<tool_call>\n<function=function_name>\n<parameter=parameter_name>\nparameter value\n</parameter>\n"
    "<parameter=another_parameter>\na value may run\nover several lines\n</parameter>\n</function>\n"
    "</tool_call>\n\nRules:\n"
    "- Put each <function=...></function> block inside its own <tool_call></tool_call> block; "
    "several calls may follow one another.\n"
    "- Give every required parameter.\n"
    "- Any explanation of a call goes before it, never after it.\n"
    "- When no function fits the request, answer directly and do not mention the functions."
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
WEATHER_JSON = (
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city", '
    '"parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, '
    '"required": ["city"]}}}'
)


@pytest.fixture(scope="module")
def template():
    return ChatTemplate(QWEN35_TEMPLATE)


@pytest.fixture(scope="module")
def tok():
    return with_format(Tokenizer.from_section(qwen35_tokenizer_section()))


def test_simple_chat(template):
    out = template.render([{"role": "user", "content": "Hi there"}])
    assert out == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_no_generation_prompt(template):
    out = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert out == "<|im_start|>user\nHi<|im_end|>\n"


def test_system_and_user(template):
    out = template.render(
        [{"role": "system", "content": "Answer concisely."}, {"role": "user", "content": "What is BPE?"}]
    )
    assert out == (
        "<|im_start|>system\nAnswer concisely.<|im_end|>\n"
        "<|im_start|>user\nWhat is BPE?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_developer_mid_conversation_keeps_position(template):
    out = template.render(
        [
            {"role": "developer", "content": "Be terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "developer", "content": "Now answer in French."},
            {"role": "user", "content": "Bye"},
        ]
    )
    assert out == (
        "<|im_start|>system\nBe terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>system\nNow answer in French.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_thinking_off(template):
    out = template.render([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert out == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_reasoning_effort_accepted(template):
    plain = template.render([{"role": "user", "content": "Hi"}])
    assert template.render([{"role": "user", "content": "Hi"}], reasoning_effort="xhigh") == plain


MULTI_TURN = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "\nAdd two and two.\n"},
    {"role": "user", "content": "Times 3?"},
    {"role": "assistant", "content": "\n\n12", "reasoning": "4 times 3."},
]


def test_multi_turn_reasoning_dropped_before_last_query(template):
    out = template.render(MULTI_TURN, add_generation_prompt=False)
    assert out == (
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nTimes 3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n4 times 3.\n</think>\n\n12<|im_end|>\n"
    )


def test_multi_turn_preserve_thinking(template):
    out = template.render(MULTI_TURN[:3], preserve_thinking=True)
    assert out == (
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAdd two and two.\n</think>\n\n4<|im_end|>\n"
        "<|im_start|>user\nTimes 3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_assistant_after_last_query_without_reasoning_gets_empty_block(template):
    out = template.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}],
                          add_generation_prompt=False)
    assert out.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nHey<|im_end|>\n")


def test_tools_tool_calls_and_grouped_responses(template):
    messages = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "Two cities.",
            "tool_calls": [
                {"id": "a", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
                {"id": "b", "type": "function",
                 "function": {"name": "get_weather",
                              "arguments": {"city": "Rome", "extra": {"x": [1, "é"]}}}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "Rain"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "Snow"},
    ]
    out = template.render(messages, tools=[WEATHER])
    assert out == (
        "<|im_start|>system\n# Tools\n\nYou can call the functions listed below. Each line inside "
        "<tools></tools> is the JSON schema of one function:\n<tools>\n" + WEATHER_JSON + "\n</tools>\n\n"
        + TOOL_RULES + "\n\nYou are a weather bot.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo cities.\n</think>\n\nLet me check.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
        '<parameter=extra>\n{"x": [1, "é"]}\n</parameter>\n</function>\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nSunny\n</tool_response>\n<tool_response>\nRain\n</tool_response>"
        "<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nSnow\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_tools_without_system_message(template):
    out = template.render([{"role": "user", "content": "Hi"}], tools=[WEATHER])
    assert out.startswith("<|im_start|>system\n# Tools\n\n")
    assert out.endswith(
        TOOL_RULES + "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def test_list_content_parts_joined_without_separator(template):
    out = template.render(
        [{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"},
                                      {"type": "refusal", "refusal": "!"}]}]
    )
    assert out == "<|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_image_part_placeholder(template):
    out = template.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                                        {"type": "text", "text": "What is this?"}]}])
    assert out.startswith(
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>"
    )


def test_empty_content_is_an_empty_turn(template):
    out = template.render([{"role": "user", "content": ""}], add_generation_prompt=False)
    assert out == "<|im_start|>user\n<|im_end|>\n"


def test_input_not_mutated(template):
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]
    template.render(messages)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_template_errors():
    with pytest.raises(TemplateError, match="unsupported message role"):
        ChatTemplate(QWEN35_TEMPLATE).render([{"role": "wizard", "content": "x"}])
    with pytest.raises(TemplateError, match="must be a JSON object"):
        ChatTemplate(QWEN35_TEMPLATE).render(
            [{"role": "assistant", "content": "",
              "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}])
    with pytest.raises(TemplateError, match="cannot contain a content part"):
        ChatTemplate(QWEN35_TEMPLATE).render([{"role": "system", "content": [{"type": "image_url"}]}])
    with pytest.raises(TemplateError, match="syntax error"):
        ChatTemplate("{% if %}")
    with pytest.raises(TemplateError):
        ChatTemplate("{{ ''.__class__.__mro__ }}").render([])
    with pytest.raises(TemplateError):
        ChatTemplate("{% set x = messages.append(1) %}").render([])
    assert issubclass(TemplateError, ValueError)


def test_tojson_keeps_order_and_non_ascii():
    t = ChatTemplate("{{ tools[0] | tojson }}|{{ tools[0] | tojson(indent=1) }}")
    out = t.render([], tools=[{"z": "ü", "a": 1}])
    assert out == '{"z": "ü", "a": 1}|{\n "z": "ü",\n "a": 1\n}'


def test_from_file(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}", encoding="utf-8")
    assert ChatTemplate.from_file(path).render([{"role": "user", "content": "x"}]) == "[x]"
    with pytest.raises(TemplateError, match="cannot read"):
        ChatTemplate.from_file(tmp_path / "missing.jinja")


# --- encoding: control-token spellings in data stay text -------------------------------------------

def test_quoted_control_token_encodes_as_text(template, tok):
    messages = [{"role": "user", "content": "Type <|im_end|> and <think> please"}]
    ids = template.render_ids(tok, messages)
    assert ids.count(IM_END) == 1 and ids.count(THINK) == 1  # the template's own
    assert ids[-2:] == [THINK, tok.encode("\n")[0]]
    user_part = ids[ids.index(IM_START) + 1: ids.index(IM_END)]
    assert user_part == tok.encode("user\nType <|im_end|> and <think> please", allow_special=False)
    assert tok.decode(ids) == "user\nType <|im_end|> and <think> please\nassistant\n<think>\n"


def test_render_ids_equals_plain_encoding_without_quoted_tokens(template, tok):
    messages = [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Héllo 世界"},
                {"role": "assistant", "content": "ok", "reasoning_content": "r"},
                {"role": "user", "content": "again"}]
    text = template.render(messages, tools=[WEATHER])
    assert template.render_ids(tok, messages, tools=[WEATHER]) == tok.encode(text)
    assert render_ids(tok, messages, tools=[WEATHER], template=template) == tok.encode(text)


def test_quoted_tokens_in_tools_reasoning_arguments_and_kwargs(tok):
    t = ChatTemplate("{{ messages[0].content }}|{{ tools[0] | tojson }}|{{ note }}|{{ eos_token }}")
    segments = t.render_segments(
        [{"role": "user", "content": "a<|im_start|>b"}], tools=[{"d": "<tool_call>"}],
        control_tokens=tok.added_tokens, note="<|endoftext|>", eos_token="<|im_end|>",
    )
    assert segments == [('a<|im_start|>b|{"d": "<tool_call>"}|<|endoftext|>|', False), ("<|im_end|>", True)]
    ids = t.render_ids(tok, [{"role": "user", "content": "a<|im_start|>b"}], tools=[{"d": "<tool_call>"}],
                       note="<|endoftext|>", eos_token="<|im_end|>")
    assert ids[-1] == IM_END and IM_START not in ids and 248058 not in ids and 248044 not in ids


def test_quoted_markup_in_assistant_history(template, tok):
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "see </think> and <tool_call>",
         "reasoning_content": "<think>x</think>",
         "tool_calls": [{"function": {"name": "f", "arguments": {"v": "</parameter><|im_end|>"}}}]},
    ]
    ids = template.render_ids(tok, messages, add_generation_prompt=False)
    assert ids.count(THINK) == 1 and ids.count(END_THINK) == 1 and ids.count(IM_END) == 2
    assert ids.count(248058) == 1  # <tool_call> from the template only
    assert tok.decode(ids, skip_special=False) == template.render(messages, add_generation_prompt=False)


def test_sentinel_characters_in_data_are_kept(template, tok):
    content = "\ue000" + "3" + "\ue000 <|im_end|> \ue001"
    ids = template.render_ids(tok, [{"role": "user", "content": content}])
    assert tok.decode(ids).startswith("user\n" + content + "\n")
    assert ids.count(IM_END) == 1


def test_render_ids_with_a_tokenizer_without_added_tokens(template):
    class CharTokenizer:  # no added_tokens mapping: the prompt is encoded as one string
        def encode(self, text, allow_special=True):
            return [-1 if allow_special else -2] + [ord(c) for c in text]

    messages = [{"role": "user", "content": "hello"}]
    ids = template.render_ids(CharTokenizer(), messages)
    assert ids == [-1] + [ord(c) for c in template.render(messages)]
