"""End-to-end: the Responses API of the real `ninfer serve` (tiny Qwen3.5 artifact) through the `openai` client.

Random weights write random text, so these tests check shapes and plumbing: Items, events, usage,
stored state, and a tool loop whose calls the test itself sends as function_call Items.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from ninfer_core.testing import wait_server_idle as _wait_idle

pytestmark = pytest.mark.timeout(300)

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
NAMESPACE = {"type": "namespace", "name": "mcp__weather", "description": "Weather service",
             "tools": [{"type": "function", "name": "get_current", "description": "Weather now",
                        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]}


@pytest.fixture(scope="module")
def client(live_server):
    with openai.OpenAI(base_url=live_server.api_base, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id




def test_create_retrieve_delete(client, live_server, model_id):
    r = client.responses.with_raw_response.create(
        model=model_id, instructions="Answer concisely.", input="What is speculative decoding?",
        max_output_tokens=8, metadata={"case": "create"})
    assert r.headers["x-request-id"].startswith("req_")
    resp = r.parse()
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == model_id
    assert resp.status in ("completed", "incomplete")
    assert resp.instructions == "Answer concisely." and resp.metadata == {"case": "create"}
    assert resp.max_output_tokens == 8 and resp.store is True and resp.service_tier == "default"
    assert resp.output, "thinking is on by default, so there is at least a reasoning Item"
    assert resp.output[0].type == "reasoning" and resp.output[0].id.startswith("rs_")
    assert resp.output[0].content[0].type == "reasoning_text"
    for item in resp.output:
        assert item.type in ("reasoning", "message", "function_call")
    assert isinstance(resp.output_text, str)  # the SDK helper over message Items
    u = resp.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 8
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens >= 0
    assert 0 < u.output_tokens_details.reasoning_tokens <= u.output_tokens
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens" and resp.completed_at is None
    else:
        assert resp.completed_at is not None

    got = client.responses.retrieve(resp.id)
    assert got.model_dump() == resp.model_dump()
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(resp.id)
    assert e.value.body["code"] == "response_not_found"
    _wait_idle(live_server)


def test_stream_event_lifecycle(client, live_server, model_id):
    events = []
    with client.responses.stream(model=model_id, input="Say hello.", max_output_tokens=12,
                                 reasoning={"summary": "auto"}, include=["reasoning.encrypted_content"]) as stream:
        events.extend(stream)
    # get_final_response() wants response.completed; a random model usually runs into the limit
    # (response.incomplete), so the terminal event's Response is the final one.
    final = events[-1].response
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == sorted(e.sequence_number for e in events)
    assert len({e.sequence_number for e in events}) == len(events)
    assert "response.reasoning_summary_part.added" in kinds and "response.reasoning_text.delta" in kinds
    rs = final.output[0]
    assert rs.type == "reasoning" and rs.summary and rs.encrypted_content == rs.content[0].text
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == rs.content[0].text
    messages = [i for i in final.output if i.type == "message"]
    streamed_text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed_text == "".join(p.text for m in messages for p in m.content)
    assert final.usage.output_tokens <= 12
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    _wait_idle(live_server)


def test_stream_raw_sse_has_event_names_and_no_done(live_server, model_id):
    with httpx.stream("POST", live_server.api_base + "/responses", timeout=120,
                      json={"model": model_id, "input": "Hi", "max_output_tokens": 4, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    assert "[DONE]" not in text
    blocks = [b for b in text.split("\n\n") if b and not b.startswith(":")]
    for b in blocks:
        name, data = b.split("\n", 1)
        assert json.loads(data[len("data: "):])["type"] == name[len("event: "):]


def test_input_items_and_input_tokens(client, model_id):
    items = [{"role": "developer", "content": "Be terse.", "id": "msg_dev"},
             {"role": "user", "content": [{"type": "input_text", "text": "one"}], "id": "msg_one"},
             {"role": "user", "content": "two"}]
    resp = client.responses.create(model=model_id, input=items, max_output_tokens=2,
                                   reasoning={"effort": "none"})
    page = client.responses.input_items.list(resp.id, order="asc", limit=2)
    assert [i.id for i in page.data] == ["msg_dev", "msg_one"] and page.has_more is True
    rest = client.responses.input_items.list(resp.id, order="asc", after="msg_one")
    assert len(rest.data) == 1 and rest.data[0].id.startswith("msg_") and rest.has_more is False
    desc = client.responses.input_items.list(resp.id)
    assert [i.id for i in desc.data][-1] == "msg_dev"

    count = client.responses.input_tokens.count(model=model_id, input=items, reasoning={"effort": "none"})
    assert count.object == "response.input_tokens"
    assert count.input_tokens == resp.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_items.list(resp.id, limit=101)
    assert e.value.body["code"] == "invalid_value" and e.value.body["param"] == "limit"


def test_multi_turn_tool_loop_through_previous_response_id(client, live_server, model_id):
    tools = [WEATHER]
    first = client.responses.create(model=model_id, instructions="You are a weather bot.",
                                    input="What is the weather in Paris?", tools=tools, max_output_tokens=6)
    assert first.tools[0].name == "get_weather"
    # The client "decides" the model called the tool: it sends the call and its result as Items.
    call = {"type": "function_call", "call_id": "call_paris", "name": "get_weather",
            "arguments": json.dumps({"city": "Paris"}), "id": "fc_client_1"}
    result = {"type": "function_call_output", "call_id": "call_paris", "output": "sunny, 21 C"}
    second_input = [call, result]
    counted = client.responses.input_tokens.count(model=model_id, previous_response_id=first.id,
                                                  input=second_input, tools=tools).input_tokens
    second = client.responses.create(model=model_id, previous_response_id=first.id, input=second_input,
                                     tools=tools, max_output_tokens=6)
    assert second.previous_response_id == first.id and second.instructions is None
    # the reconstructed history (first turn's input and output) is in the prompt
    assert second.usage.input_tokens == counted > first.usage.input_tokens
    items = client.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in items.data] == ["function_call", "function_call_output"]
    assert items.data[0].id == "fc_client_1" and items.data[1].id.startswith("fco_")

    # a result for a call the history does not hold is refused, and the chain keeps working
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_id, previous_response_id=second.id, tools=tools, max_output_tokens=2,
                                input=[{"type": "function_call_output", "call_id": "call_unknown", "output": "x"}])
    assert e.value.body["code"] == "invalid_tool_history" and e.value.body["param"] == "input[0].call_id"
    third = client.responses.create(model=model_id, previous_response_id=second.id, input="Thanks!",
                                    tools=tools, max_output_tokens=2)
    # the reconstruction equals sending the whole chain explicitly (first instructions excluded)
    def replay(resp):
        return [i.model_dump(exclude_none=True) for i in resp.output]

    explicit = [{"role": "user", "content": "What is the weather in Paris?"}, *replay(first), call, result,
                *replay(second), {"role": "user", "content": "Thanks!"}]
    expected = client.responses.input_tokens.count(model=model_id, input=explicit, tools=tools).input_tokens
    assert third.usage.input_tokens == expected
    # function definitions are request configuration, not conversation Items: they are not inherited
    bare = client.responses.input_tokens.count(model=model_id, previous_response_id=second.id, input="Thanks!")
    assert bare.input_tokens < third.usage.input_tokens
    # a child of a store:false Response cannot exist
    anon = client.responses.create(model=model_id, input="x", max_output_tokens=1, store=False)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_id, previous_response_id=anon.id, input="y", max_output_tokens=1)
    assert e.value.body["code"] == "previous_response_not_found"
    _wait_idle(live_server)


def test_namespace_tool(client, model_id):
    tools = [NAMESPACE, WEATHER]
    base = client.responses.input_tokens.count(model=model_id, input="Weather in Oslo?").input_tokens
    with_tools = client.responses.input_tokens.count(model=model_id, input="Weather in Oslo?",
                                                     tools=tools).input_tokens
    assert with_tools > base
    resp = client.responses.create(
        model=model_id, tools=tools, max_output_tokens=4,
        input=[{"role": "user", "content": "Weather in Oslo?"},
               {"type": "function_call", "call_id": "call_ns", "name": "get_current", "namespace": "mcp__weather",
                "arguments": "{\"city\": \"Oslo\"}"},
               {"type": "function_call_output", "call_id": "call_ns", "output": "snow"}])
    assert resp.tools[0].type == "namespace" and resp.tools[0].name == "mcp__weather"
    listed = client.responses.input_items.list(resp.id, order="asc").data
    assert listed[1].type == "function_call" and listed[1].namespace == "mcp__weather"
    assert listed[1].name == "get_current"
    # a result asserting a different namespace is refused
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=model_id, tools=tools, max_output_tokens=1,
            input=[{"role": "user", "content": "x"},
                   {"type": "function_call", "call_id": "c", "name": "get_current", "namespace": "mcp__weather",
                    "arguments": "{}"},
                   {"type": "function_call_output", "call_id": "c", "output": "x", "namespace": "other"}])
    assert e.value.body["code"] == "invalid_tool_history"


def test_forced_function_call(client, model_id):
    resp = client.responses.create(model=model_id, input="Weather in Rome?", tools=[WEATHER],
                                   tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=24)
    # the forced call opener ends the prompt: whatever random text follows, no reasoning is produced
    assert all(i.type != "reasoning" for i in resp.output)
    assert resp.usage.output_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("kwargs,status,code,param", [
    ({"input": "x", "extra_body": {"bogus": 1}}, 400, "unknown_parameter", "bogus"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tool_type_not_supported", "tools[0].type"),
    ({"input": "x", "background": True}, 400, "background_not_supported", "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]},
     400, "vision_disabled", "input[0].content[0].type"),
    ({"input": "x", "truncation": "auto"}, 400, "truncation_not_supported", "truncation"),
    ({"input": "x", "model": "other-model"}, 404, "model_not_found", "model"),
])
def test_errors_through_the_client(client, live_server, model_id, kwargs, status, code, param):
    kwargs = dict(kwargs)
    model = kwargs.pop("model", model_id)
    with pytest.raises(openai.APIStatusError) as e:
        client.responses.create(model=model, max_output_tokens=2, **kwargs)
    assert e.value.status_code == status
    assert (e.value.body["code"], e.value.body["param"], e.value.body["type"]) == (code, param,
                                                                                  "invalid_request_error")
    assert client.responses.create(model=model_id, input="ok", max_output_tokens=1).status in ("completed",
                                                                                               "incomplete")
    _wait_idle(live_server)


def test_cancel_and_compact_refused(client, live_server, model_id):
    resp = client.responses.create(model=model_id, input="x", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(resp.id)
    assert e.value.body["code"] == "background_not_supported"
    r = httpx.post(live_server.api_base + "/responses/compact", json={"model": model_id, "input": "x"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "compaction_not_supported"


def test_abandoned_stream_is_cancelled_and_engine_returns_to_idle(client, live_server, model_id):
    stream = client.responses.create(model=model_id, input="Tell a long story.", max_output_tokens=4000,
                                     stream=True)
    rid = None
    for event in stream:
        if event.type == "response.created":
            rid = event.response.id
        if event.type in ("response.reasoning_text.delta", "response.output_text.delta"):
            break
    stream.close()
    _wait_idle(live_server)  # no request running, admitted or waiting (a session checkpoint may stay cached)
    deadline = time.monotonic() + 20
    while True:  # the cancelled Response is stored when the server notices the disconnect
        try:
            stored = client.responses.retrieve(rid)
            break
        except openai.NotFoundError:
            assert time.monotonic() < deadline, "the abandoned Response was never stored"
            time.sleep(0.05)
    assert stored.status == "cancelled"
    assert client.responses.create(model=model_id, input="ok", max_output_tokens=1).status in ("completed",
                                                                                               "incomplete")


def test_logprobs(client, model_id):
    resp = client.responses.create(model=model_id, input="Hi", max_output_tokens=6, reasoning={"effort": "none"},
                                   top_logprobs=2, include=["message.output_text.logprobs"])
    msg = next(i for i in resp.output if i.type == "message")
    records = msg.content[0].logprobs
    # no reasoning: every generated token is content, except a stop token (which has no record)
    assert len(records) == resp.usage.output_tokens - (resp.status == "completed")
    for r in records:
        assert r.logprob <= 0 and len(r.top_logprobs) == 2 and isinstance(r.bytes, list)
    events = list(client.responses.create(model=model_id, input="Hi", max_output_tokens=4, stream=True,
                                          reasoning={"effort": "none"}, top_logprobs=1))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert len(streamed) == len(done.logprobs) == events[-1].response.usage.output_tokens - (
        events[-1].type == "response.completed")


def test_server_log_holds_no_prompt_or_output_text(client, live_server, model_id):
    secret_prompt = "zebra-quartz-prompt-marker"
    secret_tool = "zebra-quartz-tool-result"
    resp = client.responses.create(
        model=model_id, instructions="zebra-quartz-instructions", max_output_tokens=6, tools=[WEATHER],
        input=[{"role": "user", "content": secret_prompt},
               {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c", "output": secret_tool}])
    out_texts = [p.text for i in resp.output if i.type in ("message", "reasoning") for p in (i.content or [])]
    log = live_server.log()
    assert "zebra-quartz" not in log
    for text in out_texts:
        if len(text.strip()) >= 8:
            assert text not in log


@pytest.mark.parametrize("tools,choice", [
    ([WEATHER], {"type": "function", "name": "get_weather"}),
    ([NAMESPACE], {"type": "function", "name": "get_current", "namespace": "mcp__weather"}),
])
def test_forced_call_streams_through_the_sdk(client, model_id, tools, choice):
    events = []
    with client.responses.stream(model=model_id, input="Weather in Rome?", tools=tools, tool_choice=choice,
                                 max_output_tokens=24, temperature=0) as stream:
        events.extend(stream)
    final = events[-1].response
    first = final.output[0]
    # the forced call comes first; random weights rarely write a readable call, so it may be the
    # decoder's malformed_tool_call telling the model how to retry
    assert first.type == "function_call" and first.call_id.startswith("call_") and first.id.startswith("fc_")
    if first.name != "malformed_tool_call":
        assert first.name == choice["name"] and first.namespace == choice.get("namespace")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                     and e.item_id == first.id)
    done = next(e for e in events if e.type == "response.function_call_arguments.done" and e.item_id == first.id)
    assert deltas == done.arguments == first.arguments
    json.loads(first.arguments)
