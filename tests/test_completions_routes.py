"""OpenAI legacy Completions, POST /v1/completions: fields, echo, usage, stream, refusals.

Over a real Engine on the toy runner with the real Qwen3.5 tokenizer and forced outputs.
"""

from __future__ import annotations

import pytest
import torch
from test_llamacpp_helpers import assert_error, assert_idle, qwen_tokenizer, raw_app, script, sse  # noqa: F401

PROMPT = "Once upon a time"
OUTPUT = " there was a llama."


@pytest.fixture
def app(raw_app):
    return raw_app(policy=script({PROMPT: OUTPUT}))


def post(client, **body):
    body.setdefault("prompt", PROMPT)
    return client.post("/v1/completions", json=body)


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": 0}}


def test_text_completion_object(app):
    client, _, engine, _ = app
    tok = qwen_tokenizer()
    r = post(client)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"].startswith("req_")
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "toy-model" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": OUTPUT, "logprobs": None, "finish_reason": "stop"}]
    n_prompt, n_out = len(tok.encode(PROMPT)), len(tok.encode(OUTPUT)) + 1  # the stop token counts
    assert body["usage"] == usage_of(n_prompt, n_out)
    assert body["timings"]["prompt_n"] == n_prompt and body["timings"]["predicted_n"] == n_out
    assert_idle(engine)


def test_echo_limits_and_stop(app):
    client, _, engine, _ = app
    tok = qwen_tokenizer()
    assert post(client, echo=True).json()["choices"][0]["text"] == PROMPT + OUTPUT
    short = post(client, max_tokens=2).json()["choices"][0]
    assert short["finish_reason"] == "length" and short["text"] == tok.decode(tok.encode(OUTPUT)[:2])
    zero = post(client, max_tokens=0, echo=True).json()
    assert zero["choices"][0]["text"] == PROMPT and zero["choices"][0]["finish_reason"] == "length"
    assert zero["usage"]["completion_tokens"] == 0
    assert post(client, max_tokens=-1).json()["choices"][0]["text"] == OUTPUT
    stopped = post(client, stop=" a").json()["choices"][0]
    assert stopped == {"index": 0, "text": " there was", "logprobs": None, "finish_reason": "stop"}
    full = post(client, max_tokens=20, ignore_eos=True).json()
    assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 20
    assert_idle(engine)


def test_prompt_shapes(app):
    client, _, engine, _ = app
    ids = qwen_tokenizer().encode(PROMPT)
    for prompt in (ids, [ids], [PROMPT], [ids[0], qwen_tokenizer().decode(ids[1:])]):
        body = post(client, prompt=prompt, echo=True).json()
        assert body["choices"][0]["text"] == PROMPT + OUTPUT, prompt
    # a batch: one choice per prompt, in order, usage summed (llama.cpp's multiple prompts)
    for prompt in ([PROMPT, PROMPT], [ids, ids], [{"prompt_string": PROMPT}, ids]):
        body = post(client, prompt=prompt, echo=True).json()
        assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, PROMPT + OUTPUT), (1, PROMPT + OUTPUT)]
        assert body["usage"]["prompt_tokens"] == 2 * len(ids)
    assert_idle(engine)


def test_stream_with_usage(app):
    client, _, engine, _ = app
    tok = qwen_tokenizer()
    r = post(client, stream=True, echo=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    *chunks, finish, usage = events[:-1]
    assert chunks[0]["choices"][0]["text"] == PROMPT  # echo opens the stream
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + OUTPUT
    assert all(c["usage"] is None and c["choices"][0]["finish_reason"] is None for c in chunks)
    assert all(c["object"] == "text_completion" and c["id"] == finish["id"] for c in chunks)
    assert finish["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]
    assert "timings" not in finish
    assert usage["choices"] == [] and usage["id"] == finish["id"]
    assert usage["usage"] == usage_of(len(tok.encode(PROMPT)), len(tok.encode(OUTPUT)) + 1)
    assert usage["timings"]["predicted_n"] == usage["usage"]["completion_tokens"]
    assert_idle(engine)


def test_stream_without_usage(app):
    client, _, engine, _ = app
    events = sse(post(client, stream=True, max_tokens=3).text)
    assert events[-1] == "[DONE]"
    finish = events[-2]
    assert finish["choices"][0]["finish_reason"] == "length" and "usage" not in finish
    assert finish["timings"]["predicted_n"] == 3
    assert all("usage" not in e for e in events[:-1])
    assert_idle(engine)


def test_accepted_values(app):
    client, _, engine, _ = app
    ok = {"n": 1, "best_of": 1, "logprobs": 0, "suffix": "", "user": "u-1", "temperature": -0.5, "top_k": 0,
          "seed": -1, "repeat_penalty": 1.0, "logit_bias": {"11": 0}, "cache_prompt": False,
          "response_format": {"type": "text"}, "model": "toy-model", "unknown": [1]}
    body = post(client, **ok).json()
    assert body["choices"][0]["text"] == OUTPUT
    assert post(client, suffix=None, logprobs=None).status_code == 200
    assert_idle(engine)


BAD = [
    ({"n": 200}, 400, "invalid_value", "n"),
    ({"n": 0}, 400, "invalid_value", "n"),
    ({"best_of": 3}, 400, "best_of_not_supported", "best_of"),
    ({"best_of": 0}, 400, "invalid_value", "best_of"),
    ({"logprobs": 21}, 400, "invalid_value", "logprobs"),
    ({"logprobs": -1}, 400, "invalid_value", "logprobs"),
    ({"logprobs": 1, "echo": True}, 400, "logprobs_not_supported", "echo"),
    ({"logprobs": True}, 400, "invalid_type", "logprobs"),
    ({"suffix": "}"}, 400, "suffix_not_supported", "suffix"),
    ({"suffix": 3}, 400, "invalid_type", "suffix"),
    ({"echo": "yes"}, 400, "invalid_type", "echo"),
    ({"max_tokens": -2}, 400, "invalid_value", "max_tokens"),
    ({"max_tokens": 1.5}, 400, "invalid_type", "max_tokens"),
    ({"stream_options": {"include_usage": "y"}}, 400, "invalid_type", "stream_options.include_usage"),
    ({"stream_options": 1}, 400, "invalid_type", "stream_options"),
    ({"model": "gpt-3.5-turbo-instruct"}, 404, "model_not_found", "model"),
    ({"prompt": None}, 400, "missing_required_parameter", "prompt"),
    ({"prompt": ""}, 400, "invalid_value", "prompt"),
    ({"stop": ["x"] * 33}, 400, "invalid_value", "stop"),
    ({"tfs_z": 0.5}, 400, "tfs_z_not_supported", "tfs_z"),
    ({"grammar": "root ::= x"}, 400, "grammar_not_supported", "grammar"),
    ({"logit_bias": {"11": -100.5}}, 400, "invalid_value", "logit_bias[11]"),
    ({"logit_bias": {"x": False, "11": "y"}}, 400, "invalid_type", "logit_bias[11]"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, 400,
     "response_format_not_supported", "response_format"),
    ({"top_p": 0}, 200, None, None),
]


@pytest.mark.parametrize("body,status,code,param", BAD)
def test_refusals(app, body, status, code, param):
    client, _, engine, _ = app
    r = post(client, **body)
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        assert_error(r, status, code, param)
    assert post(client).json()["choices"][0]["text"] == OUTPUT  # still serves
    assert_idle(engine)


def test_stream_error_event(app):
    client, _, engine, runner = app
    runner.fail_if = lambda kind, views, tokens: kind == "decode"
    events = sse(post(client, stream=True).text)
    assert events[-1]["error"]["code"] == "server_error" and "[DONE]" not in events
    assert_error(post(client), 500, "server_error", None, type_="server_error")
    runner.fail_if = None
    assert post(client).status_code == 200
    assert_idle(engine)


def test_kv_pool_refusals_name_the_raw_fields(raw_app):
    client, _, engine, _ = raw_app(policy=script({PROMPT: OUTPUT}), engine_options={"kv_capacity": 256})
    assert_error(post(client, max_tokens=1000), 400, "context_length_exceeded", "max_tokens")
    r = client.post("/completion", json={"prompt": PROMPT, "n_predict": 1000})
    assert_error(r, 400, "context_length_exceeded", "n_predict")
    assert_error(post(client, prompt=[11] * 300), 400, "context_length_exceeded", "prompt")
    assert post(client, max_tokens=100).json()["choices"][0]["text"] == OUTPUT
    assert_idle(engine)


def test_long_raw_prompts_keep_a_checkpoint_one_token_short(app):
    client, _, engine, _ = app
    seen = []
    submit = engine.submit
    engine.submit = lambda req: (seen.append(req), submit(req))[1]
    assert post(client, max_tokens=1).status_code == 200
    short = seen[-1].checkpoint_hints
    assert short.turn_closure is None and short.boundaries == [] and short.stable_prefix is None
    # a raw prompt has no message structure, even when it holds ChatML control tokens
    ids = [248045] + [11] * 600
    assert client.post("/completion", json={"prompt": ids, "n_predict": 1}).status_code == 200
    long = seen[-1].checkpoint_hints
    assert long.turn_closure == len(ids) - 1 and long.boundaries == [] and long.stable_prefix is None
    assert_idle(engine)


def test_logprobs_of_generated_tokens(app):
    client, _, engine, _ = app
    tok = qwen_tokenizer()
    ids = tok.encode(OUTPUT)
    body = post(client, logprobs=3, temperature=0).json()
    lp = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"] == OUTPUT
    assert lp["tokens"] == [tok.decode([i]) for i in ids]  # the stop token has no record
    assert lp["token_logprobs"] == pytest.approx([0.0] * len(ids), abs=1e-6)  # forced: probability 1
    assert all(len(top) == 3 and top[t] == pytest.approx(0.0, abs=1e-6)
               for top, t in zip(lp["top_logprobs"], lp["tokens"]))
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets
    # 0 asks for nothing (as the spec's neutral value)
    assert post(client, logprobs=0).json()["choices"][0]["logprobs"] is None
    assert_idle(engine)


def test_logprobs_values_and_stop_strings(raw_app):
    client, _, engine, _ = raw_app()  # the toy model's own logits
    tok = qwen_tokenizer()
    from ninfer_core.engine.model_api import SeqView
    from ninfer_core.testing import ToyRunner

    prompt = tok.encode(PROMPT)
    body = post(client, logprobs=5, temperature=0, max_tokens=6, ignore_eos=True).json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 6 and all(len(t) == 5 for t in lp["top_logprobs"])
    r = ToyRunner(vocab_size=tok.vocab_size)
    r.allocate_cache(4, 1)
    r.reset_slot(0)
    first = torch.log_softmax(r.prefill(SeqView(0, [0, 1, 2, 3], 0), prompt).float(), -1)
    assert lp["token_logprobs"][0] == pytest.approx(first.max().item(), abs=1e-5)  # greedy: the top one
    assert list(lp["top_logprobs"][0].values())[0] == pytest.approx(first.max().item(), abs=1e-5)
    assert all(a >= b for top in lp["top_logprobs"] for a, b in zip(list(top.values()), list(top.values())[1:]))
    # streamed records are the aggregate's, split over the chunks that carry their text
    events = sse(post(client, logprobs=5, temperature=0, max_tokens=6, ignore_eos=True, stream=True).text)
    streamed = [e["choices"][0]["logprobs"] for e in events[:-2]]
    assert [t for s in streamed for t in s["tokens"]] == lp["tokens"]
    assert [o for s in streamed for o in s["text_offset"]] == lp["text_offset"]
    assert events[-2]["choices"][0]["logprobs"] is None  # the finish chunk
    assert_idle(engine)


def test_a_stop_string_drops_the_records_it_cuts(app):
    client, _, engine, _ = app
    tok = qwen_tokenizer()
    body = post(client, logprobs=1, temperature=0, stop=" a").json()["choices"][0]
    assert body["text"] == " there was"
    assert "".join(body["logprobs"]["tokens"]) == " there was"
    assert len(body["logprobs"]["tokens"]) == len(tok.encode(" there was"))
    assert_idle(engine)


def test_stream_timings_per_token(app):
    client, _, engine, _ = app
    events = sse(post(client, stream=True, timings_per_token=True).text)
    text_chunks = [e for e in events[:-2] if e["choices"][0]["text"]]
    assert text_chunks and all("timings" in e for e in text_chunks)
    predicted = [e["timings"]["predicted_n"] for e in text_chunks]
    assert predicted == sorted(predicted) and predicted[0] >= 1
    assert all(e["timings"]["prompt_n"] == len(qwen_tokenizer().encode(PROMPT)) for e in text_chunks)
    assert "timings" in events[-2]  # the engine's own on the finish chunk
    plain = sse(post(client, stream=True).text)
    assert all("timings" not in e for e in plain[:-2])
    assert_idle(engine)


def test_n_completions_per_prompt(app):
    """OpenAI's n (llama.cpp's n_cmpl): choice i * n + j is the j-th completion of prompt i."""
    client, _, engine, _ = app
    body = post(client, prompt=[PROMPT, PROMPT], n=2, max_tokens=3).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 12
    llama = client.post("/completion", json={"prompt": PROMPT, "n_cmpl": 3, "n_predict": 2}).json()
    assert [o["index"] for o in llama] == [0, 1, 2]
    seeds = {o["generation_settings"]["seed"] for o in client.post(
        "/completion", json={"prompt": PROMPT, "n_cmpl": 3, "n_predict": 1, "seed": 5}).json()}
    assert seeds == {5, 6, 7}  # each copy draws from its own seed
    assert_error(client.post("/completion", json={"prompt": PROMPT, "n_cmpl": 0}), 400, "invalid_value", "n_cmpl")
    assert_error(client.post("/completion", json={"prompt": [PROMPT] * 65, "n_cmpl": 2}), 400, "invalid_value",
                 "n_cmpl")
    assert_idle(engine)
