"""End-to-end: the real `ninfer serve` (subprocess, tiny Qwen3.5 artifact) driven by the `openai` client."""

from __future__ import annotations

import httpx
import openai
import pytest

from ninfer_core.testing import wait_server_idle as _wait_idle

pytestmark = pytest.mark.timeout(300)

HI = [{"role": "user", "content": "Say hello."}]
NO_THINKING = {"enable_thinking": False}


@pytest.fixture(scope="module")
def client(live_server):
    with openai.OpenAI(base_url=live_server.api_base, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def _load(server) -> dict:
    return httpx.get(server.base_url + "/v1/load", timeout=10).json()




def test_health_was_503_while_loading_then_ok(live_server):
    seen = live_server.health_while_loading
    assert seen, "the readiness poll never saw the loading state"
    for status, headers, body in seen:
        assert status == 503
        assert headers["retry-after"] == "2"
        assert headers["x-ninfer-version"]
        assert headers["x-request-id"].startswith("req_")
        assert body == {"error": {"message": "The model is still loading. Retry shortly.",
                                  "type": "service_unavailable", "param": None, "code": "model_loading"}}
    r = httpx.get(live_server.base_url + "/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "version": r.headers["x-ninfer-version"]}


def test_models_list_and_lookup(client, live_server, model_id):
    assert model_id == "tiny-qwen35-dense"
    m = client.models.retrieve(model_id)
    extra = m.model_extra
    assert extra["max_model_len"] == extra["context_window"] == extra["context_length"] == 8192
    assert extra["modalities"] == {"vision": False}
    assert extra["architecture"] == {"input_modalities": ["text"], "output_modalities": ["text"]}
    meta = extra["meta"]
    assert meta["n_ctx"] == 8192 and meta["n_vocab"] >= 248000 and meta["n_embd"] == 64
    assert meta["n_params"] > 0 and meta["size"] > 0 and meta["ftype"] == "f32"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    # An OpenAI client given the /v1 base twice still reaches the same routes.
    with openai.OpenAI(base_url=live_server.api_base + "/v1", api_key="x", max_retries=0) as doubled:
        assert doubled.models.list().data[0].id == model_id


def test_props_and_load(live_server, model_id):
    props = httpx.get(live_server.base_url + "/props").json()
    assert props["model_alias"] == model_id
    assert props["total_slots"] == 1
    params = props["default_generation_settings"]["params"]
    assert (params["temperature"], params["top_p"], params["top_k"]) == (1.0, 0.95, 20)
    assert params["n_predict"] == -1 and params["seed"] == -1
    assert props["build_info"].startswith("ninfer ")
    load = _load(live_server)
    assert load["object"] == "ninfer.load" and load["model"] == model_id
    assert load["capacity"]["max_concurrency"] == 1
    assert load["capacity"]["kv_page_tokens"] == 64


def test_chat_aggregate(client, model_id):
    r = client.chat.completions.with_raw_response.create(
        model=model_id, messages=HI, max_tokens=12)
    assert r.headers["x-request-id"].startswith("req_")
    assert r.headers["x-ninfer-version"]
    resp = r.parse()
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion" and resp.model == model_id
    choice = resp.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    assert choice.message.refusal is None
    # Thinking is on by default: the generation prompt opened <think>, so output is reasoning first.
    assert isinstance(choice.message.model_extra["reasoning_content"], str)
    u = resp.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 0 < u.completion_tokens_details.reasoning_tokens <= u.completion_tokens
    timings = resp.model_extra["timings"]
    assert timings["prompt_n"] + timings["cache_n"] == u.prompt_tokens
    # The shared server may hold an earlier conversation's checkpoint of this prefix (another test's
    # tool loop keeps the frontier before its first assistant opener): reuse is reported exactly.
    assert 0 <= u.prompt_tokens_details.cached_tokens == timings["cache_n"] < u.prompt_tokens
    assert timings["predicted_n"] == u.completion_tokens


def test_model_omitted_or_empty_is_served(live_server):
    for body in ({"messages": HI, "max_tokens": 2}, {"model": "", "messages": HI, "max_tokens": 2},
                 {"model": None, "messages": HI, "max_tokens": 2}):
        r = httpx.post(live_server.api_base + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text


def test_streaming_chunk_sequence_with_usage(client, model_id):
    stream = client.chat.completions.create(
        model=model_id, messages=HI, max_tokens=6, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    first, finish, usage = chunks[0], chunks[-2], chunks[-1]
    assert len({c.id for c in chunks}) == 1 and first.id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content is None
    assert first.choices[0].finish_reason is None
    for c in chunks[1:-2]:
        delta = c.choices[0].delta
        parts = [p for p in (delta.content, (delta.model_extra or {}).get("reasoning_content")) if p]
        assert len(parts) == 1, c  # reasoning and content deltas travel in separate chunks
        assert c.choices[0].finish_reason is None
    assert finish.choices[0].finish_reason == "length"
    assert finish.choices[0].delta.content is None and finish.choices[0].delta.role is None
    assert usage.choices == []
    assert usage.usage.completion_tokens == 6
    assert usage.usage.total_tokens == usage.usage.prompt_tokens + 6
    assert usage.model_extra["timings"]["predicted_n"] == 6


def test_stream_without_usage_ends_with_finish_chunk(client, model_id):
    chunks = list(client.chat.completions.create(model=model_id, messages=HI, max_tokens=3, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is None
    assert "timings" in chunks[-1].model_extra


def test_max_tokens_finishes_with_length(client, model_id):
    resp = client.chat.completions.create(model=model_id, messages=HI, max_completion_tokens=7,
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 7
    zero = client.chat.completions.create(model=model_id, messages=HI, max_tokens=0)
    assert zero.choices[0].finish_reason == "length"
    assert zero.usage.completion_tokens == 0 and zero.choices[0].message.content == ""


def test_stop_string_cuts_output(client, model_id):
    kw = dict(model=model_id, messages=HI, temperature=0, extra_body={**NO_THINKING, "ignore_eos": True})
    full = client.chat.completions.create(max_tokens=24, **kw).choices[0].message.content
    assert len(full) >= 8, full
    start = len(full) // 2
    stop = full[start:start + 3]
    assert stop.strip() and "\ufffd" not in stop
    cut = client.chat.completions.create(max_tokens=24, stop=[stop], **kw)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[: full.index(stop)]
    # The same stop applies to streamed output.
    streamed = client.chat.completions.create(max_tokens=24, stop=stop, stream=True, **kw)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == full[: full.index(stop)]


def test_seeded_sampling_is_deterministic(client, model_id):
    def run(seed: int) -> str:
        m = client.chat.completions.create(model=model_id, messages=HI, max_tokens=12, temperature=1.0,
                                           seed=seed, extra_body={"ignore_eos": True}).choices[0].message
        return (m.model_extra.get("reasoning_content") or "") + "|" + (m.content or "")

    a, b, c = run(1234), run(1234), run(987654321)
    assert a == b
    assert a != c


def test_cancelled_stream_returns_engine_to_idle(client, live_server, model_id):
    idle = _load(live_server)
    before = idle["counters"].get("requests_cancelled", 0)
    stream = client.chat.completions.create(model=model_id, messages=HI, max_tokens=4000, stream=True,
                                            extra_body={"ignore_eos": True})
    it = iter(stream)
    for _ in range(3):
        next(it)
    assert _load(live_server)["requests"]["running"] == 1
    stream.close()
    load = _wait_idle(live_server)
    assert load["counters"]["requests_cancelled"] == before + 1
    # Back to what was occupied before: retained context-cache checkpoints stay, the cancelled
    # request published nothing and released its own pages.
    assert load["occupancy"]["device_main_kv_pages"] == idle["occupancy"]["device_main_kv_pages"]
    # The server keeps serving.
    assert client.chat.completions.create(model=model_id, messages=HI, max_tokens=2).choices


def test_cancelled_aggregate_request_returns_engine_to_idle(live_server, model_id):
    before = _load(live_server)["counters"].get("requests_cancelled", 0)
    body = {"model": model_id, "messages": HI, "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.api_base + "/chat/completions", json=body, timeout=1.5)
    load = _wait_idle(live_server)
    assert load["counters"]["requests_cancelled"] == before + 1


BAD_INPUTS = [
    ({"messages": []}, 400, "invalid_value", "messages"),
    ({}, 400, "missing_required_parameter", "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_value", "messages[0].role"),
    ({"messages": [{"content": "x"}]}, 400, "missing_required_parameter", "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "invalid_type", "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "vision_disabled", "messages[0].content[0].type"),
    ({"messages": HI, "temperature": 2.5}, 400, "invalid_value", "temperature"),
    ({"messages": HI, "temperature": "hot"}, 400, "invalid_type", "temperature"),
    ({"messages": HI, "top_p": 0}, 400, "invalid_value", "top_p"),
    ({"messages": HI, "min_p": 1.5}, 400, "invalid_value", "min_p"),
    ({"messages": HI, "top_k": -1}, 400, "invalid_value", "top_k"),
    ({"messages": HI, "presence_penalty": -3}, 400, "invalid_value", "presence_penalty"),
    ({"messages": HI, "max_tokens": -2}, 400, "invalid_value", "max_tokens"),
    ({"messages": HI, "max_completion_tokens": 1.5}, 400, "invalid_type", "max_completion_tokens"),
    ({"messages": HI, "seed": 1.5}, 400, "invalid_type", "seed"),
    ({"messages": HI, "n": 2}, 400, "n_not_supported", "n"),
    ({"messages": HI, "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value", "stop"),
    ({"messages": HI, "stop": ["a", ""]}, 400, "invalid_value", "stop[1]"),
    ({"messages": HI, "logit_bias": {"42": 500}}, 400, "invalid_value", "logit_bias[42]"),
    ({"messages": HI, "top_logprobs": 2}, 400, "invalid_value", "top_logprobs"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "invalid_value", "top_logprobs"),
    ({"messages": HI, "thinking_budget": 0}, 400, "invalid_value", "thinking_budget"),
    ({"messages": HI, "response_format": {"type": "json_object"}}, 400, "response_format_not_supported",
     "response_format"),
    ({"messages": HI, "guided_json": {"type": "object"}}, 400, "unsupported_parameter", "guided_json"),
    ({"messages": HI, "ignore_eos": "yes"}, 400, "invalid_type", "ignore_eos"),
    ({"messages": HI, "model": "gpt-4o"}, 404, "model_not_found", "model"),
]


@pytest.mark.parametrize("body,status,code,param", BAD_INPUTS, ids=[f"{b[2]}:{b[3]}" for b in BAD_INPUTS])
def test_bad_input(live_server, body, status, code, param):
    r = httpx.post(live_server.api_base + "/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param), err
    assert err["type"] == ("invalid_request_error")
    assert r.headers["x-request-id"].startswith("req_") and r.headers["x-ninfer-version"]


def test_malformed_json_and_unknown_route(live_server):
    r = httpx.post(live_server.api_base + "/chat/completions", content=b'{"messages": [', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.get(live_server.base_url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert r.headers["x-request-id"].startswith("req_")


def test_server_still_serves_after_bad_inputs(client, model_id):
    ok = client.chat.completions.create(model=model_id, messages=HI, max_tokens=3,
                                        extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 3


def test_request_ids_are_unique(client, model_id):
    ids = {client.models.with_raw_response.list().headers["x-request-id"] for _ in range(5)}
    assert len(ids) == 5
    raw = client.chat.completions.with_raw_response.create(model=model_id, messages=HI, max_tokens=2,
                                                           stream=True)
    assert raw.headers["x-request-id"].startswith("req_") and raw.headers["x-ninfer-version"]
    list(raw.parse())
