"""Chat Completions adapter: validation, prompt options, sampling resolution, response and SSE shapes.

Over TestClient and the FakeEngine of tests/conftest.py (which records the GenerationRequest the
adapter submits); the real engine and model are exercised by tests/e2e.
"""

from __future__ import annotations

import json

import pytest

from ninfer_core.engine.api import EngineError, EngineEvent

HI = [{"role": "user", "content": "Hi"}]


def post(client, **body):
    body.setdefault("messages", HI)
    return client.post("/v1/chat/completions", json=body)


def sse_events(text: str) -> list:
    out = []
    for block in text.split("\n\n"):
        if not block:
            continue
        if block.startswith(":"):
            out.append(block)
        else:
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def prompt_text(ctx, request) -> str:
    return ctx.tokenizer.decode(request.prompt_ids, skip_special=False)


# --- field validation ----------------------------------------------------------------------------------

BAD = [
    # (body fields, status, code, param)
    ({"messages": []}, 400, "invalid_value", "messages"),
    ({"messages": None}, 400, "invalid_type", "messages"),
    ({"messages": "hi"}, 400, "invalid_type", "messages"),
    ({"messages": [5]}, 400, "invalid_type", "messages[0]"),
    ({"messages": [{"role": "user"}, {"role": "wizard", "content": "x"}]}, 400, "invalid_value", "messages[1].role"),
    ({"messages": [{"role": "user", "content": {"text": "x"}}]}, 400, "invalid_type", "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "missing_required_parameter",
     "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, 400, "invalid_type",
     "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, 400, "invalid_value",
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     400, "vision_disabled", "messages[0].content[1].type"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, 400,
     "content_type_not_supported", "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, 400, "invalid_value", "messages[0].name"),
    ({"messages": [{"role": "tool", "content": "x", "name": 5}]}, 400, "invalid_type", "messages[0].name"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     400, "invalid_value", "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     400, "invalid_value", "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": "f()"}]}, 400, "invalid_type", "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 1}]}, 400, "invalid_type",
     "messages[0].reasoning_content"),
    ({"model": 5}, 400, "invalid_type", "model"),
    ({"model": "other"}, 404, "model_not_found", "model"),
    ({"max_tokens": -2}, 400, "invalid_value", "max_tokens"),
    ({"max_tokens": "10"}, 400, "invalid_type", "max_tokens"),
    ({"max_completion_tokens": -5}, 400, "invalid_value", "max_completion_tokens"),
    ({"temperature": -0.1}, 400, "invalid_value", "temperature"),
    ({"temperature": 2.01}, 400, "invalid_value", "temperature"),
    ({"temperature": True}, 400, "invalid_type", "temperature"),
    ({"top_p": 0}, 400, "invalid_value", "top_p"),
    ({"top_p": 1.1}, 400, "invalid_value", "top_p"),
    ({"top_k": -1}, 400, "invalid_value", "top_k"),
    ({"top_k": 2.5}, 400, "invalid_type", "top_k"),
    ({"min_p": -0.5}, 400, "invalid_value", "min_p"),
    ({"presence_penalty": 2.5}, 400, "invalid_value", "presence_penalty"),
    ({"frequency_penalty": -2.5}, 400, "invalid_value", "frequency_penalty"),
    ({"seed": 2**63}, 400, "invalid_value", "seed"),
    ({"seed": "42"}, 400, "invalid_type", "seed"),
    ({"stop": 5}, 400, "invalid_type", "stop"),
    ({"stop": ""}, 400, "invalid_value", "stop"),
    ({"stop": ["a", 1]}, 400, "invalid_type", "stop[1]"),
    ({"stop": ["1", "2", "3", "4", "5"]}, 400, "invalid_value", "stop"),
    ({"n": 3}, 400, "n_not_supported", "n"),
    ({"n": 0}, 400, "invalid_value", "n"),
    ({"stream": "yes"}, 400, "invalid_type", "stream"),
    ({"stream_options": {"include_usage": "yes"}}, 400, "invalid_type", "stream_options.include_usage"),
    ({"logit_bias": {"10": 0, "11": -300}}, 400, "invalid_value", "logit_bias[11]"),
    ({"logit_bias": {"10": True}}, 400, "invalid_type", "logit_bias[10]"),
    ({"logit_bias": [[10**9, 1]]}, 400, "invalid_value", "logit_bias[0][0]"),
    ({"logit_bias": {"10": "x"}}, 400, "invalid_type", "logit_bias[10]"),
    ({"logprobs": "yes"}, 400, "invalid_type", "logprobs"),
    ({"top_logprobs": 3, "logprobs": False}, 400, "invalid_value", "top_logprobs"),
    ({"top_logprobs": -1, "logprobs": True}, 400, "invalid_value", "top_logprobs"),
    ({"top_logprobs": 1.5, "logprobs": True}, 400, "invalid_type", "top_logprobs"),
    ({"top_logprobs": 3}, 400, "invalid_value", "top_logprobs"),
    ({"top_logprobs": 21, "logprobs": False}, 400, "invalid_value", "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format_not_supported", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, 400,
     "response_format_not_supported", "response_format"),
    ({"response_format": {"type": "yaml"}}, 400, "invalid_value", "response_format.type"),
    ({"response_format": "json"}, 400, "invalid_type", "response_format"),
    ({"guided_json": {}}, 400, "unsupported_parameter", "guided_json"),
    ({"guided_regex": "a+"}, 400, "unsupported_parameter", "guided_regex"),
    ({"guided_choice": ["a"]}, 400, "unsupported_parameter", "guided_choice"),
    ({"guided_grammar": "root ::= x"}, 400, "unsupported_parameter", "guided_grammar"),
    ({"grammar": "root ::= x"}, 400, "unsupported_parameter", "grammar"),
    ({"structured_outputs": {"json": {}}}, 400, "unsupported_parameter", "structured_outputs"),
    ({"tools": [{"type": "function"}]}, 400, "missing_required_parameter", "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, 400, "invalid_value", "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, 400, "invalid_value", "tools[0].type"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}},
                                           {"type": "function", "function": {"name": "g"}}]}, 400,
     "tool_choice_not_supported", "tool_choice"),
    ({"tool_choice": "required"}, 400, "invalid_value", "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "invalid_value",
     "tool_choice.function.name"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "invalid_value", "tool_choice.function.name"),
    ({"tool_choice": {"type": "function"}, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "missing_required_parameter", "tool_choice.function.name"),
    ({"tool_choice": {"type": "web_search"}}, 400, "invalid_value", "tool_choice.type"),
    ({"tool_choice": 3}, 400, "invalid_type", "tool_choice"),
    ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]}},
      "tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]},
     400, "tool_choice_not_supported", "tool_choice.allowed_tools"),
    ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": []}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "invalid_value",
     "tool_choice.allowed_tools.mode"),
    ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "zz"}}]}}, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "invalid_value", "tool_choice.allowed_tools.tools[0].function.name"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}, "enable_thinking": True,
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "invalid_value", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "custom", "custom": {"name": "f"}}]},
     400, "invalid_value", "tools[1].custom.name"),
    ({"thinking_budget": 0}, 400, "invalid_value", "thinking_budget"),
    ({"thinking_budget": -5}, 400, "invalid_value", "thinking_budget"),
    ({"thinking_budget": "64"}, 400, "invalid_type", "thinking_budget"),
    ({"thinking_budget": True}, 400, "invalid_type", "thinking_budget"),
    ({"post_thinking": "cold"}, 400, "invalid_type", "post_thinking"),
    ({"post_thinking": {"temperature": 3}}, 400, "invalid_value", "post_thinking.temperature"),
    ({"post_thinking": {"top_p": 0}}, 400, "invalid_value", "post_thinking.top_p"),
    ({"post_thinking": {"top_k": -1}}, 400, "invalid_value", "post_thinking.top_k"),
    ({"post_thinking": {"seed": "1"}}, 400, "invalid_type", "post_thinking.seed"),
    ({"post_thinking": {"temprature": 0.1}}, 400, "invalid_value", "post_thinking.temprature"),
    ({"chat_template_kwargs": {"reasoning_effort": "huge"}}, 400, "invalid_value",
     "chat_template_kwargs.reasoning_effort"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, 400, "invalid_value",
     "chat_template_kwargs.reasoning_effort"),
    ({"preserve_thinking": True, "chat_template_kwargs": {"preserve_thinking": False}}, 400, "invalid_value",
     "chat_template_kwargs.preserve_thinking"),
    ({"chat_template_kwargs": {"tools": []}}, 400, "invalid_value", "chat_template_kwargs.tools"),
    ({"chat_template_kwargs": {"bos_token": "x"}}, 400, "invalid_value", "chat_template_kwargs.bos_token"),
    ({"chat_template_kwargs": {"pad_token": "x"}}, 400, "invalid_value", "chat_template_kwargs.pad_token"),
    ({"chat_template_kwargs": {"continue_final_message": True}}, 400, "invalid_value",
     "chat_template_kwargs.continue_final_message"),
    ({"reasoning_effort": 3}, 400, "invalid_type", "reasoning_effort"),
    ({"parallel_tool_calls": "no"}, 400, "invalid_type", "parallel_tool_calls"),
    ({"function_call": {"name": "f"}}, 400, "functions_not_supported", "function_call"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, 400, "invalid_value",
     "tools[0].function.name"),
    ({"tools": [{"type": "custom", "custom": {"name": "a>b"}}]}, 400, "invalid_value", "tools[0].custom.name"),
    ({"mm_processor_kwargs": {"max_pixels": 1024}}, 400, "unsupported_parameter", "mm_processor_kwargs.max_pixels"),
    ({"mm_processor_kwargs": []}, 400, "invalid_type", "mm_processor_kwargs"),
    ({"tool_choice": "sometimes"}, 400, "invalid_value", "tool_choice"),
    ({"functions": [{"name": "f"}]}, 400, "functions_not_supported", "functions"),
    ({"repetition_penalty": 1.2}, 400, "repetition_penalty_not_supported", "repetition_penalty"),
    ({"store": True}, 400, "store_not_supported", "store"),
    ({"verbosity": "high"}, 400, "verbosity_not_supported", "verbosity"),
    ({"web_search_options": {}}, 400, "web_search_not_supported", "web_search_options"),
    ({"modalities": ["text", "audio"]}, 400, "audio_not_supported", "modalities"),
    ({"ignore_eos": 1}, 400, "invalid_type", "ignore_eos"),
    ({"enable_thinking": "no"}, 400, "invalid_type", "enable_thinking"),
    ({"chat_template_kwargs": []}, 400, "invalid_type", "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, 400, "invalid_type",
     "chat_template_kwargs.enable_thinking"),
    ({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}, 400, "invalid_value",
     "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": {"messages": []}}, 400, "invalid_value", "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, 400, "invalid_value",
     "chat_template_kwargs.add_generation_prompt"),
    ({"reasoning_effort": "extreme"}, 400, "invalid_value", "reasoning_effort"),
    ({"reasoning_effort": "none", "enable_thinking": True}, 400, "invalid_value", "reasoning_effort"),
]


@pytest.mark.parametrize("fields,status,code,param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_request_fields(make_app, fields, status, code, param):
    client, ctx, engine = make_app()
    r = post(client, **fields)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param), err
    assert err["type"] == "invalid_request_error" and err["message"]
    assert engine.requests == [] and ctx.ingress.admitted == 0
    assert post(client).status_code == 200  # still serving


def test_body_must_be_a_json_object(make_app):
    client, _, _ = make_app()
    r = client.post("/v1/chat/completions", content=b"[1, 2]")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_type"
    r = client.post("/v1/chat/completions", content=b'{"messages": ')
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = client.post("/v1/chat/completions", content=b"\xff\xfe")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


ACCEPTED = [
    {"model": "test-model"}, {"model": ""}, {"model": None},
    {"logit_bias": {"1": 0, "2": 0.0}}, {"logprobs": False}, {"top_logprobs": 0},
    {"response_format": {"type": "text"}}, {"n": 1}, {"verbosity": "medium"}, {"repetition_penalty": 1},
    {"store": False}, {"modalities": ["text"]}, {"functions": []}, {"parallel_tool_calls": False},
    {"metadata": {"a": "b"}, "user": "u1", "service_tier": "auto", "prompt_cache_key": "k", "unknown_x": 1},
    {"stop": None}, {"stop": []}, {"max_tokens": 0}, {"max_tokens": -1}, {"top_k": 1000},
    {"tool_choice": "none", "tools": [{"type": "function", "function": {"name": "f"}}]},
    {"reasoning_effort": "auto"}, {"reasoning_effort": "high"}, {"chat_template_kwargs": {"custom": None}},
    {"reasoning_effort": "default"}, {"reasoning_effort": "none"}, {"reasoning_effort": "minimal"},
    {"logprobs": True}, {"logprobs": True, "top_logprobs": 20}, {"logprobs": False, "top_logprobs": 0},
    {"thinking_budget": 64}, {"post_thinking": {}}, {"post_thinking": {"temperature": 0.1, "top_k": 10}},
    {"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": True}},
    {"chat_template_kwargs": {"enable_thinking": None, "reasoning_effort": None}},
    {"tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
    {"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]},
    {"tool_choice": {"type": "function", "function": {"name": "f"}},
     "tools": [{"type": "function", "function": {"name": "f"}}]},
    {"tool_choice": {"type": "custom", "custom": {"name": "c"}},
     "tools": [{"type": "custom", "custom": {"name": "c"}}, {"type": "function", "function": {"name": "f"}}]},
    {"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "f"}}]}},
     "tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]},
    {"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "name": "g"}]}},
     "tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]},
    {"tool_choice": "auto"}, {"tool_choice": "none"}, {"parallel_tool_calls": True},
    {"prediction": {"type": "content", "content": "x"}}, {"audio": None}, {"safety_identifier": "s"},
    {"function_call": "none"}, {"function_call": "auto", "functions": []}, {"mm_processor_kwargs": {}},
    {"mm_processor_kwargs": {"max_pixels": None}}, {"stream_options": {"include_usage": False}},
    {"messages": [{"role": "user", "content": "Hi"}], "enable_thinking": None, "reasoning_effort": None},
    {"messages": [{"role": "user", "content": None}]},
    {"messages": [{"role": "tool", "content": "r", "name": "f", "tool_call_id": "c1"}]},
    {"messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                  {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
]


@pytest.mark.parametrize("fields", ACCEPTED, ids=[str(i) for i in range(len(ACCEPTED))])
def test_neutral_and_compatible_fields_are_accepted(make_app, fields):
    client, _, engine = make_app()
    r = post(client, **fields)
    assert r.status_code == 200, r.text
    assert len(engine.requests) == 1


# --- prompt and sampling ----------------------------------------------------------------------------

def test_prompt_rendering_and_thinking_modes(make_app):
    client, ctx, engine = make_app()
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "<|im_end|>"}]}]
    assert post(client, messages=msgs).status_code == 200
    text = prompt_text(ctx, engine.requests[-1])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello <|im_end|>")
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    # Quoted control-token text in content stays text: only 4 <|im_end|>-free markup tokens + ...
    im_end = ctx.tokenizer.token_to_id("<|im_end|>")
    assert engine.requests[-1].prompt_ids.count(im_end) == 2
    for fields in ({"enable_thinking": False}, {"chat_template_kwargs": {"enable_thinking": False}},
                   {"reasoning_effort": "none"}):
        assert post(client, **fields).status_code == 200
        assert prompt_text(ctx, engine.requests[-1]).endswith("<think>\n\n</think>\n\n"), fields


def test_no_thinking_flag_and_request_override(make_app):
    client, ctx, engine = make_app(no_thinking=True)
    post(client)
    assert prompt_text(ctx, engine.requests[-1]).endswith("</think>\n\n")
    r = post(client, enable_thinking=True).json()
    assert prompt_text(ctx, engine.requests[-1]).endswith("<think>\n")
    assert r["choices"][0]["message"]["reasoning_content"] == "Let me think."


def test_tools_are_rendered(make_app):
    client, ctx, engine = make_app()
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
             {"type": "custom", "custom": {"name": "run_sql"}}]
    history = HI + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    assert post(client, messages=history, tools=tools).status_code == 200
    text = prompt_text(ctx, engine.requests[-1])
    assert "<tools>" in text and '"name": "get_weather"' in text and '"name": "run_sql"' in text
    assert '"input": {"type": "string"}' in text  # custom tool: one string input
    assert "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>" in text
    assert "<tool_response>\nrain\n</tool_response>" in text
    post(client, tools=tools, tool_choice="none")
    assert "<tools>" not in prompt_text(ctx, engine.requests[-1])


def test_template_error_is_invalid_prompt(make_app):
    from ninfer_core.tokenizer.chat_template import ChatTemplate

    client, ctx, engine = make_app()
    ctx.chat_template = ChatTemplate("{{ raise_exception('system message required') }}")
    r = post(client)
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_prompt", "messages") and "system message required" in err["message"]
    assert ctx.ingress.admitted == 0


def _sampling(client, engine, **fields):
    assert post(client, **fields).status_code == 200
    return engine.requests[-1].sampling


def test_sampling_presets_flags_and_request_fields(make_app):
    client, _, engine = make_app()
    s = _sampling(client, engine)
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.presence_penalty, s.frequency_penalty) == \
        (1.0, 0.95, 20, 0.0, 0.0, 0.0)
    assert s.seed is None and not s.greedy
    s = _sampling(client, engine, enable_thinking=False)
    assert (s.temperature, s.top_p, s.top_k, s.presence_penalty) == (0.7, 0.8, 20, 1.5)
    s = _sampling(client, engine, temperature=0.3, top_p=0.5, top_k=50, min_p=0.1, presence_penalty=-1,
                  frequency_penalty=0.5, seed=-7)
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.presence_penalty, s.frequency_penalty, s.seed) == \
        (0.3, 0.5, 20, 0.1, -1.0, 0.5, -7)
    assert _sampling(client, engine, temperature=0).greedy

    flagged, _, engine2 = make_app(engine_options={"temperature": 0.5, "top_k": 5, "presence_penalty": 0.25,
                                                   "seed": 11})
    s = _sampling(flagged, engine2, enable_thinking=False)
    assert (s.temperature, s.top_p, s.top_k, s.presence_penalty, s.seed) == (0.5, 0.8, 5, 0.25, 11)
    s = _sampling(flagged, engine2, temperature=1.5, top_k=3, seed=2)
    assert (s.temperature, s.top_k, s.seed) == (1.5, 3, 2)

    greedy, _, engine3 = make_app(engine_options={"greedy": True})
    s = _sampling(greedy, engine3, temperature=1.2)
    assert s.greedy and s.temperature == 0.0


def test_output_limit_stop_and_ignore_eos(make_app):
    client, _, engine = make_app(engine_options={"default_max_tokens": 50})
    post(client)
    assert engine.requests[-1].max_tokens is None  # the engine applies --default-max-tokens
    post(client, max_tokens=9)
    assert engine.requests[-1].max_tokens == 9
    post(client, max_tokens=9, max_completion_tokens=4)
    assert engine.requests[-1].max_tokens == 4
    post(client, max_tokens=-1)  # -1: the derived budget even under --default-max-tokens
    req = engine.requests[-1]
    assert req.max_tokens == 8192 - len(req.prompt_ids)
    post(client, stop="END", ignore_eos=True)
    assert engine.requests[-1].stop == ["END"] and engine.requests[-1].ignore_eos
    post(client, stop=["a", "b"])
    assert engine.requests[-1].stop == ["a", "b"] and not engine.requests[-1].ignore_eos
    unlimited, _, engine2 = make_app()
    post(unlimited, max_tokens=-1)
    assert engine2.requests[-1].max_tokens is None


def test_request_id_and_deadline_reach_the_engine(make_app):
    client, _, engine = make_app(engine_options={"pending_timeout_ms": 1000})
    import time

    r = post(client)
    req = engine.requests[-1]
    assert req.request_id == r.headers["x-request-id"]
    assert 0 < req.deadline - time.monotonic() <= 1.0


# --- responses ------------------------------------------------------------------------------------------

def test_aggregate_response(make_app):
    client, ctx, engine = make_app()
    r = post(client)
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "test-model" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "message": {
        "role": "assistant", "content": "Hello there.", "reasoning_content": "Let me think.", "refusal": None},
        "logprobs": None, "finish_reason": "stop"}]
    reasoning_tokens = len(ctx.tokenizer.encode("Let me think.")) + 1  # + the </think> token
    completion = sum(len(ctx.tokenizer.encode(p)) for p in engine.pieces)
    prompt = len(engine.requests[-1].prompt_ids)
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": 0},
                             "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}
    assert body["timings"]["prompt_n"] == prompt
    assert ctx.ingress.admitted == 0


def test_aggregate_without_thinking_has_no_reasoning(make_app):
    client, _, engine = make_app()
    engine.pieces = ["Plain", " answer"]
    body = post(client, enable_thinking=False).json()
    msg = body["choices"][0]["message"]
    assert msg["content"] == "Plain answer" and msg["reasoning_content"] is None
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_stream_chunk_sequence(make_app):
    client, ctx, engine = make_app()
    r = post(client, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": None}, "logprobs": None,
                                     "finish_reason": None}]
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-2]]
    assert deltas == [{"reasoning_content": "Let me think."}, {"content": "Hello"}, {"content": " there."}]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-2]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert "timings" not in chunks[-2]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert chunks[-1]["timings"]["prompt_n"] == len(engine.requests[-1].prompt_ids)
    assert ctx.ingress.admitted == 0


def test_stream_without_usage_and_usage_chunk_choice(make_app):
    client, _, _ = make_app()
    events = sse_events(post(client, stream=True).text)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and "timings" in events[-2]
    assert "usage" not in events[-2]
    strict, _, _ = make_app(usage_chunk_choice=True)
    events = sse_events(post(strict, stream=True, stream_options={"include_usage": True}).text)
    assert events[-2]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}]
    assert events[-2]["usage"]["total_tokens"] > 0


def test_stream_keepalive(make_app):
    client, ctx, engine = make_app()
    ctx.keepalive_s = 0.02
    engine.delay_s = 0.12
    events = sse_events(post(client, stream=True).text)
    assert ": keep-alive" in events
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if isinstance(e, dict) and e["choices"])
    assert text == "Hello there."


def test_submit_errors_are_http_errors(make_app):
    client, ctx, engine = make_app()
    engine.submit_error = EngineError(429, "server_overloaded", "busy")
    for stream in (False, True):
        r = post(client, stream=stream)
        assert r.status_code == 429
        assert r.json()["error"] == {"message": "busy", "type": "server_overloaded", "param": None,
                                     "code": "server_overloaded"}
        assert r.headers["x-request-id"].startswith("req_")
    engine.submit_error = EngineError(400, "context_length_exceeded", "too long", "messages")
    r = post(client)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert ctx.ingress.admitted == 0


def test_ingress_full_is_429(make_app):
    client, ctx, engine = make_app(engine_options={"max_concurrency": 1, "max_pending_requests": 0})
    ctx.ingress.acquire()  # one request already holds the only unit
    r = post(client)
    assert r.status_code == 429 and r.json()["error"]["code"] == "server_overloaded"
    assert engine.requests == []
    ctx.ingress.release()
    assert post(client).status_code == 200


def test_engine_error_event(make_app):
    client, ctx, engine = make_app()
    engine.finish_reason = "stop"
    engine.pieces = ["partial"]
    boom = EngineError(503, "request_queue_timeout", "not admitted in time")
    engine.script = lambda req: [EngineEvent("delta", token_ids=[1], text="partial"), EngineEvent("error", error=boom)]
    r = post(client)
    assert r.status_code == 503 and r.json()["error"]["code"] == "request_queue_timeout"
    events = sse_events(post(client, stream=True).text)
    assert events[-1] == {"error": {"message": "not admitted in time", "type": "service_unavailable",
                                    "param": None, "code": "request_queue_timeout"}}
    assert "[DONE]" not in events
    assert ctx.ingress.admitted == 0


def test_reasoning_token_counter(make_app):
    from ninfer_core.server.prepare import ReasoningTokenCounter, opens_reasoning

    _, ctx, _ = make_app()
    tok = ctx.tokenizer
    o, c = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    assert opens_reasoning(tok, [1, o, 10]) and not opens_reasoning(tok, [o, 2, c, 10])
    assert not opens_reasoning(tok, tok.encode("<think>", allow_special=False))
    counter = ReasoningTokenCounter(tok, True)
    counter.feed([5, 6, c, 7, 8])
    assert counter.count == 3
    counter = ReasoningTokenCounter(tok, False)
    counter.feed([5, o, 6, c, 7])
    assert counter.count == 3


# --- reasoning effort: collapsed to what the template accepts ----------------------------------------

EFFORT_TEMPLATE = (
    "{%- if reasoning_effort is defined and reasoning_effort not in ['low', 'medium', 'xhigh'] -%}"
    "{{ raise_exception('unsupported effort') }}{%- endif -%}"
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n"
    "[effort={{ reasoning_effort if reasoning_effort is defined else 'unset' }}]"
    "{%- if enable_thinking is false -%}<think>\n\n</think>\n\n{%- else -%}<think>\n{%- endif -%}{%- endif -%}"
)


def _effort_app(make_app, **options):
    from ninfer_core.tokenizer.chat_template import ChatTemplate

    client, ctx, engine = make_app(**options)
    ctx.chat_template = ChatTemplate(EFFORT_TEMPLATE)
    return client, ctx, engine


def _rendered_effort(ctx, engine) -> str:
    text = prompt_text(ctx, engine.requests[-1])
    return text[text.index("[effort=") + 8: text.index("]", text.index("[effort="))]


@pytest.mark.parametrize("asked,rendered", [
    ("minimal", "low"), ("low", "low"), ("medium", "medium"), ("high", "xhigh"), ("xhigh", "xhigh"),
    ("max", "xhigh"), ("auto", "unset"), ("default", "unset"),
])
def test_effort_collapses_to_the_nearest_accepted_value(make_app, asked, rendered):
    client, ctx, engine = _effort_app(make_app)
    assert post(client, reasoning_effort=asked).status_code == 200
    assert _rendered_effort(ctx, engine) == rendered
    assert post(client, chat_template_kwargs={"reasoning_effort": asked}).status_code == 200
    assert _rendered_effort(ctx, engine) == rendered


def test_effort_none_disables_thinking(make_app):
    client, ctx, engine = _effort_app(make_app)
    assert post(client, reasoning_effort="none").status_code == 200
    assert prompt_text(ctx, engine.requests[-1]).endswith("[effort=unset]<think>\n\n</think>")


def test_effort_probe_runs_once_per_template():
    from ninfer_core.server.prepare import accepted_efforts, collapse_effort
    from ninfer_core.tokenizer.chat_template import ChatTemplate

    class Counting(ChatTemplate):
        renders = 0

        def render(self, *a, **kw):
            Counting.renders += 1
            return super().render(*a, **kw)

    tpl = Counting(EFFORT_TEMPLATE)
    assert accepted_efforts(tpl) == ("low", "medium", "xhigh")
    n = Counting.renders
    assert collapse_effort(tpl, "high") == "xhigh" and collapse_effort(tpl, "minimal") == "low"
    assert Counting.renders == n  # cached
    # a tie rounds up: with low and xhigh only, medium sits between low (1 away) and ... high is 1 from xhigh
    two = ChatTemplate(EFFORT_TEMPLATE.replace("'low', 'medium', 'xhigh'", "'low', 'high'"))
    assert collapse_effort(two, "medium") == "high" and collapse_effort(two, "max") == "high"
    # a template that accepts no value, or cannot render the probe chat, keeps the request's value
    none = ChatTemplate("{{ raise_exception('no') if reasoning_effort is defined }}x")
    assert accepted_efforts(none) is None and collapse_effort(none, "high") == "high"
    sys_only = ChatTemplate("{{ raise_exception('system first') if messages[0].role != 'system' }}x")
    assert accepted_efforts(sys_only) is None and collapse_effort(sys_only, "max") == "max"


def test_default_reasoning_effort(make_app):
    from ninfer_core.config import ThinkingOptions

    client, ctx, engine = _effort_app(make_app, thinking=ThinkingOptions(default_reasoning_effort="high"))
    post(client)
    assert _rendered_effort(ctx, engine) == "xhigh"
    post(client, reasoning_effort="low")
    assert _rendered_effort(ctx, engine) == "low"
    post(client, enable_thinking=False)  # a request that disables thinking is served as if unset
    assert _rendered_effort(ctx, engine) == "unset"
    tools = [{"type": "function", "function": {"name": "f"}}]
    post(client, tools=tools, tool_choice="required")  # so is a forced tool call
    assert _rendered_effort(ctx, engine) == "unset"


def test_default_reasoning_effort_none_turns_thinking_off_by_default(make_app):
    from ninfer_core.config import ThinkingOptions

    client, ctx, engine = make_app(thinking=ThinkingOptions(default_reasoning_effort="none"))
    post(client)
    assert prompt_text(ctx, engine.requests[-1]).endswith("<think>\n\n</think>\n\n")
    post(client, enable_thinking=True)
    assert prompt_text(ctx, engine.requests[-1]).endswith("<|im_start|>assistant\n<think>\n")


def test_default_reasoning_effort_conflicts_with_no_thinking():
    import argparse

    from ninfer_core.config import add_serve_arguments, options_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    with pytest.raises(ValueError, match="--no-thinking"):
        options_from_args(p.parse_args(["--no-thinking", "--default-reasoning-effort", "high"]))
    assert options_from_args(p.parse_args(["--no-thinking", "--default-reasoning-effort", "none"])).thinking \
        .default_reasoning_effort == "none"
    opts = options_from_args(p.parse_args(["--post-thinking-top-p", "0.5",
                                           "--post-thinking-sampler", "temp=0.1,top_k=4,presence=1"]))
    assert opts.thinking.post_thinking
    assert opts.thinking.post_thinking_overrides == {"temperature": 0.1, "top_k": 4, "presence_penalty": 1.0,
                                                     "top_p": 0.5}
    with pytest.raises(SystemExit):
        p.parse_args(["--post-thinking-sampler", "heat=3"])
    with pytest.raises(SystemExit):
        p.parse_args(["--default-thinking-budget", "0"])


def test_preserve_thinking_reaches_the_template(make_app):
    client, ctx, engine = make_app()
    history = [{"role": "user", "content": "a"},
               {"role": "assistant", "content": "b", "reasoning_content": "SECRET-REASONING"},
               {"role": "user", "content": "c"}]
    post(client, messages=history)
    assert "SECRET-REASONING" not in prompt_text(ctx, engine.requests[-1])
    post(client, messages=history, preserve_thinking=True)
    assert "SECRET-REASONING" in prompt_text(ctx, engine.requests[-1])
    post(client, messages=history, chat_template_kwargs={"preserve_thinking": True})
    assert "SECRET-REASONING" in prompt_text(ctx, engine.requests[-1])
    client2, ctx2, engine2 = make_app(preserve_thinking=True)
    post(client2, messages=history, preserve_thinking=False)
    assert "SECRET-REASONING" not in prompt_text(ctx2, engine2.requests[-1])
