"""End-to-end with the trained ninfer-tiny (the shipped default): real tool-call round trips and
thinking blocks produced by the model, on Chat Completions, Anthropic Messages and Responses.

`ninfer serve` with no artifact (so the packaged ninfer-tiny is what the default resolves to),
on a loopback port, driven by the real `openai` and `anthropic` clients, greedy (temperature 0).
Prompts are in the model's training distribution but on the held-out side of its split (never
trained on): a weather request with three tools declared, and a two-digit addition with a carry.
The assertions are on structure and on facts the model can only get from the conversation (the
declared function, JSON arguments naming the city, the tool result's temperature in the answer,
the sum), never on exact wording.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("ninfer_qwen35")
ninfer_tiny_data = pytest.importorskip("ninfer_tiny.data")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from ninfer_core.testing import wait_server_idle

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0}
TOOL_NAMES = ("get_weather", "get_time", "convert_currency")
CHAT_TOOLS = [ninfer_tiny_data.tool_schema(n) for n in TOOL_NAMES]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in CHAT_TOOLS]  # fmt: skip
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
WEATHER_PROPS = set(CHAT_TOOLS[0]["function"]["parameters"]["properties"])
TEMPERATURE = 17  # what the "tool" answers; the model must carry it into its answer


def _held_out(prompt: str) -> bool:
    return ninfer_tiny_data.held_out([{"role": "user", "content": prompt}])


def _weather_prompt() -> tuple[str, str]:
    for city in ninfer_tiny_data.CITIES:
        q = f"What's the weather in {city}?"  # one of the generator's request templates
        if _held_out(q):
            return q, city
    raise AssertionError("no held-out weather prompt")


def _addition_prompt() -> tuple[str, int]:
    for a in range(10, 100):
        for b in range(10, 100):
            q = f"What is {a} + {b}?"
            if a % 10 + b % 10 >= 10 and _held_out(q):  # a carry, so the thinking has two columns
                return q, a + b
    raise AssertionError("no held-out addition prompt")


WEATHER_Q, CITY = _weather_prompt()
ADD_Q, SUM = _addition_prompt()


def _tool_result() -> str:
    return json.dumps({"city": CITY, "temperature": TEMPERATURE, "sky": "cloudy"})


def _spec_flags(mode: str) -> tuple[str, ...]:
    if mode == "plain":
        return ()
    pytest.importorskip("ninfer_spec_mtp")
    return ("--spec", "mtp", "--draft-tokens", "3")  # ninfer-tiny's trained MTP head drafts


@pytest.fixture(scope="module", params=["plain", "spec-mtp"])
def server(request, tmp_path_factory):
    conftest = request.config.pluginmanager.get_plugin(
        str(Path(__file__).resolve().parents[1] / "conftest.py")
    )
    flags = _spec_flags(request.param)
    tmp = tmp_path_factory.mktemp("tiny-default")
    # no artifact: the default-artifact hook answers; the random default would be built into the cache
    s = conftest.launch_server(None, *flags, log_dir=tmp, env={"NINFER_CACHE_DIR": str(tmp / "cache")})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.api_base, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _check_weather_args(arguments: dict) -> None:
    assert isinstance(arguments, dict) and "city" in arguments and set(arguments) <= WEATHER_PROPS
    assert arguments["city"] == CITY


def _check_thinking(text: str | None) -> None:
    assert text and text.strip(), "no thinking produced"
    for tag in ("<think>", "</think>", "<tool_call>", "<|im_end|>"):
        assert tag not in text


def _check_answer(text: str | None) -> None:
    assert text and text.strip(), "no answer text"
    for tag in ("<think>", "</think>", "<tool_call>", "<|im_end|>"):
        assert tag not in text


def test_the_default_artifact_is_the_trained_ninfer_tiny(server, oai):
    from ninfer_tiny.plugin import packaged_artifact

    assert packaged_artifact() is not None, "ninfer_tiny/data/ninfer-tiny.ninfer is not in the package"
    assert [m.id for m in oai.models.list().data] == ["ninfer-tiny"]
    assert f"from {packaged_artifact()}" in server.log()
    assert not list((Path(server.log_path).parent / "cache").glob("*.ninfer"))  # no random default built


# -- Chat Completions ---------------------------------------------------------------------------


def test_chat_tool_call_round_trip(oai, server):
    messages = [{"role": "user", "content": WEATHER_Q}]
    r = oai.chat.completions.create(model="ninfer-tiny", messages=messages, tools=CHAT_TOOLS, max_tokens=200,
                                    **GREEDY)  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_thinking(choice.message.reasoning_content)
    assert not choice.message.content  # the call is not left in the text
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    _check_weather_args(json.loads(call.function.arguments))

    messages += [
        {"role": "assistant", "content": None, "reasoning_content": choice.message.reasoning_content,
         "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": _tool_result()},
    ]  # fmt: skip
    r2 = oai.chat.completions.create(model="ninfer-tiny", messages=messages, tools=CHAT_TOOLS, max_tokens=200,
                                     **GREEDY)  # fmt: skip
    answer = r2.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    _check_thinking(answer.message.reasoning_content)
    _check_answer(answer.message.content)
    assert str(TEMPERATURE) in answer.message.content  # read from the tool result
    wait_server_idle(server)


def test_chat_thinking_is_separated_from_the_answer(oai, server):
    r = oai.chat.completions.create(model="ninfer-tiny", messages=[{"role": "user", "content": ADD_Q}],
                                    max_tokens=200, **GREEDY)  # fmt: skip
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    _check_thinking(msg.reasoning_content)
    assert "+" in msg.reasoning_content and str(SUM) in msg.reasoning_content  # the worked sum
    _check_answer(msg.content)
    assert str(SUM) in msg.content
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    wait_server_idle(server)


def test_chat_stream_thinking_then_tool_call(oai, server):
    aggregate = oai.chat.completions.create(model="ninfer-tiny", messages=[{"role": "user", "content": WEATHER_Q}],
                                            tools=CHAT_TOOLS, max_tokens=200, **GREEDY)  # fmt: skip
    stream = oai.chat.completions.create(model="ninfer-tiny", messages=[{"role": "user", "content": WEATHER_Q}],
                                         tools=CHAT_TOOLS, max_tokens=200, stream=True, **GREEDY)  # fmt: skip
    reasoning, content, calls, finish, order = [], [], {}, None, []
    for chunk in stream:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        delta = c.delta
        if getattr(delta, "reasoning_content", None):
            reasoning.append(delta.reasoning_content)
            order.append("reasoning")
        if delta.content:
            content.append(delta.content)
            order.append("content")
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.function and tc.function.name:
                slot["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                slot["arguments"] += tc.function.arguments
            order.append("tool_call")
        finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert order.index("tool_call") > max(i for i, k in enumerate(order) if k == "reasoning")
    _check_thinking("".join(reasoning))
    assert "".join(reasoning) == aggregate.choices[0].message.reasoning_content
    assert not "".join(content).strip()
    assert list(calls.values()) == [{"name": "get_weather", "arguments": aggregate.choices[0].message.tool_calls[0]
                                     .function.arguments}]  # fmt: skip
    _check_weather_args(json.loads(calls[0]["arguments"]))
    wait_server_idle(server)


# -- Anthropic Messages -------------------------------------------------------------------------

THINKING = {"type": "enabled", "budget_tokens": 1024}


def test_anthropic_tool_use_round_trip(claude, server):
    messages = [{"role": "user", "content": WEATHER_Q}]
    m = claude.messages.create(model="ninfer-tiny", max_tokens=2048, messages=messages, tools=ANTHROPIC_TOOLS,
                               thinking=THINKING, extra_body=GREEDY)  # fmt: skip
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["thinking", "tool_use"]
    _check_thinking(m.content[0].thinking)
    use = m.content[1]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    _check_weather_args(use.input)

    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": _tool_result()}],
        },
    ]
    m2 = claude.messages.create(model="ninfer-tiny", max_tokens=2048, messages=messages, tools=ANTHROPIC_TOOLS,
                                thinking=THINKING, extra_body=GREEDY)  # fmt: skip
    assert m2.stop_reason == "end_turn"
    assert [b.type for b in m2.content] == ["thinking", "text"]
    _check_thinking(m2.content[0].thinking)
    _check_answer(m2.content[1].text)
    assert str(TEMPERATURE) in m2.content[1].text
    wait_server_idle(server)


def test_anthropic_thinking_block_then_text(claude, server):
    m = claude.messages.create(model="ninfer-tiny", max_tokens=2048, messages=[{"role": "user", "content": ADD_Q}],
                               thinking=THINKING, extra_body=GREEDY)  # fmt: skip
    assert m.stop_reason == "end_turn"
    assert [b.type for b in m.content] == ["thinking", "text"]
    _check_thinking(m.content[0].thinking)
    assert m.content[0].signature
    assert str(SUM) in m.content[0].thinking and str(SUM) in m.content[1].text
    wait_server_idle(server)


def test_anthropic_stream_thinking_then_tool_use(claude, server):
    with claude.messages.stream(model="ninfer-tiny", max_tokens=2048, messages=[{"role": "user", "content": WEATHER_Q}],
                                tools=ANTHROPIC_TOOLS, thinking=THINKING, extra_body=GREEDY) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_message()
    starts = [ev.content_block.type for ev in events if ev.type == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    deltas = [ev.delta.type for ev in events if ev.type == "content_block_delta"]
    assert "thinking_delta" in deltas and "input_json_delta" in deltas
    assert deltas.index("input_json_delta") > max(i for i, d in enumerate(deltas) if d == "thinking_delta")
    thinking = "".join(ev.delta.thinking for ev in events
                       if ev.type == "content_block_delta" and ev.delta.type == "thinking_delta")  # fmt: skip
    _check_thinking(thinking)
    assert final.stop_reason == "tool_use"
    assert final.content[0].thinking == thinking
    assert final.content[1].name == "get_weather"
    _check_weather_args(final.content[1].input)
    wait_server_idle(server)


# -- Responses ----------------------------------------------------------------------------------


def _reasoning_text(item) -> str:
    return "".join(part.text for part in (item.content or []))


def test_responses_function_call_round_trip(oai, server):
    r = oai.responses.create(model="ninfer-tiny", input=WEATHER_Q, tools=RESPONSES_TOOLS, max_output_tokens=200,
                             **GREEDY)  # fmt: skip
    assert r.status == "completed"
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    _check_thinking(_reasoning_text(r.output[0]))
    call = r.output[1]
    assert call.name == "get_weather" and call.call_id
    _check_weather_args(json.loads(call.arguments))

    r2 = oai.responses.create(model="ninfer-tiny", previous_response_id=r.id, tools=RESPONSES_TOOLS,
                              input=[{"type": "function_call_output", "call_id": call.call_id,
                                      "output": _tool_result()}],
                              max_output_tokens=200, **GREEDY)  # fmt: skip
    assert r2.status == "completed"
    assert [o.type for o in r2.output] == ["reasoning", "message"]
    _check_thinking(_reasoning_text(r2.output[0]))
    _check_answer(r2.output_text)
    assert str(TEMPERATURE) in r2.output_text
    wait_server_idle(server)


def test_responses_reasoning_item_then_message(oai, server):
    r = oai.responses.create(model="ninfer-tiny", input=ADD_Q, max_output_tokens=200, **GREEDY)
    assert r.status == "completed"
    assert [o.type for o in r.output] == ["reasoning", "message"]
    thinking = _reasoning_text(r.output[0])
    _check_thinking(thinking)
    assert str(SUM) in thinking
    _check_answer(r.output_text)
    assert str(SUM) in r.output_text
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    wait_server_idle(server)


def test_responses_stream_reasoning_then_function_call(oai, server):
    with oai.responses.stream(model="ninfer-tiny", input=WEATHER_Q, tools=RESPONSES_TOOLS, max_output_tokens=200,
                              **GREEDY) as stream:  # fmt: skip
        types = [ev.type for ev in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in types and "response.function_call_arguments.done" in types
    assert types.index("response.function_call_arguments.delta") > types.index("response.reasoning_text.done")
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    assert final.output[1].name == "get_weather"
    _check_weather_args(json.loads(final.output[1].arguments))
    wait_server_idle(server)
