"""Responses create: every validation rule of the spec's tables (status, code, param) and the prompt it renders.

Over TestClient and the FakeEngine of tests/conftest.py (it records each GenerationRequest and
replays scripted text); the real engine and model are exercised by tests/e2e.
"""

from __future__ import annotations

import pytest

BUILTINS = [("ops", "ninfer_core.protocols.ops"), ("responses", "ninfer_core.protocols.responses")]
MODEL = "test-model"


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


FN = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]}}
FN2 = {"type": "function", "name": "get_time"}
NS = {"type": "namespace", "name": "mcp__weather", "description": "Weather service",
      "tools": [{"type": "function", "name": "get_current", "parameters": {"type": "object", "properties": {
          "city": {"type": "string"}}}}]}
USER = {"role": "user", "content": "Hi"}


def call(cid, name="get_weather", **extra):
    return {"type": "function_call", "call_id": cid, "name": name, "arguments": '{"city": "Paris"}', **extra}


def result(cid, output="sunny", **extra):
    return {"type": "function_call_output", "call_id": cid, "output": output, **extra}


BAD = [
    # top level
    ({"bogus": 1}, 400, "unknown_parameter", "bogus"),
    ({"model": None}, 400, "missing_required_parameter", "model"),
    ({"model": 5}, 400, "invalid_type", "model"),
    ({"model": ""}, 400, "invalid_value", "model"),
    ({"model": "other"}, 404, "model_not_found", "model"),
    ({"input": 5}, 400, "invalid_type", "input"),
    ({"input": None}, 400, "missing_required_parameter", "input"),
    ({"input": []}, 400, "missing_required_parameter", "input"),
    ({"instructions": 5}, 400, "invalid_type", "instructions"),
    ({"previous_response_id": "resp_missing"}, 400, "previous_response_not_found", "previous_response_id"),
    ({"previous_response_id": ""}, 400, "invalid_value", "previous_response_id"),
    ({"max_output_tokens": -1}, 400, "invalid_value", "max_output_tokens"),
    ({"max_output_tokens": "5"}, 400, "invalid_type", "max_output_tokens"),
    ({"max_output_tokens": True}, 400, "invalid_type", "max_output_tokens"),
    ({"stream": "yes"}, 400, "invalid_type", "stream"),
    ({"store": 1}, 400, "invalid_type", "store"),
    ({"temperature": 2.5}, 400, "invalid_value", "temperature"),
    ({"temperature": "hot"}, 400, "invalid_type", "temperature"),
    ({"top_p": 1.5}, 400, "invalid_value", "top_p"),
    ({"top_p": -0.1}, 400, "invalid_value", "top_p"),
    ({"metadata": []}, 400, "invalid_type", "metadata"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "invalid_value", "metadata"),
    ({"metadata": {"k" * 65: "v"}}, 400, "invalid_value", "metadata." + "k" * 65),
    ({"metadata": {"k": "v" * 513}}, 400, "invalid_value", "metadata.k"),
    ({"metadata": {"k": 5}}, 400, "invalid_type", "metadata.k"),
    ({"client_metadata": "trace"}, 400, "invalid_type", "client_metadata"),
    ({"reasoning": "high"}, 400, "invalid_type", "reasoning"),
    ({"reasoning": {"effort": "huge"}}, 400, "invalid_value", "reasoning.effort"),
    ({"reasoning": {"effort": 3}}, 400, "invalid_type", "reasoning.effort"),
    ({"reasoning": {"summary": "short"}}, 400, "invalid_value", "reasoning.summary"),
    ({"reasoning": {"summary": "auto", "generate_summary": "detailed"}}, 400, "invalid_value",
     "reasoning.generate_summary"),
    ({"reasoning": {"context": "all"}}, 400, "reasoning_option_not_supported", "reasoning.context"),
    ({"reasoning": {"mode": "deep"}}, 400, "reasoning_option_not_supported", "reasoning.mode"),
    ({"reasoning": {"depth": 3}}, 400, "unknown_parameter", "reasoning.depth"),
    ({"reasoning": {"effort": "none"}, "chat_template_kwargs": {"enable_thinking": True}}, 400, "invalid_value",
     "reasoning.effort"),
    ({"chat_template_kwargs": "x"}, 400, "invalid_type", "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, 400, "invalid_value", "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, 400, "invalid_type",
     "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": {"reasoning_effort": "low"}, "reasoning": {"effort": "high"}}, 400, "invalid_value",
     "chat_template_kwargs.reasoning_effort"),
    ({"preserve_thinking": True, "chat_template_kwargs": {"preserve_thinking": False}}, 400, "invalid_value",
     "chat_template_kwargs.preserve_thinking"),
    ({"preserve_thinking": "yes"}, 400, "invalid_type", "preserve_thinking"),
    ({"graft": "summarizer"}, 400, "unknown_graft", "graft"),
    ({"graft": 5}, 400, "invalid_type", "graft"),
    ({"thinking_budget": 0}, 400, "invalid_value", "thinking_budget"),
    ({"thinking_budget": "many"}, 400, "invalid_type", "thinking_budget"),
    ({"post_thinking": {"temperature": 5}}, 400, "invalid_value", "post_thinking.temperature"),
    ({"post_thinking": {"temperature": "hot"}}, 400, "invalid_type", "post_thinking.temperature"),
    ({"post_thinking": {"mood": 1}}, 400, "unknown_parameter", "post_thinking.mood"),
    ({"post_thinking": 0.2}, 400, "invalid_type", "post_thinking"),
    ({"text": "plain"}, 400, "invalid_type", "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, 400, "response_format_not_supported",
     "text.format"),
    ({"text": {"format": {"type": "json_object"}}}, 400, "response_format_not_supported", "text.format"),
    ({"text": {"format": {"type": "xml"}}}, 400, "invalid_value", "text.format.type"),
    ({"text": {"verbosity": "low"}}, 400, "verbosity_not_supported", "text.verbosity"),
    ({"text": {"style": "terse"}}, 400, "unknown_parameter", "text.style"),
    ({"max_tool_calls": -1}, 400, "invalid_value", "max_tool_calls"),
    ({"truncation": "auto"}, 400, "truncation_not_supported", "truncation"),
    ({"truncation": "sometimes"}, 400, "invalid_value", "truncation"),
    ({"top_logprobs": 21}, 400, "invalid_value", "top_logprobs"),
    ({"include": "reasoning.encrypted_content"}, 400, "invalid_type", "include"),
    ({"include": ["reasoning.encrypted_content", "file_search_call.results"]}, 400, "include_not_supported",
     "include[1]"),
    ({"include": [3]}, 400, "invalid_type", "include[0]"),
    ({"service_tier": "flex"}, 400, "service_tier_not_supported", "service_tier"),
    ({"service_tier": 1}, 400, "invalid_type", "service_tier"),
    ({"background": True}, 400, "background_not_supported", "background"),
    ({"background": "no"}, 400, "invalid_type", "background"),
    ({"stream_options": {"include_usage": True}}, 400, "unknown_parameter", "stream_options.include_usage"),
    ({"stream_options": {"include_obfuscation": "no"}}, 400, "invalid_type", "stream_options.include_obfuscation"),
    ({"stream_options": 1}, 400, "invalid_type", "stream_options"),
    ({"conversation": "conv_1"}, 400, "conversation_not_supported", "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, 400, "prompt_not_supported", "prompt"),
    ({"context_management": [{"type": "compaction"}]}, 400, "context_management_not_supported",
     "context_management"),
    ({"prompt_cache_retention": "forever"}, 400, "invalid_value", "prompt_cache_retention"),
    ({"prompt_cache_options": "x"}, 400, "invalid_type", "prompt_cache_options"),
    ({"prompt_cache_key": 5}, 400, "invalid_type", "prompt_cache_key"),
    ({"safety_identifier": "x" * 513}, 400, "invalid_value", "safety_identifier"),
    ({"user": 5}, 400, "invalid_type", "user"),
    # tools
    ({"tools": "get_weather"}, 400, "invalid_type", "tools"),
    ({"tools": [5]}, 400, "invalid_type", "tools[0]"),
    ({"tools": [{"type": "web_search"}]}, 400, "tool_type_not_supported", "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, 400, "tool_type_not_supported", "tools[0].type"),
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, 400, "tool_type_not_supported", "tools[0].type"),
    ({"tools": [{"type": "custom", "name": "x"}]}, 400, "tool_type_not_supported", "tools[0].type"),
    ({"tools": [{"type": "gadget"}]}, 400, "invalid_value", "tools[0].type"),
    ({"tools": [{"name": "x"}]}, 400, "missing_required_parameter", "tools[0].type"),
    ({"tools": [{"type": "function"}]}, 400, "missing_required_parameter", "tools[0].name"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, 400, "invalid_value", "tools[0].name"),
    ({"tools": [{"type": "function", "name": "a.b"}]}, 400, "invalid_value", "tools[0].name"),
    ({"tools": [{**FN, "strict": True}]}, 400, "strict_tools_not_supported", "tools[0].strict"),
    ({"tools": [{**FN, "strict": "yes"}]}, 400, "invalid_type", "tools[0].strict"),
    ({"tools": [{**FN, "defer_loading": True}]}, 400, "tool_option_not_supported", "tools[0].defer_loading"),
    ({"tools": [{**FN, "output_schema": {"type": "string"}}]}, 400, "tool_option_not_supported",
     "tools[0].output_schema"),
    ({"tools": [{**FN, "allowed_callers": ["programmatic"]}]}, 400, "tool_option_not_supported",
     "tools[0].allowed_callers"),
    ({"tools": [{**FN, "parameters": "city"}]}, 400, "invalid_type", "tools[0].parameters"),
    ({"tools": [{**FN, "description": 5}]}, 400, "invalid_type", "tools[0].description"),
    ({"tools": [{**FN, "function": {}}]}, 400, "unknown_parameter", "tools[0].function"),
    ({"tools": [FN, FN]}, 400, "duplicate_tool", "tools[1].name"),
    ({"tools": [{**NS, "tools": [NS["tools"][0], NS["tools"][0]]}]}, 400, "duplicate_tool", "tools[0].tools[1].name"),
    ({"tools": [{**NS, "tools": []}]}, 400, "invalid_value", "tools[0].tools"),
    ({"tools": [{**NS, "name": "bad ns"}]}, 400, "invalid_value", "tools[0].name"),
    ({"tools": [{**NS, "tools": [{"type": "custom", "name": "x"}]}]}, 400, "tool_type_not_supported",
     "tools[0].tools[0].type"),
    ({"tools": [{**NS, "tools": [{"type": "function", "name": "x", "strict": True}]}]}, 400,
     "strict_tools_not_supported", "tools[0].tools[0].strict"),
    ({"tools": [{**NS, "extra": 1}]}, 400, "unknown_parameter", "tools[0].extra"),
    # tool_choice
    ({"tools": [FN], "tool_choice": "sometimes"}, 400, "invalid_value", "tool_choice"),
    ({"tools": [FN], "tool_choice": 5}, 400, "invalid_type", "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "function", "name": "nope"}}, 400, "invalid_value", "tool_choice.name"),
    ({"tools": [NS], "tool_choice": {"type": "function", "name": "get_current"}}, 400, "invalid_value",
     "tool_choice.name"),
    ({"tools": [FN], "tool_choice": {"type": "function"}}, 400, "missing_required_parameter", "tool_choice.name"),
    ({"tools": [FN], "tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice_not_supported",
     "tool_choice.type"),
    ({"tools": [FN, FN2], "tool_choice": "required"}, 400, "tool_choice_not_supported", "tool_choice"),
    ({"tool_choice": "required"}, 400, "invalid_value", "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "allowed_tools", "mode": "often", "tools": []}}, 400, "invalid_value",
     "tool_choice.mode"),
    ({"tools": [FN], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": "get_weather"}}, 400,
     "invalid_type", "tool_choice.tools"),
    ({"tools": [FN], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "mcp"}]}}, 400,
     "tool_choice_not_supported", "tool_choice.tools[0].type"),
    ({"tools": [FN, FN2], "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [
        {"type": "function", "name": "get_weather"}, {"type": "function", "name": "get_time"}]}}, 400,
     "tool_choice_not_supported", "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "function", "name": "get_weather"},
      "chat_template_kwargs": {"enable_thinking": True}}, 400, "tool_choice_not_supported", "tool_choice"),
    ({"tools": [FN], "parallel_tool_calls": False}, 400, "parallel_tool_calls_not_supported", "parallel_tool_calls"),
    ({"parallel_tool_calls": "no"}, 400, "invalid_type", "parallel_tool_calls"),
    # Items
    ({"input": [5]}, 400, "invalid_type", "input[0]"),
    ({"input": [{"type": "hologram"}]}, 400, "invalid_value", "input[0].type"),
    ({"input": [{"content": "x"}]}, 400, "missing_required_parameter", "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "item_type_not_supported", "input[0].type"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "item_type_not_supported", "input[0].type"),
    ({"input": [{"type": "message", "content": "x"}]}, 400, "missing_required_parameter", "input[0].role"),
    ({"input": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value", "input[0].role"),
    ({"input": [{"role": "user"}]}, 400, "missing_required_parameter", "input[0].content"),
    ({"input": [{"role": "user", "content": 5}]}, 400, "invalid_type", "input[0].content"),
    ({"input": [{"role": "user", "content": [5]}]}, 400, "invalid_type", "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, 400, "missing_required_parameter",
     "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]}, 400, "invalid_type",
     "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": [{"text": "x"}]}]}, 400, "missing_required_parameter",
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                              {"type": "input_image", "image_url": "data:,"}]}]}, 400,
     "vision_disabled", "input[0].content[1].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_video", "video_url": "data:,"}]}]}, 400,
     "vision_disabled", "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400,
     "content_type_not_supported", "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400, "content_type_not_supported",
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]}, 400, "invalid_value",
     "input[0].content[0].type"),
    ({"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, 400,
     "invalid_value", "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "widget"}]}]}, 400, "invalid_value", "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x",
                                              "prompt_cache_breakpoint": {"mode": "implicit"}}]}]}, 400,
     "invalid_value", "input[0].content[0].prompt_cache_breakpoint"),
    ({"input": [{"role": "user", "content": "x", "status": 5}]}, 400, "invalid_type", "input[0].status"),
    ({"input": [USER, {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]}]}, 400,
     "invalid_value", "input[1].content"),
    ({"input": [USER, {"type": "reasoning", "encrypted_content": "x", "summary": []}]}, 400, "invalid_value",
     "input[1].content"),
    ({"input": [USER, {"type": "reasoning", "content": [{"type": "summary_text", "text": "s"}]}]}, 400,
     "invalid_value", "input[1].content[0]"),
    ({"input": [USER, {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "t"}],
                       "summary": "s"}]}, 400, "invalid_type", "input[1].summary"),
    ({"input": [USER, {"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "missing_required_parameter",
     "input[1].call_id"),
    ({"input": [USER, {"type": "function_call", "call_id": "c", "arguments": "{}"}]}, 400,
     "missing_required_parameter", "input[1].name"),
    ({"input": [USER, {"type": "function_call", "call_id": "c", "name": "f"}]}, 400, "missing_required_parameter",
     "input[1].arguments"),
    ({"input": [USER, call("c", arguments="{bad")]}, 400, "invalid_value", "input[1].arguments"),
    ({"input": [USER, call("c", arguments="[1]")]}, 400, "invalid_value", "input[1].arguments"),
    ({"input": [USER, call("c", arguments={"city": "x"})]}, 400, "invalid_type", "input[1].arguments"),
    ({"input": [USER, call("c", status="in_progress")]}, 400, "invalid_value", "input[1].status"),
    ({"input": [USER, call("c", namespace=5)]}, 400, "invalid_type", "input[1].namespace"),
    ({"input": [USER, call("c"), result("c", output=5)]}, 400, "invalid_type", "input[2].output"),
    ({"input": [USER, call("c"), result("c", output=[])]}, 400, "invalid_value", "input[2].output"),
    ({"input": [USER, call("c"), result("c", output=[{"type": "input_file", "file_id": "f"}])]}, 400,
     "content_type_not_supported", "input[2].output[0].type"),
    ({"input": [USER, call("c"), result("c", output=[{"type": "output_text", "text": "x"}])]}, 400,
     "invalid_value", "input[2].output[0].type"),
    ({"input": [USER, call("c"), result("c", output=[{"type": "input_image", "image_url": "data:,"}])]}, 400,
     "vision_disabled", "input[2].output[0].type"),
    ({"input": [USER, call("c"), {"type": "function_call_output", "call_id": "c"}]}, 400,
     "missing_required_parameter", "input[2].output"),
    ({"input": [{**USER, "id": "m1"}, {**USER, "id": "m1"}]}, 400, "duplicate_item_id", "input[1].id"),
    ({"input": [{**USER, "id": 7}]}, 400, "invalid_type", "input[0].id"),
    # assistant history order
    ({"input": [USER, call("c"), {"role": "assistant", "content": "late"}]}, 400, "invalid_assistant_history",
     "input[2]"),
    ({"input": [USER, {"role": "assistant", "content": "text"},
                {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "t"}]}]}, 400,
     "invalid_assistant_history", "input[2]"),
    ({"input": [USER, call("c"), {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "t"}]}]}, 400,
     "invalid_assistant_history", "input[2]"),
    # tool results
    ({"input": [USER, call("c1"), result("c2")]}, 400, "invalid_tool_history", "input[2].call_id"),
    ({"input": [USER, result("c1")]}, 400, "invalid_tool_history", "input[1].call_id"),
    ({"input": [USER, call("c1"), result("c1"), result("c1")]}, 400, "invalid_tool_history", "input[3].call_id"),
    ({"input": [USER, call("c1"), call("c2"), result("c2"), USER]}, 400, "invalid_tool_history", "input[3]"),
    ({"input": [USER, call("c1"), result("c1", name="other")]}, 400, "invalid_tool_history", "input[2].name"),
    ({"input": [USER, call("c1", namespace="ns"), result("c1", namespace="other")]}, 400, "invalid_tool_history",
     "input[2].namespace"),
    ({"input": [USER, call("c1"), USER, result("c1")]}, 400, "invalid_tool_history", "input[3].call_id"),
]


@pytest.mark.parametrize("body,status,code,param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_create_requests(app, body, status, code, param):
    client, ctx, engine = app()
    r = post(client, **body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    assert err["param"] == param, err
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert err["message"]
    assert not engine.requests  # nothing reached the engine
    assert ctx.ingress.admitted == 0
    ok = post(client)  # the server keeps serving
    assert ok.status_code == 200 and ok.json()["status"] == "completed"


def test_rejected_value_is_named_ascii_escaped_and_truncated(app):
    client, _, _ = app()
    r = post(client, tools=[{"type": "function", "name": "caf\u00e9 " + "x" * 200}])
    err = r.json()["error"]
    assert err["param"] == "tools[0].name"
    assert "caf\\u00e9" in err["message"] and "..." in err["message"]
    assert "tools[0].name" in err["message"]
    r = post(client, metadata={"k": "v" * 600})
    assert "600 characters" in r.json()["error"]["message"]


def test_malformed_body(app):
    client, _, _ = app()
    r = client.post("/v1/responses", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = client.post("/v1/responses", json=[1])
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_type"


ACCEPTED = [
    {"client_metadata": {"trace": "abc"}},
    {"client_metadata": None},
    {"stream_options": {"include_obfuscation": False}},
    {"max_tool_calls": 3},
    {"truncation": "disabled"},
    {"service_tier": "auto"},
    {"service_tier": "default"},
    {"background": False},
    {"include": []},
    {"include": ["reasoning.encrypted_content"]},
    {"top_logprobs": 0},
    {"graft": None},
    {"thinking_budget": None},
    {"prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit"},
     "safety_identifier": "s", "user": "u"},
    {"metadata": {"a": "b"}},
    {"reasoning": {"summary": "auto", "generate_summary": "auto"}},
    {"reasoning": {"effort": "high", "context": None}},
    {"text": {"format": {"type": "text"}, "verbosity": "medium"}},
    {"temperature": 0, "top_p": 0},
    {"max_output_tokens": 0},
    {"conversation": None},
    {"tools": [FN], "parallel_tool_calls": True},
    {"tools": [FN], "tool_choice": "none", "parallel_tool_calls": False},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x",
                                             "prompt_cache_breakpoint": {"mode": "explicit"}}],
                "status": "completed", "phase": "final"}]},
]


@pytest.mark.parametrize("body", ACCEPTED, ids=[str(i) for i in range(len(ACCEPTED))])
def test_accepted_fields(app, body):
    client, _, _ = app()
    r = post(client, **body)
    assert r.status_code == 200, r.text


def test_response_object_echoes_request(app):
    client, _ctx, engine = app()
    r = post(client, instructions="Be brief.", metadata={"a": "b"}, temperature=0.5, top_p=0.5,
             max_output_tokens=50, max_tool_calls=2, prompt_cache_key="pk", user="u", safety_identifier="s",
             reasoning={"effort": "low", "summary": "concise"}, service_tier="auto", tools=[FN, NS])
    body = r.json()
    assert body["object"] == "response" and body["id"].startswith("resp_")
    assert body["status"] == "completed" and isinstance(body["completed_at"], int)
    assert body["model"] == MODEL and body["instructions"] == "Be brief."
    assert body["metadata"] == {"a": "b"} and body["temperature"] == 0.5 and body["top_p"] == 0.5
    assert body["max_output_tokens"] == 50 and body["max_tool_calls"] == 2
    assert body["reasoning"] == {"effort": "low", "summary": "concise"}
    assert body["service_tier"] == "default" and body["truncation"] == "disabled" and body["store"] is True
    assert body["prompt_cache_key"] == "pk" and body["user"] == "u" and body["safety_identifier"] == "s"
    assert body["parallel_tool_calls"] is True and body["tool_choice"] == "auto"
    assert [t["type"] for t in body["tools"]] == ["function", "namespace"]
    assert body["tools"][1]["tools"][0]["name"] == "get_current"
    assert body["error"] is None and body["incomplete_details"] is None
    assert "output_text" not in body  # an SDK convenience, not a wire field
    req = engine.requests[0]
    assert req.max_tokens == 50 and req.sampling.temperature == 0.5 and req.sampling.top_p == 0.5


def test_max_output_tokens_omitted_is_null_and_uses_default_limit(app):
    client, _, engine = app()
    body = post(client).json()
    assert body["max_output_tokens"] is None
    assert engine.requests[0].max_tokens is None


def test_string_input_and_instructions_render_in_order(app):
    client, ctx, engine = app()
    post(client, instructions="Be brief.", input="What is 2+2?")
    text = prompt_text(ctx, engine.requests[0])
    assert text.index("<|im_start|>system\nBe brief.") < text.index("<|im_start|>user\nWhat is 2+2?")
    assert text.endswith("<|im_start|>assistant\n<think>\n")


def test_system_and_developer_items_keep_their_positions(app):
    client, ctx, engine = app()
    post(client, input=[{"role": "user", "content": "one"}, {"role": "developer", "content": "mid rule"},
                        {"role": "user", "content": "two"}])
    text = prompt_text(ctx, engine.requests[0])
    assert text.index("user\none") < text.index("system\nmid rule") < text.index("user\ntwo")


def test_reasoning_effort_none_disables_thinking(app):
    client, ctx, engine = app()
    post(client, reasoning={"effort": "none"})
    assert prompt_text(ctx, engine.requests[0]).endswith("<think>\n\n</think>\n\n")


def test_assistant_group_renders_reasoning_content_calls_and_reorders_results(app):
    client, ctx, engine = app()
    items = [USER,
             {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "need weather"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."},
                                               {"type": "refusal", "refusal": " (no refusal)"}]},
             call("c1"), call("c2", name="get_time", arguments="{}"),
             result("c2", output=[{"type": "input_text", "text": "noon"}]), result("c1", output="sunny")]
    r = post(client, input=items, tools=[FN, FN2])
    assert r.status_code == 200, r.text
    text = prompt_text(ctx, engine.requests[0])
    turn = text[text.index("<|im_start|>assistant\n"):]
    assert turn.startswith("<|im_start|>assistant\n<think>\nneed weather\n</think>\n\nChecking. (no refusal)")
    assert turn.index("<function=get_weather>") < turn.index("<function=get_time>")
    # results are rendered in call declaration order, whatever order the client sent
    assert text.index("<tool_response>\nsunny") < text.index("<tool_response>\nnoon")


def test_lenient_assistant_history_joins_the_turn(app):
    client, ctx, engine = app(lenient_assistant_history=True)
    r = post(client, input=[USER, call("c1"), {"role": "assistant", "content": "late words"}, result("c1")],
             tools=[FN])
    assert r.status_code == 200, r.text
    text = prompt_text(ctx, engine.requests[0])
    assert text.index("late words") < text.index("<function=get_weather>")


def test_calls_without_results_then_user_are_accepted(app):
    client, _, _ = app()
    assert post(client, input=[USER, call("c1"), USER]).status_code == 200


def test_namespace_calls_in_history_render_with_their_identity(app):
    client, ctx, engine = app()
    r = post(client, tools=[NS], input=[USER, call("c1", name="get_current", namespace="mcp__weather"),
                                        result("c1", name="get_current", namespace="mcp__weather")])
    assert r.status_code == 200, r.text
    text = prompt_text(ctx, engine.requests[0])
    assert '"name": "mcp__weather.get_current"' in text
    assert "<function=mcp__weather.get_current>" in text
    assert "Weather service" in text


def test_tool_choice_none_renders_no_tools(app):
    client, ctx, engine = app()
    post(client, tools=[FN], tool_choice="none")
    assert "<tools>" not in prompt_text(ctx, engine.requests[0])


def test_allowed_tools_filters_the_rendered_set(app):
    client, ctx, engine = app()
    r = post(client, tools=[FN, FN2], tool_choice={"type": "allowed_tools", "mode": "auto",
                                                     "tools": [{"type": "function", "name": "get_time"}]})
    assert r.status_code == 200, r.text
    text = prompt_text(ctx, engine.requests[0])
    assert '"name": "get_time"' in text and "get_weather" not in text
    assert r.json()["tool_choice"]["type"] == "allowed_tools"


def test_prompt_cache_breakpoints_do_not_change_the_prompt(app):
    client, _ctx, engine = app()
    post(client, input="same text")
    post(client, input=[{"role": "user", "content": [{"type": "input_text", "text": "same text",
                                                      "prompt_cache_breakpoint": {"mode": "explicit"}}]}])
    assert engine.requests[0].prompt_ids == engine.requests[1].prompt_ids


def test_template_kwargs_and_preserve_thinking_reach_the_template(app):
    client, ctx, engine = app()
    hist = [{"role": "user", "content": "q1"},
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "old thought"}]},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    post(client, input=hist)
    assert "old thought" not in prompt_text(ctx, engine.requests[-1])
    post(client, input=hist, preserve_thinking=True)
    assert "old thought" in prompt_text(ctx, engine.requests[-1])
    post(client, input=hist, chat_template_kwargs={"preserve_thinking": True})
    assert "old thought" in prompt_text(ctx, engine.requests[-1])


def test_thinking_budget_and_post_thinking_reach_the_engine(app):
    client, _ctx, engine = app()
    post(client, thinking_budget=256, post_thinking={"temperature": 0.3})
    req = engine.requests[-1]
    assert req.thinking_budget == 256 and req.budget_close_ids and req.in_reasoning
    assert req.post_thinking is not None and req.post_thinking.temperature == 0.3
    post(client, thinking_budget=256, reasoning={"effort": "none"})  # a request that does not think: no cap
    req = engine.requests[-1]
    assert req.thinking_budget is None and not req.in_reasoning


def test_logprob_requests_reach_the_engine(app):
    client, _, engine = app()
    post(client, top_logprobs=4)
    assert engine.requests[-1].logprobs == 4
    post(client, include=["message.output_text.logprobs"])
    assert engine.requests[-1].logprobs == 0
    post(client)
    assert engine.requests[-1].logprobs is None  # a request that does not ask gathers nothing


def test_reasoning_effort_reaches_the_template_and_server_default_yields(app):
    client, ctx, engine = app()
    seen = []
    original = ctx.chat_template.render_ids

    def spy(tok, messages, **kw):
        seen.append(kw.get("reasoning_effort"))
        return original(tok, messages, **kw)

    ctx.chat_template.render_ids = spy
    post(client, reasoning={"effort": "high"})
    assert seen[-1] == "high"
    ctx.options.thinking.default_reasoning_effort = "low"
    post(client)
    assert seen[-1] == "low"
    post(client, reasoning={"effort": "medium"})
    assert seen[-1] == "medium"
    ctx.options.thinking.default_reasoning_effort = "none"
    post(client)
    assert prompt_text(ctx, engine.requests[-1]).endswith("<think>\n\n</think>\n\n")


def test_prompt_cache_breakpoints_become_engine_markers(app):
    client, ctx, engine = app()
    bp = {"mode": "explicit"}
    r = post(client, tools=[FN], input=[
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "input_text", "text": "doc", "prompt_cache_breakpoint": bp}]},
        call("c1"), result("c1", output=[{"type": "input_text", "text": "r", "prompt_cache_breakpoint": bp}]),
        USER])
    assert r.status_code == 200, r.text
    req = engine.requests[-1]
    tok = ctx.tokenizer
    im = tok.token_to_id("<|im_start|>")
    starts = [i for i, t in enumerate(req.prompt_ids) if t == im]
    # blocks: tools + system, user "doc", assistant call, tool results, user "Hi", the generation opener
    assert len(starts) == 6
    assert req.checkpoint_hints.markers == [starts[2], starts[4]]  # where the marked messages end
    assert tok.decode(req.prompt_ids[starts[2]:], skip_special=False).startswith("<|im_start|>assistant")
    assert req.checkpoint_hints.turn_closure == starts[-1]
    post(client)
    hints = engine.requests[-1].checkpoint_hints  # no markers: the turn closure preserve_thinking selects
    assert hints.markers == [] and hints.turn_closure is not None


def test_serve_flags():
    import argparse

    from ninfer_core.config import add_serve_arguments, options_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    opts = options_from_args(p.parse_args([]))
    assert (opts.response_store_max_records, opts.response_store_max_mib, opts.lenient_assistant_history) == (
        1024, 256, False)
    opts = options_from_args(p.parse_args(["--response-store-max-records", "5", "--response-store-max-mib", "2",
                                           "--lenient-assistant-history"]))
    assert (opts.response_store_max_records, opts.response_store_max_mib, opts.lenient_assistant_history) == (
        5, 2, True)
    with pytest.raises(SystemExit):
        p.parse_args(["--response-store-max-records", "-1"])


def test_store_budget_follows_the_flags(app):
    _client, ctx, _ = app(response_store_max_records=7, response_store_max_mib=3)
    assert ctx.response_store.max_records == 7 and ctx.response_store.max_bytes == 3 << 20
