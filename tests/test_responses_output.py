"""Responses output Items, the SSE event lifecycle, and local state (store, chains, resources).

Model output is forced through the FakeEngine of tests/conftest.py (`engine.pieces` are the text
deltas it replays), so Item shapes, tool-call parsing and event order are asserted exactly.
"""

from __future__ import annotations

import json

import pytest

from ninfer_core.engine.api import EngineError, EngineEvent
from ninfer_core.protocols.responses_output import SUMMARY_PLACEHOLDER

BUILTINS = [("ops", "ninfer_core.protocols.ops"), ("responses", "ninfer_core.protocols.responses")]
MODEL = "test-model"
FN = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}
NS = {"type": "namespace", "name": "mcp__weather", "description": "Weather service",
      "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
          "city": {"type": "string"}}}}]}
CALL_TEXT = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" \
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture
def app(make_app):
    def make(**options):
        return make_app(builtins=BUILTINS, **options)

    return make


def post(client, **body):
    body.setdefault("model", MODEL)
    body.setdefault("input", "Hi")
    return client.post("/v1/responses", json=body)


def prompt_text(ctx, request) -> str:
    return ctx.tokenizer.decode(request.prompt_ids, skip_special=False)


def parse_sse(text: str) -> list[dict]:
    events = []
    assert "[DONE]" not in text
    for block in text.split("\n\n"):
        if not block or block.startswith(":"):
            continue
        lines = block.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        ev = json.loads(lines[1][len("data: "):])
        assert ev["type"] == lines[0][len("event: "):]  # SSE event name == JSON type
        events.append(ev)
    seq = [e["sequence_number"] for e in events]
    assert seq == list(range(len(events)))  # monotonically increasing from 0
    terminal = [e for e in events if e["type"] in ("response.completed", "response.incomplete", "response.failed")]
    assert len(terminal) == 1 and terminal[0] is events[-1]
    return events


def types(events) -> list[str]:
    return [e["type"] for e in events]


# --- aggregate output ------------------------------------------------------------------------------

def test_reasoning_and_message_items_and_usage(app):
    client, ctx, engine = app()
    body = post(client).json()
    rs, msg = body["output"]
    assert rs["type"] == "reasoning" and rs["id"].startswith("rs_") and rs["summary"] == []
    assert rs["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert "encrypted_content" not in rs
    assert msg["type"] == "message" and msg["id"].startswith("msg_") and msg["role"] == "assistant"
    assert msg["status"] == "completed"
    assert msg["content"] == [{"type": "output_text", "text": "Hello there.", "annotations": [], "logprobs": []}]
    u = body["usage"]
    req = engine.requests[0]
    n_out = sum(len(ctx.tokenizer.encode(p)) for p in engine.pieces)
    assert u["input_tokens"] == len(req.prompt_ids) and u["output_tokens"] == n_out
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    assert u["input_tokens_details"] == {"cached_tokens": 0}
    # reasoning tokens: everything up to and including </think>, counted on token ids
    assert u["output_tokens_details"]["reasoning_tokens"] == len(ctx.tokenizer.encode("Let me think.</think>"))


def test_summary_placeholder_and_encrypted_mirror(app):
    client, _, _ = app()
    body = post(client, reasoning={"summary": "auto"}, include=["reasoning.encrypted_content"]).json()
    rs = body["output"][0]
    assert rs["summary"] == [{"type": "summary_text", "text": SUMMARY_PLACEHOLDER}]
    assert rs["encrypted_content"] == "Let me think." == rs["content"][0]["text"]
    assert body["reasoning"]["summary"] == "auto"


def test_no_reasoning_item_without_reasoning_text(app):
    client, _, engine = app()
    engine.pieces = ["Hello"]
    body = post(client, reasoning={"effort": "none"}, include=["reasoning.encrypted_content"]).json()
    assert [i["type"] for i in body["output"]] == ["message"]


def test_incomplete_at_the_output_limit(app):
    client, _, engine = app()
    engine.finish_reason = "length"
    body = post(client, max_output_tokens=30).json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["completed_at"] is None
    assert body["output"][-1]["status"] == "incomplete"


def test_reasoning_only_incomplete_has_no_invented_message(app):
    client, _, engine = app()
    engine.pieces = ["still thinking"]
    engine.finish_reason = "length"
    body = post(client).json()
    assert [i["type"] for i in body["output"]] == ["reasoning"]
    assert body["output"][0]["status"] == "incomplete"


def test_function_call_items(app):
    client, _, engine = app()
    engine.pieces = ["Hmm.", "</think>\n\n", "Let me check.\n\n", CALL_TEXT]
    body = post(client, tools=[FN]).json()
    assert [i["type"] for i in body["output"]] == ["reasoning", "message", "function_call"]
    assert body["output"][1]["content"][0]["text"] == "Let me check."
    fc = body["output"][2]
    assert fc["id"].startswith("fc_") and fc["call_id"].startswith("call_") and fc["id"] != fc["call_id"]
    assert fc["name"] == "get_weather" and "namespace" not in fc and fc["status"] == "completed"
    assert json.loads(fc["arguments"]) == {"city": "Paris", "days": 3}  # typed by the declared schema


def test_namespace_identity_restored_in_output(app):
    client, _ctx, engine = app()
    engine.pieces = ["</think>\n\n", ("<tool_call>\n<function=mcp__weather.get_weather>\n<parameter=city>\nOslo\n"
                     "</parameter>\n</function>\n</tool_call>")]
    body = post(client, tools=[NS, FN]).json()  # same function name, direct and namespaced
    fc = body["output"][-1]
    assert fc["type"] == "function_call" and fc["name"] == "get_weather" and fc["namespace"] == "mcp__weather"
    assert json.loads(fc["arguments"]) == {"city": "Oslo"}


def test_undeclared_function_stays_text_and_tool_choice_none_disables_calls(app):
    client, _, engine = app()
    engine.pieces = ["</think>\n\n", CALL_TEXT]
    body = post(client, tools=[FN], tool_choice="none").json()
    assert [i["type"] for i in body["output"]] == ["message"]
    assert "<function=get_weather>" in body["output"][0]["content"][0]["text"]
    # Spec (Function tools): only functions in the effective tool set become structured calls;
    # undeclared model output remains ordinary text.
    body = post(client, tools=[{"type": "function", "name": "other"}]).json()
    assert [i["type"] for i in body["output"]] == ["message"]
    assert "<function=get_weather>" in body["output"][0]["content"][0]["text"]


def test_forced_tool_choice_ends_prompt_with_the_opener(app):
    client, ctx, engine = app()
    engine.pieces = ["<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"]
    body = post(client, tools=[FN, {"type": "function", "name": "other"}],
                tool_choice={"type": "function", "name": "get_weather"}).json()
    text = prompt_text(ctx, engine.requests[0])
    assert text.endswith("<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>\n")  # default thinking off
    fc = body["output"][0]
    assert fc["type"] == "function_call" and fc["name"] == "get_weather"
    assert json.loads(fc["arguments"]) == {"city": "Rome"}


def test_forced_namespaced_and_required_single_tool(app):
    client, ctx, engine = app()
    engine.pieces = ["<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"]
    body = post(client, tools=[NS], tool_choice={"type": "function", "name": "get_weather",
                                                 "namespace": "mcp__weather"}).json()
    assert body["output"][0]["namespace"] == "mcp__weather"
    assert prompt_text(ctx, engine.requests[-1]).endswith("<function=mcp__weather.get_weather>\n")
    post(client, tools=[FN], tool_choice="required")
    assert prompt_text(ctx, engine.requests[-1]).endswith("<function=get_weather>\n")
    post(client, tools=[FN, NS], tool_choice={"type": "allowed_tools", "mode": "required",
                                              "tools": [{"type": "function", "name": "get_weather"}]})
    assert prompt_text(ctx, engine.requests[-1]).endswith("<tool_call>\n<function=get_weather>\n")


# --- streaming -------------------------------------------------------------------------------------

def test_stream_lifecycle(app):
    client, ctx, engine = app()
    engine.pieces = ["Hmm", " ok.", "</think>\n\n", "Hi", " there.\n\n", CALL_TEXT]
    r = post(client, stream=True, tools=[FN], reasoning={"summary": "detailed"},
             include=["reasoning.encrypted_content"])
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert types(events) == [
        "response.created", "response.in_progress",
        "response.output_item.added",
        "response.reasoning_summary_part.added", "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
        "response.content_part.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    created = events[0]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    added_rs = events[2]["item"]
    assert added_rs["summary"] == [{"type": "summary_text", "text": SUMMARY_PLACEHOLDER}]
    assert "encrypted_content" not in added_rs  # not known yet while in progress
    assert all(e["summary_index"] == 0 for e in events[3:7])
    final = events[-1]["response"]
    assert final["status"] == "completed"
    rs, msg, fc = final["output"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [d["item"] for d in done] == final["output"]
    assert rs["encrypted_content"] == "Hmm ok." and rs["summary"] == added_rs["summary"]
    # ids and indices stay stable; deltas concatenate to the terminal Item
    for e in events:
        if "item_id" in e:
            assert e["item_id"] == final["output"][e["output_index"]]["id"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Hmm ok."
    text_deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(e["delta"] for e in text_deltas) == msg["content"][0]["text"] == "Hi there."
    assert all(e["logprobs"] == [] for e in text_deltas)
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert args == fc["arguments"]
    fdone = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert fdone["arguments"] == fc["arguments"] and fdone["name"] == "get_weather"
    assert final["usage"]["output_tokens"] > 0
    assert ctx.ingress.admitted == 0
    # the stored object equals the streamed terminal Response
    assert client.get(f"/v1/responses/{final['id']}").json() == final


def test_stream_without_summary_emits_no_summary_events(app):
    client, _, _ = app()
    events = parse_sse(post(client, stream=True).text)
    assert not any("summary" in t for t in types(events))
    assert events[2]["item"]["summary"] == []


def test_stream_incomplete(app):
    client, _, engine = app()
    engine.finish_reason = "length"
    events = parse_sse(post(client, stream=True, max_output_tokens=5).text)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_stream_engine_error_becomes_response_failed(app):
    client, ctx, engine = app()
    engine.extra_events = [EngineEvent("error", error=EngineError(500, "internal_error", "device fault",
                                                                  type_="server_error"))]
    events = parse_sse(post(client, stream=True).text)
    last = events[-1]
    assert last["type"] == "response.failed"
    assert last["response"]["status"] == "failed"
    assert last["response"]["error"] == {"code": "internal_error", "message": "device fault"}
    # the Item that was streaming is closed before the terminal event
    assert events[-2]["type"] == "response.output_item.done"
    assert ctx.ingress.admitted == 0
    engine.extra_events = []
    assert post(client).status_code == 200


def test_aggregate_engine_error_is_an_http_error(app):
    client, ctx, engine = app()
    engine.extra_events = [EngineEvent("error", error=EngineError(503, "request_queue_timeout", "timed out"))]
    r = post(client)
    assert r.status_code == 503 and r.json()["error"]["code"] == "request_queue_timeout"
    assert ctx.ingress.admitted == 0


def test_submit_errors_are_http_errors_before_the_stream(app):
    client, ctx, engine = app()
    engine.submit_error = EngineError(429, "server_overloaded", "busy")
    r = post(client, stream=True)
    assert r.status_code == 429 and r.json()["error"]["code"] == "server_overloaded"
    assert ctx.ingress.admitted == 0


# --- local state -----------------------------------------------------------------------------------

def test_retrieve_delete_and_not_found(app):
    client, _, _ = app()
    body = post(client, metadata={"k": "v"}).json()
    rid = body["id"]
    assert client.get(f"/v1/responses/{rid}").json() == body
    r = client.delete(f"/v1/responses/{rid}")
    assert r.json() == {"id": rid, "object": "response.deleted", "deleted": True}
    for r in (client.get(f"/v1/responses/{rid}"), client.delete(f"/v1/responses/{rid}"),
              client.get(f"/v1/responses/{rid}/input_items")):
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "response_not_found" and r.json()["error"]["param"] == "response_id"
    r = post(client, input="again", previous_response_id=rid)
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"


def test_store_false_is_not_retrievable(app):
    client, _, engine = app()
    body = post(client, store=False).json()
    assert body["store"] is False
    assert client.get(f"/v1/responses/{body['id']}").status_code == 404
    r = post(client, input="x", previous_response_id=body["id"])
    assert r.json()["error"]["code"] == "previous_response_not_found"
    assert engine.requests[0].session_id is None  # an anonymous root


def test_retrieve_refuses_stream_recovery_and_include(app):
    client, _, _ = app()
    rid = post(client).json()["id"]
    r = client.get(f"/v1/responses/{rid}?stream=true")
    assert r.status_code == 400 and r.json()["error"]["code"] == "stream_recovery_not_supported"
    r = client.get(f"/v1/responses/{rid}?include[]=reasoning.encrypted_content")
    assert r.status_code == 400 and r.json()["error"]["code"] == "include_not_supported"
    assert client.get(f"/v1/responses/{rid}").status_code == 200


def test_cancel_and_compact_are_refused(app):
    client, _, _ = app()
    rid = post(client).json()["id"]
    r = client.post(f"/v1/responses/{rid}/cancel")
    assert r.status_code == 400 and r.json()["error"]["code"] == "background_not_supported"
    assert client.post("/v1/responses/resp_nope/cancel").status_code == 404
    r = client.post("/v1/responses/compact", json={"model": MODEL, "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "compaction_not_supported"


def test_lru_eviction_by_records(app):
    client, ctx, _ = app(response_store_max_records=2)
    ids = [post(client, input=f"q{i}").json()["id"] for i in range(3)]
    assert client.get(f"/v1/responses/{ids[0]}").status_code == 404
    assert client.get(f"/v1/responses/{ids[1]}").status_code == 200
    assert client.get(f"/v1/responses/{ids[2]}").status_code == 200
    assert len(ctx.response_store) == 2


def test_lru_touch_on_use_keeps_a_record(app):
    client, _, _ = app(response_store_max_records=2)
    a = post(client, input="a").json()["id"]
    post(client, input="b")
    assert client.get(f"/v1/responses/{a}").status_code == 200  # a becomes most recent
    post(client, input="c")
    assert client.get(f"/v1/responses/{a}").status_code == 200


def test_store_capacity_exceeded(app):
    client, _ctx, engine = app(response_store_max_mib=0)
    r = post(client)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "response_store_capacity_exceeded" and err["param"] == "store"
    assert not engine.requests
    assert post(client, store=False).status_code == 200


def test_capacity_exceeded_after_generation_fails_the_stream(app):
    client, ctx, engine = app()
    ctx.response_store.max_bytes = 3000  # the input fits; the finished Response does not
    engine.pieces = ["</think>\n\n", "x" * 4000]
    events = parse_sse(post(client, stream=True).text)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "response_store_capacity_exceeded"
    r = post(client)
    assert r.status_code == 400 and r.json()["error"]["code"] == "response_store_capacity_exceeded"
    assert len(ctx.response_store) == 0 and ctx.ingress.admitted == 0


def test_previous_response_chain_reconstructs_history(app):
    client, ctx, engine = app()
    engine.pieces = ["thought one", "</think>\n\n", CALL_TEXT]
    first = post(client, instructions="Rule A.", input="weather?", tools=[FN]).json()
    fc = first["output"][-1]
    assert fc["type"] == "function_call"
    engine.pieces = ["</think>\n\n", "It is sunny."]
    second = post(client, previous_response_id=first["id"], instructions="Rule B.", tools=[FN],
                  input=[{"type": "function_call_output", "call_id": fc["call_id"], "output": "sunny, 20C"}])
    assert second.status_code == 200, second.text
    text = prompt_text(ctx, engine.requests[-1])
    assert "Rule A." not in text and text.startswith("<|im_start|>system\n# Tools") and "Rule B." in text
    assert text.index("user\nweather?") < text.index("<function=get_weather>") < text.index("sunny, 20C")
    assert "thought one" in text  # reasoning after the last user turn is replayed
    # the chain shares one session identity derived from the root id
    assert engine.requests[0].session_id == engine.requests[1].session_id == "resp:" + first["id"]
    # input may be omitted when the parent already supplies a user query
    third = post(client, previous_response_id=second.json()["id"], input=[])
    assert third.status_code == 200
    assert engine.requests[-1].session_id == engine.requests[0].session_id


def test_tool_results_must_match_the_reconstructed_calls(app):
    client, _, engine = app()
    engine.pieces = ["</think>\n\n", CALL_TEXT]
    first = post(client, tools=[FN]).json()
    r = post(client, previous_response_id=first["id"], tools=[FN],
             input=[{"type": "function_call_output", "call_id": "call_unknown", "output": "x"}])
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_tool_history" and r.json()["error"]["param"] == "input[0].call_id"


def test_item_ids_preserved_generated_and_unique_across_the_chain(app):
    client, _, _ = app()
    first = post(client, input=[{"role": "user", "content": "a", "id": "msg_mine"}]).json()
    items = client.get(f"/v1/responses/{first['id']}/input_items").json()
    assert [i["id"] for i in items["data"]] == ["msg_mine"]
    out_id = first["output"][0]["id"]
    r = post(client, previous_response_id=first["id"], input=[{"role": "user", "content": "b", "id": out_id}])
    assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_item_id"
    r = post(client, previous_response_id=first["id"], input=[{"role": "user", "content": "b", "id": "msg_mine"}])
    assert r.json()["error"]["param"] == "input[0].id"


def test_preserve_thinking_is_inherited(app):
    client, ctx, engine = app()
    engine.pieces = ["deep thought", "</think>\n\n", "answer"]
    first = post(client, preserve_thinking=True).json()
    post(client, previous_response_id=first["id"], input="next")
    assert "deep thought" in prompt_text(ctx, engine.requests[-1])
    post(client, previous_response_id=first["id"], input="next", preserve_thinking=False)
    assert "deep thought" not in prompt_text(ctx, engine.requests[-1])
    plain = post(client).json()
    post(client, previous_response_id=plain["id"], input="next")
    assert "deep thought" not in prompt_text(ctx, engine.requests[-1])


def test_child_of_deleted_parent_stays_usable(app):
    client, ctx, engine = app()
    a = post(client, input="first").json()
    b = post(client, previous_response_id=a["id"], input="second").json()
    client.delete(f"/v1/responses/{a['id']}")
    assert post(client, previous_response_id=b["id"], input="third").status_code == 200
    text = prompt_text(ctx, engine.requests[-1])
    assert text.index("first") < text.index("second") < text.index("third")


def test_store_false_child_inherits_the_session(app):
    client, _, engine = app()
    a = post(client).json()
    post(client, previous_response_id=a["id"], input="x", store=False)
    assert engine.requests[-1].session_id == "resp:" + a["id"]


def test_input_items_listing(app):
    client, _, _ = app()
    items = [{"role": "user", "content": f"m{i}", "id": f"msg_{i}"} for i in range(5)]
    rid = post(client, input=items).json()["id"]
    listing = client.get(f"/v1/responses/{rid}/input_items").json()
    assert listing["object"] == "list" and [i["id"] for i in listing["data"]] == [f"msg_{i}" for i in (4, 3, 2, 1, 0)]
    assert listing["first_id"] == "msg_4" and listing["last_id"] == "msg_0" and listing["has_more"] is False
    assert listing["data"][0]["content"] == [{"type": "input_text", "text": "m4"}]
    page = client.get(f"/v1/responses/{rid}/input_items?order=asc&limit=2").json()
    assert [i["id"] for i in page["data"]] == ["msg_0", "msg_1"] and page["has_more"] is True
    page = client.get(f"/v1/responses/{rid}/input_items?order=asc&limit=2&after=msg_1").json()
    assert [i["id"] for i in page["data"]] == ["msg_2", "msg_3"] and page["has_more"] is True
    page = client.get(f"/v1/responses/{rid}/input_items?order=asc&after=msg_3").json()
    assert [i["id"] for i in page["data"]] == ["msg_4"] and page["has_more"] is False
    for q, code, param in (("limit=0", "invalid_value", "limit"), ("limit=101", "invalid_value", "limit"),
                           ("limit=x", "invalid_type", "limit"), ("order=up", "invalid_value", "order"),
                           ("after=msg_nope", "invalid_value", "after"),
                           ("include[]=x", "include_not_supported", "include")):
        r = client.get(f"/v1/responses/{rid}/input_items?{q}")
        assert r.status_code == 400, q
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param)


def test_input_items_are_normalized(app):
    client, _, _ = app()
    rid = post(client, input="plain string").json()["id"]
    data = client.get(f"/v1/responses/{rid}/input_items").json()["data"]
    assert len(data) == 1
    item = data[0]
    assert item["type"] == "message" and item["role"] == "user" and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "input_text", "text": "plain string"}]


# --- input token count -----------------------------------------------------------------------------

def test_input_tokens_matches_create(app):
    client, _ctx, engine = app()
    body = {"model": MODEL, "instructions": "Be brief.", "input": "Count this prompt.", "tools": [FN, NS],
            "reasoning": {"effort": "low"}}
    n = client.post("/v1/responses/input_tokens", json=body).json()
    assert n["object"] == "response.input_tokens"
    client.post("/v1/responses", json=body)
    assert n["input_tokens"] == len(engine.requests[-1].prompt_ids)
    # with a parent: the reconstructed history is counted
    rid = client.post("/v1/responses", json=body).json()["id"]
    child = {"model": MODEL, "input": "more", "previous_response_id": rid}
    n2 = client.post("/v1/responses/input_tokens", json=child).json()["input_tokens"]
    client.post("/v1/responses", json=child)
    assert n2 == len(engine.requests[-1].prompt_ids)
    # model may be omitted on the count route
    assert client.post("/v1/responses/input_tokens", json={"input": "x"}).status_code == 200


@pytest.mark.parametrize("body,code,param", [
    ({"input": "x", "thinking_budget": 5}, "unsupported_parameter", "thinking_budget"),
    ({"input": "x", "stream": True}, "unsupported_parameter", "stream"),
    ({"input": "x", "bogus": 1}, "unknown_parameter", "bogus"),
    ({"input": "x", "model": "other"}, "model_not_found", "model"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_not_found", "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "vision_disabled",
     "input[0].content[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tool_type_not_supported", "tools[0].type"),
    ({"input": "x", "truncation": "auto"}, "truncation_not_supported", "truncation"),
])
def test_input_tokens_errors(app, body, code, param):
    client, _, _ = app()
    r = client.post("/v1/responses/input_tokens", json=body)
    assert r.status_code in (400, 404)
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param)
    assert client.post("/v1/responses/input_tokens", json={"input": "x"}).status_code == 200


# --- log probabilities -----------------------------------------------------------------------------

def _with_logprobs(engine):
    """Make the FakeEngine attach a record to every token, as the engine does when asked."""
    from ninfer_core.engine.api import TokenLogprob

    plain = engine.script

    def script(request):
        events = plain(request)
        if request.logprobs is not None:
            for ev in events:
                if ev.kind == "delta":
                    ev.logprobs = [TokenLogprob(t, -0.25, [(t, -0.25), (65, -2.0)][: request.logprobs])
                                   for t in ev.token_ids]
        return events

    engine.script = script


def test_logprobs_on_the_output_text_part(app):
    client, ctx, engine = app()
    _with_logprobs(engine)
    body = post(client, top_logprobs=2).json()
    part = body["output"][-1]["content"][0]
    tok = ctx.tokenizer
    # records cover the content channel only: "Hello there." after the reasoning and its close
    expected = tok.encode("Hello") + tok.encode(" there.")
    assert [r["token"] for r in part["logprobs"]] == [tok.decode([t]) for t in expected]
    first = part["logprobs"][0]
    assert first["logprob"] == -0.25 and first["bytes"] == list(b"H")
    assert first["top_logprobs"] == [{"token": "H", "logprob": -0.25, "bytes": list(b"H")},
                                     {"token": "A", "logprob": -2.0, "bytes": [65]}]
    body = post(client, include=["message.output_text.logprobs"]).json()
    assert all(r["top_logprobs"] == [] for r in body["output"][-1]["content"][0]["logprobs"])
    assert post(client).json()["output"][-1]["content"][0]["logprobs"] == []


def test_logprobs_travel_with_stream_deltas_without_bytes(app):
    client, _ctx, engine = app()
    _with_logprobs(engine)
    events = parse_sse(post(client, stream=True, top_logprobs=1).text)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    streamed = [r for e in deltas for r in e["logprobs"]]
    assert streamed == done["logprobs"] and streamed
    assert all("bytes" not in r and all("bytes" not in t for t in r["top_logprobs"]) for r in streamed)
    assert "".join(r["token"] for r in streamed) == done["text"] == "Hello there."
    final = events[-1]["response"]["output"][-1]["content"][0]
    assert [r["token"] for r in final["logprobs"]] == [r["token"] for r in streamed]
    assert all("bytes" in r for r in final["logprobs"])
