"""End-to-end: the real `ninfer serve` (subprocess, tiny Qwen3.5 artifact) driven by the `anthropic` client.

The model has random weights, so tests pin down shapes and plumbing: greedy decoding (temperature 0,
sent as an extra field since current SDKs no longer expose sampling) makes each output a fixed
function of its prompt, which lets a stop sequence be picked from one run and checked on the next.
"""

from __future__ import annotations

import base64
import json
import time

import anthropic
import httpx
import pytest

from ninfer_core.testing import wait_server_idle as _wait_idle

pytestmark = pytest.mark.timeout(300)

HI = [{"role": "user", "content": "Say hello."}]
OFF = {"type": "disabled"}
GREEDY = {"temperature": 0}
TOOLS = [{"name": "get_weather", "description": "Current weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def client(live_server):
    # Anthropic SDKs append /v1/messages to the bare server URL.
    with anthropic.Anthropic(base_url=live_server.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c




def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_aggregate_message(client, live_server):
    raw = client.messages.with_raw_response.create(model="any-local-label", max_tokens=12, messages=HI,
                                                   thinking=OFF, extra_body=GREEDY)
    assert raw.headers["request-id"].startswith("req_") and raw.headers["x-ninfer-version"]
    msg = raw.parse()
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == "any-local-label"
    assert [b.type for b in msg.content] == ["text"] and _text(msg)
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert 0 < msg.usage.output_tokens <= 12
    count = client.messages.count_tokens(model="m", messages=HI, thinking=OFF).input_tokens
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == count
    assert msg.usage.cache_creation_input_tokens is None
    _wait_idle(live_server)


def test_streaming_matches_aggregate(client, live_server):
    aggregate = client.messages.create(model="m", max_tokens=10, messages=HI, thinking=OFF, extra_body=GREEDY)
    with client.messages.stream(model="m", max_tokens=10, messages=HI, thinking=OFF, extra_body=GREEDY) as stream:
        events = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "message_delta" in events
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in aggregate.content]
    assert final.stop_reason == aggregate.stop_reason
    assert final.usage.output_tokens == aggregate.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        aggregate.usage.input_tokens + aggregate.usage.cache_read_input_tokens
    _wait_idle(live_server)


def test_message_start_usage_split_is_final(client, live_server):
    msgs = [{"role": "user", "content": "Tell me about prefix reuse in one line, twice over."}]
    usages = []
    for _ in range(2):  # the second run reuses the first one's cached prefix
        with client.messages.stream(model="m", max_tokens=4, messages=msgs, thinking=OFF, extra_body=GREEDY) as s:
            start = None
            for ev in s:
                if ev.type == "message_start":
                    start = ev.message.usage
            final = s.get_final_message().usage
        assert (start.input_tokens, start.cache_read_input_tokens) == \
            (final.input_tokens, final.cache_read_input_tokens)
        usages.append(final)
    assert usages[1].cache_read_input_tokens > 0
    assert usages[1].input_tokens + usages[1].cache_read_input_tokens == \
        usages[0].input_tokens + usages[0].cache_read_input_tokens
    _wait_idle(live_server)


def test_raw_sse_lifecycle_and_request_id(live_server):
    body = {"model": "m", "max_tokens": 6, "messages": HI, "stream": True,
            "thinking": {"type": "enabled", "budget_tokens": 1024}, "temperature": 0}
    with httpx.stream("POST", live_server.base_url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["request-id"].startswith("req_")
        assert "x-request-id" not in r.headers
        text = r.read().decode()
    events = []
    for block in text.split("\n\n"):
        if block and not block.startswith(":"):
            name, data = block.split("\n", 1)
            obj = json.loads(data[len("data: "):])
            assert name == "event: " + obj["type"]
            events.append(obj)
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    # thinking is on: the output opens in the thinking block, which closes with its signature
    assert events[1]["type"] == "content_block_start" and events[1]["content_block"]["type"] == "thinking"
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta" and e["index"] == 0]
    assert deltas[-1] == "signature_delta" and set(deltas[:-1]) <= {"thinking_delta"}
    assert events[-2]["type"] == "message_delta" and events[-2]["usage"]["output_tokens"] == 6
    _wait_idle(live_server)


def test_thinking_omitted_round_trip(client, live_server):
    thinking = {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    msg = client.messages.create(model="m", max_tokens=8, messages=HI, thinking=thinking, extra_body=GREEDY)
    block = msg.content[0]
    assert block.type == "thinking" and block.thinking == ""
    assert block.signature.startswith("ninfer-reasoning.v1:")
    reasoning = base64.b64decode(block.signature.split(":", 1)[1]).decode()
    visible = client.messages.create(model="m", max_tokens=8, messages=HI, thinking={**thinking, "display":
                                                                                     "summarized"},
                                     extra_body=GREEDY)
    assert visible.content[0].thinking == reasoning  # the same greedy reasoning, carried in the signature
    # the client echoes the block back: the server restores the reasoning from the signature
    history = [*HI, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
               {"role": "user", "content": "Go on."}]
    assert client.messages.count_tokens(model="m", messages=history, thinking=thinking).input_tokens > 0
    follow = client.messages.create(model="m", max_tokens=4, messages=history, thinking=thinking,
                                    extra_body=GREEDY)
    assert follow.content and follow.content[0].type == "thinking"
    _wait_idle(live_server)


def test_stop_sequence_and_max_tokens(client, live_server):
    first = client.messages.create(model="m", max_tokens=24, messages=HI, thinking=OFF, extra_body=GREEDY)
    text = _text(first)
    assert first.stop_reason == "max_tokens"
    # a three-character stop that first occurs after some visible text
    at = next(i for i in range(1, len(text) - 3) if text[:i].strip() and text[i:i + 3].strip()
              and text.index(text[i:i + 3]) == i)
    stop = text[at:at + 3]
    cut = client.messages.create(model="m", max_tokens=24, messages=HI, thinking=OFF, stop_sequences=[stop],
                                 extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert _text(cut) == text[:at]
    short = client.messages.create(model="m", max_tokens=3, messages=HI, thinking=OFF, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    _wait_idle(live_server)


def test_assistant_prefill_and_system_positions(client, live_server):
    msgs = [{"role": "system", "content": "Be brief."}, *HI, {"role": "assistant", "content": "Hello"},
            {"role": "system", "content": "Now in French."}, {"role": "user", "content": "Again."},
            {"role": "assistant", "content": "Bonjour"}]
    msg = client.messages.create(model="m", max_tokens=4, system="You are terse.", messages=msgs, thinking=OFF)
    assert msg.stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=4, messages=msgs)  # thinking left to the server default
    assert e.value.body["error"]["code"] == "assistant_prefill_not_supported"
    assert e.value.body["request_id"] == e.value.request_id
    _wait_idle(live_server)


def test_tools_tool_use_history_and_forced_choice(client, live_server):
    history = [{"role": "user", "content": "Weather in Paris and Rome?"},
               {"role": "assistant", "content": [
                   {"type": "text", "text": "Checking."},
                   {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Paris"}},
                   {"type": "tool_use", "id": "toolu_b", "name": "get_weather", "input": {"city": "Rome"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_b", "content": "rain"},
                   {"type": "tool_result", "tool_use_id": "toolu_a", "content": [{"type": "text", "text": "sun"}],
                    "cache_control": {"type": "ephemeral"}}]}]
    msg = client.messages.create(model="m", max_tokens=6, messages=history, tools=TOOLS, thinking=OFF,
                                 tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
    forced = client.messages.create(model="m", max_tokens=8, messages=HI, tools=TOOLS,
                                    tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    # the prompt ends inside the call: whatever the random model writes, the answer is one tool_use block
    assert [b.type for b in forced.content] == ["tool_use"]
    assert forced.content[0].id.startswith("toolu_")
    assert forced.content[0].name in ("get_weather", "malformed_tool_call")
    none = client.messages.create(model="m", max_tokens=4, messages=HI, tools=TOOLS, tool_choice={"type": "none"})
    assert all(b.type != "tool_use" for b in none.content)
    count_with = client.messages.count_tokens(model="m", messages=HI, tools=TOOLS).input_tokens
    count_without = client.messages.count_tokens(model="m", messages=HI).input_tokens
    assert count_with > count_without
    _wait_idle(live_server)


def test_errors_use_the_anthropic_envelope(client, live_server):
    cases = [
        (dict(max_tokens=0), anthropic.BadRequestError, "invalid_value", "max_tokens"),
        (dict(thinking={"type": "enabled", "budget_tokens": 100}), anthropic.BadRequestError, "invalid_value",
         "thinking.budget_tokens"),
        (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]),
         anthropic.BadRequestError, "vision_disabled", "messages[0].content[0].type"),
        (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), anthropic.BadRequestError,
         "tool_type_not_supported", "tools[0].type"),
        (dict(messages=[*HI, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "", "signature": "ninfer-reasoning.v1:%%%"},
            {"type": "text", "text": "x"}]}, {"role": "user", "content": "y"}]),
         anthropic.BadRequestError, "invalid_thinking_signature", "messages[1].content[0].signature"),
    ]
    for fields, exc, code, param in cases:
        kwargs = {"model": "m", "max_tokens": 4, "messages": HI, **fields}
        with pytest.raises(exc) as e:
            client.messages.create(**kwargs)
        assert e.value.status_code == 400
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert e.value.body["error"]["code"] == code and e.value.body["error"]["param"] == param
        assert e.value.request_id and e.value.body["request_id"] == e.value.request_id
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model="m", messages=[])
    assert e.value.body["error"]["param"] == "messages"
    assert client.messages.create(model="m", max_tokens=2, messages=HI).type == "message"  # still serving
    _wait_idle(live_server)


def test_disconnect_mid_stream_cancels_the_request(live_server):
    before = _wait_idle(live_server)["counters"]["committed_decode_tokens"]
    body = {"model": "m", "max_tokens": 4000, "messages": HI, "stream": True, "thinking": OFF, "temperature": 0}
    with httpx.stream("POST", live_server.base_url + "/v1/messages", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("event: content_block_delta"):
                break  # generation is under way: drop the connection
    load = _wait_idle(live_server)
    assert load["requests"]["admitted"] == 0
    # the engine stopped decoding long before the 4000-token budget
    assert load["counters"]["committed_decode_tokens"] - before < 1000


def test_disconnect_while_queued_releases_the_request(live_server):
    url = live_server.base_url + "/v1/messages"
    body = {"model": "m", "max_tokens": 4000, "messages": HI, "stream": True, "thinking": OFF, "temperature": 0}
    with httpx.stream("POST", url, json=body, timeout=60) as running:  # holds the only lane
        lines = running.iter_lines()  # kept open: closing the iterator would close the stream
        for line in lines:
            if line.startswith("event: content_block_delta"):
                break
        # a second stream waits in the engine FIFO; its client gives up before any byte arrives
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, timeout=httpx.Timeout(30, read=1.0))
        deadline = time.monotonic() + 20
        while True:
            load = httpx.get(live_server.base_url + "/v1/load", timeout=10).json()
            if load["requests"]["waiting"] == 0 and load["requests"]["admitted"] == 1:
                break
            assert time.monotonic() < deadline, f"the abandoned request was not released: {load}"
            time.sleep(0.05)
        assert load["requests"]["running"] == 1
        del lines
    _wait_idle(live_server)


def test_logs_hold_no_prompt_or_output(client, live_server):
    secret = "Quartz-zebra-7129 is my passphrase."
    msg = client.messages.create(model="m", max_tokens=8, system="System-osprey-4411", thinking=OFF,
                                 messages=[{"role": "user", "content": secret}], extra_body=GREEDY)
    with client.messages.stream(model="m", max_tokens=4, messages=[{"role": "user", "content": secret}]) as s:
        s.until_done()
    _wait_idle(live_server)
    log = live_server.log()
    assert "Quartz-zebra" not in log and "System-osprey" not in log
    assert _text(msg) not in log


def test_api_key_as_x_api_key(start_server):
    server = start_server("--api-key", "local-secret")
    with anthropic.Anthropic(base_url=server.base_url, api_key="local-secret", max_retries=0, timeout=120) as ok:
        assert ok.messages.create(model="m", max_tokens=2, messages=HI).type == "message"
        assert ok.messages.count_tokens(model="m", messages=HI).input_tokens > 0
    with anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0, timeout=60) as bad:
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model="m", max_tokens=2, messages=HI)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    assert e.value.request_id.startswith("req_")
    assert "local-secret" not in server.log()


def test_loading_answers_in_the_anthropic_envelope(start_server):
    server = start_server(wait_ready=False)
    seen = []
    deadline = time.monotonic() + 120
    with httpx.Client(timeout=30) as http:
        while True:
            r = http.post(server.base_url + "/v1/messages/count_tokens", json={"model": "m", "messages": HI})
            if r.status_code == 200:
                break
            seen.append(r)
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.02)
    assert seen, "the poll never saw the loading state"
    for r in seen:
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json() == {"type": "error", "error": {"type": "api_error",
                                                       "message": "The model is still loading. Retry shortly."},
                            "request_id": r.headers["request-id"]}
