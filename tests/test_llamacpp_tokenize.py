"""POST /tokenize, /detokenize and /apply-template: llama.cpp's shapes, answered on the host."""

from __future__ import annotations

import pytest
from test_llamacpp_helpers import assert_error, assert_idle, qwen_tokenizer, raw_app  # noqa: F401

IM_START = 248045
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def app(raw_app):
    return raw_app()


def test_tokenize(app):
    client, _, _, runner = app
    tok = qwen_tokenizer()
    text = "<|im_start|>user\nHello, world"
    r = client.post("/tokenize", json={"content": text})
    assert r.status_code == 200 and r.headers["x-request-id"].startswith("req_")
    assert r.json() == {"tokens": tok.encode(text)}
    assert r.json()["tokens"][0] == IM_START  # parse_special defaults to true
    plain = client.post("/tokenize", json={"content": text, "parse_special": False}).json()["tokens"]
    assert IM_START not in plain and plain == tok.encode(text, allow_special=False)
    for add_special in (True, False):  # accepted: Qwen checkpoints add no BOS
        assert client.post("/tokenize", json={"content": text, "add_special": add_special}).json() == r.json()
    assert client.post("/tokenize", json={"content": ""}).json() == {"tokens": []}
    mixed = client.post("/tokenize", json={"content": [IM_START, "user"]}).json()["tokens"]
    assert mixed == [IM_START] + tok.encode("user")
    assert runner.calls == []  # the engine was never asked


def test_tokenize_with_pieces(app):
    client, _, _, _ = app
    tok = qwen_tokenizer()
    r = client.post("/tokenize", json={"content": "<|im_start|>hi 🦙", "with_pieces": True}).json()
    ids = tok.encode("<|im_start|>hi 🦙")
    assert [t["id"] for t in r["tokens"]] == ids
    assert r["tokens"][0] == {"id": IM_START, "piece": "<|im_start|>"}
    assert r["tokens"][1] == {"id": ids[1], "piece": "hi"}
    partial = [t for t in r["tokens"] if isinstance(t["piece"], list)]
    assert partial, "the emoji should split into byte pieces"
    for t in partial:  # a piece that is not whole UTF-8 comes as its bytes
        assert bytes(t["piece"]) == tok.token_bytes(t["id"])
    assert b"".join(bytes(t["piece"]) if isinstance(t["piece"], list) else t["piece"].encode()
                    for t in r["tokens"][1:]) == "hi 🦙".encode()


def test_detokenize(app):
    client, _, _, runner = app
    tok = qwen_tokenizer()
    ids = [IM_START] + tok.encode("user\nHi there") + [tok.token_to_id("<|im_end|>")]
    r = client.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200
    assert r.json() == {"content": "<|im_start|>user\nHi there<|im_end|>"}  # special tokens included
    assert client.post("/detokenize", json={"tokens": []}).json() == {"content": ""}
    round_trip = client.post("/tokenize", json={"content": "naïve café 🦙"}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": round_trip}).json()["content"] == "naïve café 🦙"
    assert runner.calls == []


def test_apply_template(app):
    client, ctx, _, runner = app
    r = client.post("/apply-template", json={"messages": HI})
    assert r.status_code == 200
    prompt = r.json()["prompt"]
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    off = client.post("/apply-template", json={"messages": HI, "enable_thinking": False}).json()["prompt"]
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    sys_prompt = client.post("/apply-template", json={
        "messages": [{"role": "system", "content": "Be brief."}] + HI,
        "chat_template_kwargs": {"enable_thinking": False}}).json()["prompt"]
    assert sys_prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with_tools = client.post("/apply-template", json={"messages": HI, "tools": tools}).json()["prompt"]
    assert "get_weather" in with_tools and with_tools.endswith("<|im_start|>assistant\n<think>\n")
    forced = client.post("/apply-template", json={
        "messages": HI, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}
    }).json()["prompt"]
    assert forced.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>\n")
    # the rendered text is the chat template's own rendering
    rendered = ctx.chat_template.render(HI, add_generation_prompt=True, enable_thinking=True)
    assert prompt == rendered
    assert runner.calls == []


BAD = [
    ("/tokenize", {}, "missing_required_parameter", "content"),
    ("/tokenize", {"content": 5}, "invalid_type", "content"),
    ("/tokenize", {"content": ["a", "b"]}, "multiple_prompts_not_supported", "content"),
    ("/tokenize", {"content": [IM_START, 10**9]}, "invalid_value", "content[1]"),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "invalid_type", "with_pieces"),
    ("/tokenize", {"content": "x", "parse_special": 1}, "invalid_type", "parse_special"),
    ("/tokenize", {"content": "x", "add_special": None, "extra": 1}, None, None),
    ("/detokenize", {}, "missing_required_parameter", "tokens"),
    ("/detokenize", {"tokens": "abc"}, "invalid_type", "tokens"),
    ("/detokenize", {"tokens": [1, "x"]}, "invalid_type", "tokens[1]"),
    ("/detokenize", {"tokens": [1, True]}, "invalid_type", "tokens[1]"),
    ("/detokenize", {"tokens": [1, -5]}, "invalid_value", "tokens[1]"),
    ("/detokenize", {"tokens": [10**9]}, "invalid_value", "tokens[0]"),
    ("/apply-template", {}, "missing_required_parameter", "messages"),
    ("/apply-template", {"messages": []}, "invalid_value", "messages"),
    ("/apply-template", {"messages": [{"role": "wizard", "content": "x"}]}, "invalid_value", "messages[0].role"),
    ("/apply-template", {"messages": HI, "model": "other"}, "model_not_found", "model"),
]


@pytest.mark.parametrize("path,body,code,param", BAD)
def test_refusals(app, path, body, code, param):
    client, _, engine, _ = app
    r = client.post(path, json=body)
    if code is None:
        assert r.status_code == 200, r.text
    else:
        assert_error(r, 404 if code == "model_not_found" else 400, code, param)
    assert client.post("/tokenize", json={"content": "ok"}).status_code == 200
    assert_idle(engine)


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/apply-template"])
def test_not_json_object(app, path):
    client, _, _, _ = app
    assert_error(client.post(path, content=b"{", headers={"content-type": "application/json"}), 400,
                 "invalid_json", None)
    assert_error(client.post(path, json=[1]), 400, "invalid_type", None)


def test_host_routes_answer_while_generation_is_full(app):
    client, ctx, engine, _ = app
    ctx.ingress.admitted = ctx.ingress.capacity  # no generation request can be admitted
    assert client.post("/completion", json={"prompt": "x"}).status_code == 429
    assert client.post("/tokenize", json={"content": "x"}).status_code == 200
    assert client.post("/detokenize", json={"tokens": [1]}).status_code == 200
    assert client.post("/apply-template", json={"messages": HI}).status_code == 200
    ctx.ingress.admitted = 0
    assert_idle(engine)


@pytest.mark.parametrize("extra", [
    {},
    {"enable_thinking": False},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
     "tool_choice": "required"},
    {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                  {"role": "assistant", "content": "b", "reasoning_content": "r"}, {"role": "user", "content": "c"}],
     "chat_template_kwargs": {"preserve_thinking": True}},
])
def test_apply_template_is_the_prompt_chat_submits(app, extra):
    client, ctx, engine, _ = app
    body = {"messages": HI, "max_tokens": 1, **extra}
    seen = []
    submit = engine.submit
    engine.submit = lambda req: (seen.append(req), submit(req))[1]
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    rendered = client.post("/apply-template", json=body).json()["prompt"]
    assert rendered == ctx.tokenizer.decode(seen[-1].prompt_ids, skip_special=False)
    assert ctx.tokenizer.encode(rendered) == seen[-1].prompt_ids
    assert_idle(engine)
