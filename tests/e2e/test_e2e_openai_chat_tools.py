"""End-to-end: tools, forced tool calls, logprobs, reasoning and thinking budgets on Chat Completions.

The real `ninfer serve` (tiny random-weight Qwen3.5 artifact, real tokenizer) driven by the `openai`
client. Random weights write random text, so these tests check shapes and invariants that hold for
any output: a forced call always yields a tool call, logprob records are consistent with the
content and with each other, greedy streams equal greedy aggregates.
"""

from __future__ import annotations

import json
import math

import openai
import pytest

from ninfer_core.testing import wait_server_idle as _wait_idle

pytestmark = pytest.mark.timeout(300)

HI = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"enable_thinking": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
SHELL = {"type": "custom", "custom": {"name": "shell", "description": "Run a shell command"}}


@pytest.fixture(scope="module")
def client(live_server):
    with openai.OpenAI(base_url=live_server.api_base, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id




def test_tools_accepted_and_round_trip(client, model_id, live_server):
    r = client.chat.completions.create(model=model_id, messages=HI, tools=[WEATHER, SHELL], max_tokens=8,
                                       temperature=0, extra_body=NO_THINKING)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or []:
        assert call.id.startswith("call_")
        if call.type == "function":
            assert isinstance(json.loads(call.function.arguments), dict)
    # a full round trip: the assistant's call and the tool result go back in the history
    history = HI + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
    ]
    r2 = client.chat.completions.create(model=model_id, messages=history, tools=[WEATHER, SHELL], max_tokens=6,
                                        temperature=0, extra_body=NO_THINKING)
    assert r2.choices[0].message.role == "assistant"
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result were rendered
    _wait_idle(live_server)


def test_tool_choice_none_never_returns_calls(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=HI, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8, temperature=0, extra_body=NO_THINKING)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


def test_forced_tool_call_always_yields_a_call(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=HI, tools=[WEATHER, SHELL],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and calls[0].type == "function"
    assert calls[0].function.name in ("get_weather", "malformed_tool_call")
    assert isinstance(json.loads(calls[0].function.arguments), dict)
    assert choice.message.model_extra.get("reasoning_content") is None  # forcing switched thinking off


def test_forced_tool_call_streams_tool_call_deltas(client, model_id):
    stream = client.chat.completions.create(model=model_id, messages=HI, tools=[WEATHER], tool_choice="required",
                                            max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].index == 0 and calls[0].id.startswith("call_") and calls[0].type == "function"
    assert calls[0].function.name in ("get_weather", "malformed_tool_call")
    assert isinstance(json.loads("".join(tc.function.arguments for tc in calls if tc.index == 0)), dict)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the aggregate answer is the same call (greedy)
    agg = client.chat.completions.create(model=model_id, messages=HI, tools=[WEATHER], tool_choice="required",
                                         max_tokens=12, temperature=0)
    assert agg.choices[0].message.tool_calls[0].function.arguments == calls[0].function.arguments


def test_custom_tool_forced_answers_as_a_custom_call(client, model_id):
    r = client.chat.completions.create(
        model=model_id, messages=HI, tools=[SHELL], max_tokens=10, temperature=0,
        tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "required",
                                                                "tools": [{"type": "custom", "name": "shell"}]}})
    call = r.choices[0].message.tool_calls[0]
    if call.type == "custom":
        assert call.custom.name == "shell" and isinstance(call.custom.input, str)
    else:  # what the model wrote could not be read as a call
        assert call.function.name == "malformed_tool_call"


def _check_records(records, k):
    for rec in records:
        tops = rec.top_logprobs
        assert len(tops) == k
        values = [t.logprob for t in tops]
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5
        assert rec.logprob <= 0.0
        # greedy: the chosen token is the most likely one
        assert rec.token == tops[0].token and rec.logprob == pytest.approx(values[0], abs=1e-5)
        assert rec.bytes is not None


def test_logprobs_aggregate_and_stream_agree(client, model_id):
    kw = dict(model=model_id, messages=HI, max_tokens=8, temperature=0, logprobs=True, top_logprobs=4,
              extra_body=NO_THINKING)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    records = choice.logprobs.content
    assert records and len(records) <= r.usage.completion_tokens
    _check_records(records, 4)
    raw = b"".join(bytes(rec.bytes) for rec in records)
    assert raw.decode("utf-8", errors="replace") == choice.message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [rec for c in chunks if c.choices and c.choices[0].logprobs
                for rec in (c.choices[0].logprobs.content or [])]
    assert [(s.token, s.logprob) for s in streamed] == [(a.token, a.logprob) for a in records]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content


def test_logprobs_skip_the_reasoning_channel(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=HI, max_tokens=6, temperature=0, logprobs=True)
    msg = r.choices[0].message
    # thinking on: the prompt opens a <think> block, so the first tokens are reasoning
    assert isinstance(msg.model_extra.get("reasoning_content"), str)
    content_bytes = b"".join(bytes(rec.bytes) for rec in r.choices[0].logprobs.content)
    assert content_bytes.decode("utf-8", errors="replace") == (msg.content or "")


def test_reasoning_and_content_are_split(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=HI, max_tokens=10, temperature=0)
    msg = r.choices[0].message
    assert isinstance(msg.model_extra["reasoning_content"], str)
    details = r.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens <= r.usage.completion_tokens
    off = client.chat.completions.create(model=model_id, messages=HI, max_tokens=10, temperature=0,
                                         reasoning_effort="none")
    assert off.choices[0].message.model_extra.get("reasoning_content") is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_thinking_budget_closes_reasoning_early(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=HI, max_tokens=80, temperature=0,
                                       extra_body={"thinking_budget": 4})
    reasoning = r.choices[0].message.model_extra["reasoning_content"]
    assert "Considering the limited time by the user" in reasoning
    assert r.usage.completion_tokens_details.reasoning_tokens < r.usage.completion_tokens or \
        r.choices[0].finish_reason == "length"


def test_post_thinking_and_effort_accepted(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=HI, max_tokens=6, reasoning_effort="high",
                                       extra_body={"post_thinking": {"temperature": 0.1, "top_k": 5}})
    assert r.choices[0].finish_reason in ("stop", "length")


BAD = [
    (dict(tools=[WEATHER, {"type": "function", "function": {"name": "other"}}], tool_choice="required"),
     "tool_choice_not_supported", "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "invalid_value", "tool_choice.function.name"),
    (dict(logprobs=True, top_logprobs=21), "invalid_value", "top_logprobs"),
    (dict(extra_body={"thinking_budget": 0}), "invalid_value", "thinking_budget"),
    (dict(extra_body={"post_thinking": {"temperature": 5}}), "invalid_value", "post_thinking.temperature"),
    (dict(extra_body={"guided_json": {"type": "object"}}), "unsupported_parameter", "guided_json"),
    (dict(reasoning_effort="enormous"), "invalid_value", "reasoning_effort"),
    (dict(extra_body={"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}),
     "invalid_value", "chat_template_kwargs.enable_thinking"),
]


@pytest.mark.parametrize("kw,code,param", BAD, ids=[b[2] for b in BAD])
def test_bad_input_through_the_client(client, model_id, live_server, kw, code, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=HI, max_tokens=4, **kw)
    assert e.value.status_code == 400
    assert (e.value.body["code"], e.value.body["param"], e.value.body["type"]) == (code, param,
                                                                                  "invalid_request_error")
    ok = client.chat.completions.create(model=model_id, messages=HI, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")
    _wait_idle(live_server)


def test_thinking_flags_on_a_live_server(start_server):
    server = start_server("--default-thinking-budget", "3", "--thinking-budget-message", "Time is up.",
                          "--post-thinking-sampler", "temp=0,top_k=1", "--default-reasoning-effort", "high")
    with openai.OpenAI(base_url=server.api_base, api_key="x", max_retries=0, timeout=120) as c:
        r = c.chat.completions.create(model="", messages=[{"role": "user", "content": "PROMPT-MARKER-42"}],
                                      max_tokens=40, temperature=0)
        reasoning = r.choices[0].message.model_extra["reasoning_content"]
        assert "Time is up." in reasoning
        # a request that does not think receives no cap
        off = c.chat.completions.create(model="", messages=HI, max_tokens=8, temperature=0,
                                        extra_body={"enable_thinking": False})
        assert off.choices[0].message.model_extra.get("reasoning_content") is None
    log = server.log()
    assert "thinking: budget 3" in log and "post-thinking sampling True" in log
    assert "PROMPT-MARKER-42" not in log and "Time is up." not in log


def test_effort_flag_conflicting_with_no_thinking_fails_startup(tiny_artifact):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "serve", tiny_artifact, "--port", "0",
                           "--no-thinking", "--default-reasoning-effort", "high"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "error: --default-reasoning-effort high asks for thinking" in proc.stderr
