"""Anthropic Messages: request validation, history lowering, prompt options, count_tokens, envelope.

Over TestClient and the FakeEngine of tests/conftest.py (it records the GenerationRequest the
adapter submits, so the rendered prompt can be read back); response shapes and the SSE lifecycle
are in test_anthropic_stream.py, the real server in tests/e2e/test_e2e_anthropic.py.
"""

from __future__ import annotations

import base64

import pytest

from ninfer_core.engine.api import EngineError
from ninfer_core.protocols.anthropic_history import SIGNATURE_PREFIX, omitted_signature
from ninfer_core.protocols.anthropic_request import parse_request

PROTOCOLS = [("ops", "ninfer_core.protocols.ops"), ("anthropic", "ninfer_core.protocols.anthropic")]
HI = [{"role": "user", "content": "Hi"}]
DROP = object()
OFF = {"type": "disabled"}
TOOL = {"name": "get_weather", "description": "Weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOL2 = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}


@pytest.fixture
def app(make_app):
    def make(**options):
        return make_app(builtins=PROTOCOLS, **options)

    return make


def body_of(**fields) -> dict:
    body = {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": HI}
    for k, v in fields.items():
        if v is DROP:
            body.pop(k, None)
        else:
            body[k] = v
    return body


def post(client, path="/v1/messages", **fields):
    return client.post(path, json=body_of(**fields))


def prompt_text(ctx, engine) -> str:
    return ctx.tokenizer.decode(engine.requests[-1].prompt_ids, skip_special=False)


def check_error(r, status, type_, code=None, param=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error", "request_id"} and body["type"] == "error"
    assert body["request_id"].startswith("req_") and body["request_id"] == r.headers["request-id"]
    assert "x-request-id" not in r.headers
    err = body["error"]
    assert err["type"] == type_ and err["message"]
    assert err.get("code") == code and err.get("param") == param
    return err


def assert_serves(client, ctx):
    r = post(client)
    assert r.status_code == 200 and r.json()["type"] == "message"
    assert ctx.ingress.admitted == 0


# --- field validation -------------------------------------------------------------------------------

def _tool_history(result_blocks, between=None):
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]}]
    if between:
        msgs.append(between)
    msgs.append({"role": "user", "content": result_blocks})
    return msgs


def _result(tid, text="sunny"):
    return {"type": "tool_result", "tool_use_id": tid, "content": text}


BAD = [
    # (fields, status, code, param)
    ({"model": DROP}, 400, "missing_required_parameter", "model"),
    ({"model": 5}, 400, "invalid_type", "model"),
    ({"model": ""}, 400, "invalid_value", "model"),
    ({"messages": DROP}, 400, "missing_required_parameter", "messages"),
    ({"messages": []}, 400, "invalid_value", "messages"),
    ({"messages": "hi"}, 400, "invalid_type", "messages"),
    ({"messages": [5]}, 400, "invalid_type", "messages[0]"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "invalid_value", "messages[0].role"),
    ({"messages": [{"content": "x"}]}, 400, "missing_required_parameter", "messages[0].role"),
    ({"messages": [{"role": "user"}]}, 400, "missing_required_parameter", "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "invalid_type", "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "missing_required_parameter",
     "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, 400, "invalid_type",
     "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, 400, "missing_required_parameter",
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": ["x"]}]}, 400, "invalid_type", "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "see"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     400, "vision_disabled", "messages[0].content[1].type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400,
     "content_type_not_supported", "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "search_result"}]}]}, 400,
     "content_type_not_supported", "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "container_upload", "file_id": "f"}]}]}, 400,
     "content_type_not_supported", "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]}, 400,
     "invalid_value", "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}]}, {"role": "user", "content": "x"}]},
     400, "content_type_not_supported", "messages[1].content[0].type"),
    ({"messages": [{"role": "system", "content": [{"type": "image"}]}, *HI]}, 400, "invalid_value",
     "messages[0].content[0].type"),
    ({"max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ({"max_tokens": -1}, 400, "invalid_value", "max_tokens"),
    ({"max_tokens": "10"}, 400, "invalid_type", "max_tokens"),
    ({"max_tokens": 1.5}, 400, "invalid_type", "max_tokens"),
    ({"max_tokens": True}, 400, "invalid_type", "max_tokens"),
    ({"temperature": 1.5}, 400, "invalid_value", "temperature"),
    ({"temperature": -0.1}, 400, "invalid_value", "temperature"),
    ({"temperature": "hot"}, 400, "invalid_type", "temperature"),
    ({"top_p": 0}, 400, "invalid_value", "top_p"),
    ({"top_p": 1.5}, 400, "invalid_value", "top_p"),
    ({"top_k": -1}, 400, "invalid_value", "top_k"),
    ({"top_k": 2.5}, 400, "invalid_type", "top_k"),
    ({"stop_sequences": "END"}, 400, "invalid_type", "stop_sequences"),
    ({"stop_sequences": ["a", 3]}, 400, "invalid_type", "stop_sequences[1]"),
    ({"stop_sequences": [""]}, 400, "invalid_value", "stop_sequences[0]"),
    ({"stream": "yes"}, 400, "invalid_type", "stream"),
    ({"system": 5}, 400, "invalid_type", "system"),
    ({"system": [{"type": "image"}]}, 400, "invalid_value", "system[0].type"),
    ({"system": [{"type": "text", "text": "x", "cache_control": "yes"}]}, 400, "invalid_type",
     "system[0].cache_control"),
    ({"thinking": "on"}, 400, "invalid_type", "thinking"),
    ({"thinking": {}}, 400, "missing_required_parameter", "thinking.type"),
    ({"thinking": {"type": "sometimes"}}, 400, "invalid_value", "thinking.type"),
    ({"thinking": {"type": "enabled"}}, 400, "missing_required_parameter", "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1023}}, 400, "invalid_value", "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": "2048"}}, 400, "invalid_type", "thinking.budget_tokens"),
    ({"thinking": {"type": "adaptive", "display": "hidden"}}, 400, "invalid_value", "thinking.display"),
    ({"tools": {"name": "f"}}, 400, "invalid_type", "tools"),
    ({"tools": [{"name": "f"}]}, 400, "missing_required_parameter", "tools[0].input_schema"),
    ({"tools": [{"input_schema": {"type": "object"}}]}, 400, "missing_required_parameter", "tools[0].name"),
    ({"tools": [{**TOOL, "name": "bad name"}]}, 400, "invalid_value", "tools[0].name"),
    ({"tools": [TOOL, TOOL]}, 400, "invalid_value", "tools[1].name"),
    ({"tools": [{**TOOL, "input_schema": {"type": "array"}}]}, 400, "invalid_value", "tools[0].input_schema.type"),
    ({"tools": [{**TOOL, "input_schema": "{}"}]}, 400, "invalid_type", "tools[0].input_schema"),
    ({"tools": [{**TOOL, "description": 5}]}, 400, "invalid_type", "tools[0].description"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tool_type_not_supported",
     "tools[0].type"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, 400, "tool_type_not_supported", "tools[0].type"),
    ({"tools": [{"type": "mcp_toolset", "mcp_server_name": "x"}]}, 400, "mcp_not_supported", "tools[0].type"),
    ({"tools": [{**TOOL, "strict": True}]}, 400, "strict_tools_not_supported", "tools[0].strict"),
    ({"tools": [{**TOOL, "defer_loading": True}]}, 400, "deferred_tools_not_supported", "tools[0].defer_loading"),
    ({"tools": [{**TOOL, "allowed_callers": ["code_execution_20250825"]}]}, 400, "tool_callers_not_supported",
     "tools[0].allowed_callers"),
    ({"tools": [TOOL], "tool_choice": "auto"}, 400, "invalid_type", "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "sometimes"}}, 400, "invalid_value", "tool_choice.type"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, 400, "missing_required_parameter", "tool_choice.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_time"}}, 400, "invalid_value",
     "tool_choice.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}}, 400, "invalid_type",
     "tool_choice.disable_parallel_tool_use"),
    ({"tool_choice": {"type": "any"}}, 400, "invalid_value", "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather"},
      "thinking": {"type": "enabled", "budget_tokens": 2048}}, 400, "thinking_not_supported_with_forced_tool",
     "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "any"}, "thinking": {"type": "adaptive"}}, 400,
     "thinking_not_supported_with_forced_tool", "tool_choice"),
    ({"container": "c1"}, 400, "container_not_supported", "container"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, 400, "mcp_not_supported", "mcp_servers"),
    ({"context_management": {"edits": [{"type": "compact_20260112"}]}}, 400, "context_edit_not_supported",
     "context_management.edits[0].type"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, 400,
     "output_format_not_supported", "output_config.format"),
    ({"output_config": {"format": {"type": "yaml"}}}, 400, "invalid_value", "output_config.format.type"),
    ({"output_config": {"effort": "extreme"}}, 400, "invalid_value", "output_config.effort"),
    ({"output_format": {"type": "json_schema", "schema": {"type": "object"}}}, 400, "output_format_not_supported",
     "output_format"),
    ({"output_format": "json"}, 400, "invalid_type", "output_format"),
    ({"output_config": "high"}, 400, "invalid_type", "output_config"),
    ({"graft": "v1"}, 400, "unknown_graft", "graft"),
    ({"graft": 3}, 400, "invalid_type", "graft"),
    ({"chat_template_kwargs": []}, 400, "invalid_type", "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, 400, "invalid_value", "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": {"enable_thinking": True}, "thinking": OFF}, 400, "invalid_value",
     "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, 400, "invalid_type", "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": {"preserve_thinking": False}, "preserve_thinking": True}, 400, "invalid_value",
     "chat_template_kwargs.preserve_thinking"),
    ({"chat_template_kwargs": {"reasoning_effort": "low"}, "output_config": {"effort": "high"}}, 400,
     "invalid_value", "chat_template_kwargs.reasoning_effort"),
    ({"preserve_thinking": "yes"}, 400, "invalid_type", "preserve_thinking"),
    ({"post_thinking": {"temperature": 1.5}}, 400, "invalid_value", "post_thinking.temperature"),
    ({"post_thinking": {"top_k": "5"}}, 400, "invalid_type", "post_thinking.top_k"),
    ({"post_thinking": {"mirostat": 1}}, 400, "invalid_value", "post_thinking.mirostat"),
    ({"post_thinking": 0.2}, 400, "invalid_type", "post_thinking"),
    # assistant prefill
    ({"messages": [*HI, {"role": "assistant", "content": "Sure"}]}, 400, "assistant_prefill_not_supported",
     "messages"),
    ({"messages": [*HI, {"role": "assistant", "content": "Sure"}], "thinking": {"type": "adaptive"}}, 400,
     "assistant_prefill_not_supported", "messages"),
    ({"messages": [*HI, {"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}],
      "thinking": OFF}, 400, "assistant_prefill_not_supported", "messages[1].content[0].type"),
    ({"messages": [*HI, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}], "thinking": OFF}, 400,
     "assistant_prefill_not_supported", "messages[1].content[0].type"),
    # tool history
    ({"messages": _tool_history([_result("toolu_1")])}, 400, "invalid_tool_history", "messages[2].content[0]"),
    ({"messages": _tool_history([_result("toolu_1"), _result("toolu_9")])}, 400, "invalid_tool_history",
     "messages[2].content[1].tool_use_id"),
    ({"messages": _tool_history([_result("toolu_1"), _result("toolu_1")])}, 400, "invalid_tool_history",
     "messages[2].content[1].tool_use_id"),
    ({"messages": _tool_history([{"type": "text", "text": "here:"}, _result("toolu_1"), _result("toolu_2")])}, 400,
     "invalid_tool_history", "messages[2].content[1]"),
    ({"messages": _tool_history([_result("toolu_1"), _result("toolu_2")], {"role": "system", "content": "x"})}, 400,
     "invalid_tool_history", "messages[2]"),
    ({"messages": _tool_history("no results")}, 400, "invalid_tool_history", "messages[2].content"),
    ({"messages": [*HI, {"role": "assistant", "content": "plain"}, {"role": "user", "content": [_result("toolu_1")]}]},
     400, "invalid_tool_history", "messages[2].content[0]"),
    ({"messages": _tool_history([{"type": "tool_result", "content": "x"}])}, 400, "missing_required_parameter",
     "messages[2].content[0].tool_use_id"),
    ({"messages": _tool_history([_result("toolu_1"), {**_result("toolu_2"), "is_error": "yes"}])}, 400,
     "invalid_type", "messages[2].content[1].is_error"),
    ({"messages": _tool_history([_result("toolu_1"), {**_result("toolu_2"), "content": [{"type": "image"}]}])}, 400,
     "vision_disabled", "messages[2].content[1].content[0].type"),
    ({"messages": [*HI, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": "Paris"}]}, {"role": "user", "content": [
            _result("t1")]}]}, 400, "invalid_type", "messages[1].content[0].input"),
    ({"messages": [*HI, {"role": "assistant", "content": [
        {"type": "tool_use", "name": "get_weather", "input": {}}]}, {"role": "user", "content": "x"}]}, 400,
     "missing_required_parameter", "messages[1].content[0].id"),
    # thinking history
    ({"messages": [*HI, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "", "signature": SIGNATURE_PREFIX + "not base64!"},
        {"type": "text", "text": "A"}]}, {"role": "user", "content": "more"}]}, 400, "invalid_thinking_signature",
     "messages[1].content[0].signature"),
    ({"messages": [*HI, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "", "signature": SIGNATURE_PREFIX + base64.b64encode(b"\xff\xfe").decode()},
        {"type": "text", "text": "A"}]}, {"role": "user", "content": "more"}]}, 400, "invalid_thinking_signature",
     "messages[1].content[0].signature"),
    ({"messages": [*HI, {"role": "assistant", "content": [{"type": "thinking", "signature": "s"}]},
                   {"role": "user", "content": "more"}]}, 400, "missing_required_parameter",
     "messages[1].content[0].thinking"),
]


@pytest.mark.parametrize("fields,status,code,param", BAD)
def test_bad_input_is_a_field_specific_anthropic_error(app, fields, status, code, param):
    client, ctx, engine = app()
    check_error(post(client, **fields), status, "invalid_request_error", code, param)
    assert engine.requests == []
    assert_serves(client, ctx)


def test_malformed_bodies(app):
    client, ctx, _ = app()
    r = client.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    check_error(r, 400, "invalid_request_error", "invalid_json")
    check_error(client.post("/v1/messages", json=[1, 2]), 400, "invalid_request_error", "invalid_type")
    r = client.post("/v1/messages/count_tokens", content=b"", headers={"content-type": "application/json"})
    check_error(r, 400, "invalid_request_error", "invalid_json")
    check_error(client.get("/v1/messages"), 405, "invalid_request_error", "method_not_allowed")
    check_error(client.post("/v1/messages/batches", json={}), 404, "not_found_error", "not_found")
    assert_serves(client, ctx)


# --- envelope, headers, auth, readiness -----------------------------------------------------------------

def test_loading_answers_the_spec_envelope(app):
    client, ctx, _ = app(ready=False)
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/v1/messages"):
        r = client.post(path, json=body_of())
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json() == {"type": "error", "error": {"type": "api_error",
                                                       "message": "The model is still loading. Retry shortly."},
                            "request_id": r.headers["request-id"]}
        assert r.headers["request-id"].startswith("req_") and "x-request-id" not in r.headers
    # other routes keep the OpenAI envelope
    assert client.get("/v1/models").json()["error"]["code"] == "model_loading"
    ctx.mark_ready()
    assert_serves(client, ctx)


def test_request_id_header_and_doubled_prefix(app):
    client, ctx, engine = app()
    ids = set()
    for path in ("/v1/messages", "/v1/v1/messages"):
        r = post(client, path)
        assert r.status_code == 200 and r.headers["x-ninfer-version"]
        assert "x-request-id" not in r.headers
        ids.add(r.headers["request-id"])
        assert engine.requests[-1].request_id == r.headers["request-id"]
    r = client.post("/v1/v1/messages/count_tokens", json=body_of())
    assert r.status_code == 200 and r.headers["request-id"].startswith("req_")
    check_error(client.post("/v1/v1/messages", json=body_of(max_tokens=0)), 400, "invalid_request_error",
                "invalid_value", "max_tokens")
    ids.add(r.headers["request-id"])
    assert len(ids) == 3
    assert client.get("/v1/models").headers["x-request-id"].startswith("req_")


def test_x_api_key_and_auth_errors(app):
    client, ctx, _ = app(api_key="sekret")
    check_error(post(client), 401, "authentication_error", "invalid_api_key")
    check_error(client.post("/v1/messages", json=body_of(), headers={"x-api-key": "wrong"}), 401,
                "authentication_error", "invalid_api_key")
    r = client.post("/v1/messages", json=body_of(), headers={"x-api-key": "sekret", "anthropic-version": "2023-06-01"})
    assert r.status_code == 200
    r = client.post("/v1/messages/count_tokens", json=body_of(), headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 200


def test_cors_exposes_request_id(app):
    client, _, _ = app(cors=True)
    r = client.post("/v1/messages", json=body_of(), headers={"Origin": "http://x"})
    assert r.status_code == 200 and "request-id" in r.headers["access-control-expose-headers"]
    r = client.options("/v1/messages", headers={"Origin": "http://x", "Access-Control-Request-Method": "POST",
                                                 "Access-Control-Request-Headers": "x-api-key, anthropic-version"})
    assert r.status_code == 200 and "anthropic-version" in r.headers["access-control-allow-headers"]


def test_body_limit_is_anthropic_413(app):
    client, ctx, _ = app(max_request_mib=1)
    big = "x" * (1 << 20)
    check_error(post(client, messages=[{"role": "user", "content": big}]), 413, "request_too_large",
                "request_too_large")
    assert_serves(client, ctx)


def test_overload_is_529_and_timeouts_are_504(app):
    client, ctx, engine = app(engine_options={"max_concurrency": 1, "max_pending_requests": 0})
    ctx.ingress.acquire()
    check_error(post(client), 529, "overloaded_error", "server_overloaded")
    check_error(post(client, stream=True), 529, "overloaded_error", "server_overloaded")
    ctx.ingress.release()
    engine.submit_error = EngineError(429, "server_overloaded", "busy")
    check_error(post(client), 529, "overloaded_error", "server_overloaded")
    engine.submit_error = EngineError(400, "context_length_exceeded", "too long", "messages")
    check_error(post(client), 400, "invalid_request_error", "context_length_exceeded", "messages")
    engine.submit_error = None
    assert ctx.ingress.admitted == 0
    assert_serves(client, ctx)


# --- lowering and prompt options -------------------------------------------------------------------------

def test_system_text_and_system_messages_at_any_position(app):
    client, ctx, engine = app()
    msgs = [{"role": "system", "content": "S1"}, {"role": "user", "content": "U1"},
            {"role": "system", "content": [{"type": "text", "text": "S2", "cache_control": {"type": "ephemeral"}}]},
            {"role": "user", "content": "U2"}, {"role": "assistant", "content": "A1"},
            {"role": "system", "content": "S3"}, {"role": "user", "content": "U3"}, {"role": "system", "content": "S4"}]
    r = post(client, system=[{"type": "text", "text": "Top", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                             {"type": "text", "text": "Level"}], messages=msgs, thinking=OFF)
    assert r.status_code == 200, r.text
    text = prompt_text(ctx, engine)
    order = ["<|im_start|>system\nTopLevel<|im_end|>", "<|im_start|>system\nS1<|im_end|>",
             "<|im_start|>user\nU1<|im_end|>", "<|im_start|>system\nS2<|im_end|>", "<|im_start|>user\nU2<|im_end|>",
             "<|im_start|>assistant\nA1<|im_end|>", "<|im_start|>system\nS3<|im_end|>",
             "<|im_start|>user\nU3<|im_end|>", "<|im_start|>system\nS4<|im_end|>",
             "<|im_start|>assistant\n<think>\n\n</think>\n\n"]
    positions = [text.index(s) for s in order]
    assert positions == sorted(positions) and text.endswith(order[-1])
    # appending a system message keeps the earlier rendered prompt as a prefix
    before = engine.requests[-1].prompt_ids
    post(client, system="TopLevel", messages=msgs + [{"role": "assistant", "content": "A2"},
                                                      {"role": "system", "content": "S5"}], thinking=OFF)
    gen_prompt = ctx.tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert engine.requests[-1].prompt_ids[: len(before) - len(gen_prompt)] == before[: -len(gen_prompt)]


def test_consecutive_turns_join_without_separators(app):
    client, ctx, engine = app()
    msgs = [{"role": "user", "content": "Hel"}, {"role": "user", "content": [{"type": "text", "text": "lo"},
                                                                             {"type": "text", "text": " you"}]},
            {"role": "assistant", "content": "A"}, {"role": "assistant", "content": [{"type": "text", "text": "B"}]},
            {"role": "user", "content": "next"}]
    assert post(client, messages=msgs, thinking=OFF).status_code == 200
    text = prompt_text(ctx, engine)
    assert "<|im_start|>user\nHello you<|im_end|>" in text
    assert "<|im_start|>assistant\nAB<|im_end|>" in text and text.count("<|im_start|>assistant") == 2


def test_assistant_prefill_continues_the_turn(app):
    client, ctx, engine = app()
    msgs = [*HI, {"role": "assistant", "content": [{"type": "text", "text": "The answer <|im_end|> is"}]}]
    r = post(client, messages=msgs, thinking=OFF)
    assert r.status_code == 200, r.text
    text = prompt_text(ctx, engine)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer <|im_end|> is")
    # the prefill is caller text: a quoted control-token spelling stays text
    im_end = ctx.tokenizer.token_to_id("<|im_end|>")
    assert engine.requests[-1].prompt_ids.count(im_end) == 1
    # thinking left to the server default counts as enabled, even when that default is off
    server_off, _, engine2 = app(no_thinking=True)
    check_error(post(server_off, messages=msgs), 400, "invalid_request_error", "assistant_prefill_not_supported",
                "messages")
    assert post(server_off, messages=msgs, chat_template_kwargs={"enable_thinking": False}).status_code == 200
    assert ctx.tokenizer.decode(engine2.requests[-1].prompt_ids, skip_special=False).endswith("is")


def _thinking_turn(block):
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [block, {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                      "input": {"city": "Paris"}}]},
            {"role": "user", "content": [_result("toolu_1")]}]


def test_omitted_thinking_signature_restores_the_reasoning(app):
    client, ctx, engine = app()
    visible = {"type": "thinking", "thinking": "I should call the tool.", "signature": "opaque-anthropic-sig"}
    assert post(client, messages=_thinking_turn(visible), tools=[TOOL]).status_code == 200
    reference = engine.requests[-1].prompt_ids
    assert "<think>\nI should call the tool.\n</think>" in prompt_text(ctx, engine)
    omitted = {"type": "thinking", "thinking": "", "signature": omitted_signature("I should call the tool.")}
    assert post(client, messages=_thinking_turn(omitted), tools=[TOOL]).status_code == 200
    assert engine.requests[-1].prompt_ids == reference  # same prompt, same prefix-cache identity
    # visible text takes precedence over a NInfer signature; any other signature is non-semantic
    both = {"type": "thinking", "thinking": "I should call the tool.", "signature": omitted_signature("other")}
    assert post(client, messages=_thinking_turn(both), tools=[TOOL]).status_code == 200
    assert engine.requests[-1].prompt_ids == reference
    foreign = {"type": "thinking", "thinking": "", "signature": "EqQBCkYIBxgCKkD"}
    assert post(client, messages=_thinking_turn(foreign), tools=[TOOL]).status_code == 200
    assert "I should call the tool." not in prompt_text(ctx, engine)
    redacted = {"type": "redacted_thinking", "data": "abc"}
    assert post(client, messages=_thinking_turn(redacted), tools=[TOOL]).status_code == 200


def test_tool_results_are_matched_by_id_in_call_order(app):
    client, ctx, engine = app()
    msgs = _tool_history([{**_result("toolu_2", "rainy"), "is_error": True,
                           "cache_control": {"type": "ephemeral"}},
                          {"type": "tool_result", "tool_use_id": "toolu_1",
                           "content": [{"type": "text", "text": "sun"}, {"type": "text", "text": "ny"}]},
                          {"type": "text", "text": "Summarize."}])
    assert post(client, messages=msgs, tools=[TOOL], thinking=OFF).status_code == 200
    text = prompt_text(ctx, engine)
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n[tool error] rainy\n"
            "</tool_response><|im_end|>\n<|im_start|>user\nSummarize.<|im_end|>") in text
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in text
    # a history that begins with results is a truncated or imported conversation
    truncated = [{"role": "user", "content": [_result("toolu_x", "42"), {"type": "text", "text": "go on"}]}]
    assert post(client, messages=truncated, thinking=OFF).status_code == 200
    assert "<tool_response>\n42\n</tool_response>" in prompt_text(ctx, engine)
    after_system = [{"role": "system", "content": "S"}, *truncated]
    assert post(client, messages=after_system, thinking=OFF).status_code == 200


def test_tools_and_tool_choice(app):
    client, ctx, engine = app()
    tools = [{**TOOL, "cache_control": {"type": "ephemeral"}, "input_examples": [{"city": "Oslo"}]}, TOOL2]
    assert post(client, tools=tools).status_code == 200
    text = prompt_text(ctx, engine)
    assert '"name": "get_weather"' in text and '"input_examples": [{"city": "Oslo"}]' in text
    assert '"parameters": {"type": "object", "properties": {"city"' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")  # auto keeps the default thinking
    assert post(client, tools=tools, tool_choice={"type": "none"}).status_code == 200
    assert "get_weather" not in prompt_text(ctx, engine)
    # a forced tool ends the prompt with the call opener and turns the default thinking off
    assert post(client, tools=tools, tool_choice={"type": "tool", "name": "get_time"}).status_code == 200
    text = prompt_text(ctx, engine)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=get_time>\n")
    assert ctx.tokenizer.token_to_id("<tool_call>") in engine.requests[-1].prompt_ids
    assert engine.requests[-1].sampling.temperature == 0.7  # the non-thinking preset
    # any over one callable tool is executable; over several it is advisory (automatic selection)
    assert post(client, tools=[TOOL], tool_choice={"type": "any"}, thinking=OFF).status_code == 200
    assert prompt_text(ctx, engine).endswith("<tool_call>\n<function=get_weather>\n")
    assert post(client, tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True}).status_code == 200
    assert prompt_text(ctx, engine).endswith("<|im_start|>assistant\n<think>\n")
    assert post(client, tool_choice={"type": "auto"}).status_code == 200  # a choice without tools
    assert post(client, tool_choice={"type": "none"}).status_code == 200


def test_cache_control_marks_message_frontiers(app):
    client, ctx, engine = app()
    im_start = ctx.tokenizer.token_to_id("<|im_start|>")
    eph = {"type": "ephemeral"}

    def starts():
        return [i for i, t in enumerate(engine.requests[-1].prompt_ids) if t == im_start]

    msgs = [{"role": "user", "content": [{"type": "text", "text": "U1", "cache_control": eph}]},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
    post(client, system=[{"type": "text", "text": "S", "cache_control": {**eph, "ttl": "1h"}}], messages=msgs)
    s = starts()  # system, U1, A1, U2, the generation opener
    assert engine.requests[-1].checkpoint_hints.markers == [s[1], s[2]]
    assert engine.requests[-1].checkpoint_hints.turn_closure == s[-1]
    # tools: the end of the tools block; tool results: the end of their user turn
    hist = _tool_history([{**_result("toolu_1"), "cache_control": eph}, _result("toolu_2"),
                          {"type": "text", "text": "now?"}])
    post(client, tools=[{**TOOL, "cache_control": eph}], messages=hist)
    s = starts()  # tools, user, assistant, tool results, user text, opener
    assert engine.requests[-1].checkpoint_hints.markers == [s[1], s[4]]
    # only the latest four are kept; no hint leaves the engine to derive its own
    many = [{"role": r, "content": [{"type": "text", "text": str(i), "cache_control": eph}]}
            for i, r in enumerate(["user", "assistant"] * 3)] + [{"role": "user", "content": "last"}]
    post(client, messages=many, thinking=OFF)
    assert engine.requests[-1].checkpoint_hints.markers == starts()[3:7]
    post(client)
    assert engine.requests[-1].checkpoint_hints.markers == []  # the turn closure is still hinted


def test_hints_metadata_and_unknown_fields_are_accepted(app):
    client, ctx, engine = app()
    r = client.post("/v1/messages", headers={"anthropic-version": "2023-06-01", "anthropic-beta": "x-2025"},
                    json=body_of(metadata={"user_id": "u1"}, service_tier="auto", cache_control={"type": "ephemeral"},
                                 inference_geo="us", some_future_field={"a": 1}, graft="", top_k=100,
                                 messages=[{"role": "user", "content": [
                                     {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"},
                                      "citations": None}]}]))
    assert r.status_code == 200, r.text
    assert engine.requests[-1].sampling.top_k == 20  # clamped like the OpenAI endpoints


def test_sampling_limits_and_stops_reach_the_engine(app):
    client, ctx, engine = app()
    post(client, max_tokens=DROP)
    req = engine.requests[-1]
    assert req.max_tokens is None and req.stop == []
    assert req.sampling.temperature == 1.0 and req.sampling.top_p == 0.95  # the thinking preset
    post(client, thinking=OFF, max_tokens=7, stop_sequences=["END", "\n\nHuman:"], temperature=0.3, top_p=0.5,
         top_k=5)
    req = engine.requests[-1]
    assert req.max_tokens == 7 and req.stop == ["END", "\n\nHuman:"]
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k) == (0.3, 0.5, 5)
    assert prompt_text(ctx, engine).endswith("<think>\n\n</think>\n\n")
    post(client, thinking={"type": "enabled", "budget_tokens": 4096}, max_tokens=100)  # budget >= max_tokens is fine
    assert engine.requests[-1].max_tokens == 100 and prompt_text(ctx, engine).endswith("<think>\n")
    greedy, _, engine2 = app(engine_options={"greedy": True})
    post(greedy, temperature=0.9)
    assert engine2.requests[-1].sampling.temperature == 0.0


def test_thinking_budget_and_post_thinking_reach_the_engine(app):
    from ninfer_core.config import ThinkingOptions

    client, ctx, engine = app()
    post(client, thinking={"type": "enabled", "budget_tokens": 2048}, post_thinking={"temperature": 0.1, "top_k": 4})
    req = engine.requests[-1]
    assert req.in_reasoning and req.thinking_budget == 2048 and req.budget_close_ids
    assert req.think_end_ids == [ctx.tokenizer.token_to_id("</think>")]
    assert req.post_thinking.temperature == 0.1 and req.post_thinking.top_k == 4
    post(client, thinking={"type": "enabled", "budget_tokens": 4096}, max_tokens=100)  # above max_tokens: accepted
    assert engine.requests[-1].thinking_budget == 4096 and engine.requests[-1].max_tokens == 100
    post(client, thinking=OFF, post_thinking={"temperature": 0.1})  # a request that does not think gets no cap
    req = engine.requests[-1]
    assert not req.in_reasoning and req.thinking_budget is None and req.post_thinking is None
    # --default-thinking-budget applies to thinking requests that state no budget
    client, ctx, engine = app(thinking=ThinkingOptions(default_thinking_budget=512, default_reasoning_effort="none"))
    post(client, thinking={"type": "adaptive"})
    assert engine.requests[-1].thinking_budget == 512
    post(client, thinking={"type": "enabled", "budget_tokens": 1024})
    assert engine.requests[-1].thinking_budget == 1024
    # --default-reasoning-effort none turns the default thinking off, never an explicit choice
    post(client)
    assert not engine.requests[-1].in_reasoning and prompt_text(ctx, engine).endswith("</think>\n\n")


def test_plan_thinking_display_budget_and_effort(app):
    _, ctx, _ = app()
    plan = parse_request(body_of(thinking={"type": "enabled", "budget_tokens": 2048, "display": "omitted"},
                                 output_config={"effort": "high"}), ctx)
    assert plan.thinking and plan.display_omitted and plan.thinking_budget == 2048
    assert plan.template_kwargs["reasoning_effort"] == "high"  # the project's template accepts every value
    # a template that accepts fewer values gets the nearest one (the shared probe, ties round up)
    from qwen_format import QWEN35_TEMPLATE

    from ninfer_core.tokenizer.chat_template import ChatTemplate

    guard = ("{%- if reasoning_effort is defined and reasoning_effort not in ('low', 'medium', 'xhigh') -%}"
             "{{- raise_exception('effort') -}}{%- endif -%}")
    ctx.chat_template = ChatTemplate(guard + QWEN35_TEMPLATE)
    for sent, rendered in (("high", "xhigh"), ("max", "xhigh"), ("low", "low")):
        plan = parse_request(body_of(output_config={"effort": sent}), ctx)
        assert plan.template_kwargs["reasoning_effort"] == rendered
    plan = parse_request(body_of(thinking={"type": "adaptive"}, output_config={"effort": "medium"},
                                 preserve_thinking=True), ctx)
    assert plan.thinking and not plan.display_omitted and plan.thinking_budget is None
    assert plan.template_kwargs == {"reasoning_effort": "medium", "preserve_thinking": True}
    plan = parse_request(body_of(thinking={"type": "disabled", "budget_tokens": 5}), ctx)
    assert not plan.thinking and plan.thinking_budget is None
    plan = parse_request(body_of(chat_template_kwargs={"enable_thinking": False}), ctx)
    assert not plan.thinking
    plan = parse_request(body_of(tools=[TOOL], tool_choice={"type": "auto", "disable_parallel_tool_use": True}), ctx)
    assert plan.parallel_tool_calls is False and plan.forced_tool is None
    assert parse_request(body_of(), ctx).thinking  # the server default
    _, ctx_off, _ = app(no_thinking=True)
    assert not parse_request(body_of(), ctx_off).thinking
    assert parse_request(body_of(post_thinking={"temperature": 0.1, "top_k": 10}), ctx).post_thinking == \
        {"temperature": 0.1, "top_k": 10}


# --- count_tokens ------------------------------------------------------------------------------------------

def _count_ingress(client):
    def walk(routes):
        for r in routes:
            if hasattr(r, "original_router"):  # an included router (FastAPI >= 0.16x keeps them nested)
                yield from walk(r.original_router.routes)
            else:
                yield r

    return next(r.endpoint.ingress for r in walk(client.app.routes)
                if getattr(r, "path", "") == "/v1/messages/count_tokens")


def test_count_tokens_matches_the_generation_prompt(app):
    client, ctx, engine = app()
    fields = {"system": "Be brief.", "tools": [TOOL], "messages": _tool_history([_result("toolu_1"),
                                                                                   _result("toolu_2")])}
    assert post(client, **fields).status_code == 200
    n = len(engine.requests[-1].prompt_ids)
    r = client.post("/v1/messages/count_tokens", json=body_of(**fields))
    assert r.status_code == 200 and r.json() == {"input_tokens": n}
    # output-only fields do not change or fail a count; display does not matter
    odd = body_of(**fields, max_tokens=0, stream="x", temperature=9, stop_sequences=5,
                  output_config={"format": {"type": "json_schema", "schema": {}}})
    odd["thinking"] = {"type": "adaptive", "display": "omitted"}
    assert client.post("/v1/messages/count_tokens", json=odd).json() == {"input_tokens": n}
    # thinking mode and prefill are part of the prompt
    off = client.post("/v1/messages/count_tokens", json=body_of(**fields, thinking=OFF)).json()["input_tokens"]
    assert off == n + len(ctx.tokenizer.encode("\n</think>\n\n"))
    assert len(engine.requests) == 1  # counting never generates


def test_count_tokens_errors_and_its_own_capacity(app):
    client, ctx, _ = app(engine_options={"max_concurrency": 1, "max_pending_requests": 1})
    r = client.post("/v1/messages/count_tokens", json=body_of(messages=[{"role": "user", "content": 1}]))
    check_error(r, 400, "invalid_request_error", "invalid_type", "messages[0].content")
    r = client.post("/v1/messages/count_tokens", json=body_of(tools=[TOOL], tool_choice={"type": "any"},
                                                               thinking={"type": "enabled", "budget_tokens": 2000}))
    check_error(r, 400, "invalid_request_error", "thinking_not_supported_with_forced_tool", "tool_choice")
    counts = _count_ingress(client)
    assert counts.capacity == 2
    counts.acquire()
    counts.acquire()
    r = client.post("/v1/messages/count_tokens", json=body_of())
    check_error(r, 529, "overloaded_error", "server_overloaded")
    assert post(client).status_code == 200  # generation capacity is separate
    counts.release()
    assert client.post("/v1/messages/count_tokens", json=body_of()).status_code == 200
    assert counts.admitted == 1
    ctx.ingress.acquire()
    ctx.ingress.acquire()
    assert client.post("/v1/messages/count_tokens", json=body_of()).status_code == 200  # and the other way


def test_count_tokens_without_model_counts_for_the_served_model(app):
    """llama.cpp's server counts a body without `model` (test_sleep.py's
    test_server_sleep_token_counting_wake): the count is for the model this server serves, the same
    as with any label; a given model must still be a non-empty string, and Messages still needs it."""
    client, _, engine = app()
    named = client.post("/v1/messages/count_tokens", json=body_of())
    assert named.status_code == 200
    r = client.post("/v1/messages/count_tokens", json=body_of(model=DROP))
    assert r.status_code == 200 and r.json() == named.json()
    assert client.post("/v1/messages/count_tokens", json=body_of(model=None)).json() == named.json()
    check_error(client.post("/v1/messages/count_tokens", json=body_of(model=5)), 400, "invalid_request_error",
                "invalid_type", "model")
    check_error(client.post("/v1/messages/count_tokens", json=body_of(model="")), 400, "invalid_request_error",
                "invalid_value", "model")
    check_error(client.post("/v1/messages/count_tokens", json=body_of(model=DROP, messages=DROP)), 400,
                "invalid_request_error", "missing_required_parameter", "messages")
    check_error(post(client, model=DROP), 400, "invalid_request_error", "missing_required_parameter", "model")
    assert engine.requests == []
