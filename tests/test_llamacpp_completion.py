"""llama.cpp's POST /completion (and /completions): fields, prompt shapes, response object, stream.

The app runs a real Engine over the toy runner with the real Qwen3.5 tokenizer; outputs are forced
per prompt (tests/test_llamacpp_helpers.py), so every field is asserted exactly.
"""

from __future__ import annotations

import pytest
from test_llamacpp_helpers import assert_error, assert_idle, qwen_tokenizer, raw_app, script, sse  # noqa: F401

from ninfer_core.protocols.raw_prompt import NEUTRAL_ONLY

PROMPT = "The capital of France is"
OUTPUT = " Paris.\nIt is"
TIMINGS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
           "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}
FINAL_KEYS = {"index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
              "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
              "tokens_cached", "timings"}


@pytest.fixture
def app(raw_app):
    return raw_app(policy=script({PROMPT: OUTPUT, "<|im_start|>user\nHi": "Hello!"}))


def post(client, path="/completion", **body):
    body.setdefault("prompt", PROMPT)
    return client.post(path, json=body)


def test_aggregate_object(app):
    client, ctx, engine, _ = app
    tok = qwen_tokenizer()
    r = post(client, n_predict=16, return_tokens=True)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"].startswith("req_")
    body = r.json()
    assert set(body) == FINAL_KEYS
    out_ids = tok.encode(OUTPUT)
    assert body["content"] == OUTPUT
    assert body["tokens"] == out_ids + [tok.token_to_id("<|im_end|>")]  # the stop token is generated
    assert body["stop"] is True and body["stop_type"] == "eos" and body["stopping_word"] == ""
    assert body["tokens_predicted"] == len(out_ids) + 1
    assert body["tokens_evaluated"] == len(tok.encode(PROMPT)) and body["tokens_cached"] == 0
    assert body["prompt"] == PROMPT and body["model"] == "toy-model" and body["index"] == 0
    assert body["has_new_line"] is True and body["truncated"] is False and body["id_slot"] == -1
    assert set(body["timings"]) >= TIMINGS
    assert body["timings"]["predicted_n"] == body["tokens_predicted"]
    gs = body["generation_settings"]
    assert gs["n_predict"] == 16 and gs["stop"] == [] and gs["stream"] is False and gs["model"] == "toy-model"
    assert gs["temperature"] == 1.0 and gs["top_k"] == 20 and gs["top_p"] == 0.95  # the thinking preset
    assert isinstance(gs["seed"], int)
    assert_idle(engine)


def test_completions_alias_and_tokens_only_with_return_tokens(app):
    client, _, engine, _ = app
    body = post(client, "/completions").json()
    assert body["content"] == OUTPUT and body["tokens"] == []
    assert_idle(engine)


def test_stop_word(app):
    client, _, engine, _ = app
    body = post(client, stop=["\n", "zzz"]).json()
    assert body["content"] == " Paris."
    assert body["stop_type"] == "word" and body["stopping_word"] == "\n"
    assert body["has_new_line"] is False
    assert body["generation_settings"]["stop"] == ["\n", "zzz"]
    body = post(client, stop="Paris").json()
    assert body["content"] == " " and body["stopping_word"] == "Paris"
    assert_idle(engine)


def test_limits(app):
    client, _, engine, _ = app
    tok = qwen_tokenizer()
    body = post(client, n_predict=2, return_tokens=True).json()
    assert body["stop_type"] == "limit" and body["tokens_predicted"] == 2
    assert body["content"] == tok.decode(tok.encode(OUTPUT)[:2])
    # n_predict wins over max_tokens; max_tokens applies alone
    assert post(client, n_predict=1, max_tokens=3).json()["tokens_predicted"] == 1
    assert post(client, max_tokens=3).json()["tokens_predicted"] == 3
    zero = post(client, n_predict=0).json()
    assert zero["content"] == "" and zero["tokens_predicted"] == 0 and zero["stop_type"] == "limit"
    # any negative value is "no limit": the default output limit
    for n in (-1, -7):
        body = post(client, n_predict=n).json()
        assert body["stop_type"] == "eos"
        assert body["generation_settings"]["n_predict"] == engine.default_output_limit(body["tokens_evaluated"])
    assert_idle(engine)


def test_ignore_eos_runs_to_the_limit(app):
    client, _, engine, _ = app
    body = post(client, n_predict=9, ignore_eos=True).json()
    assert body["stop_type"] == "limit" and body["tokens_predicted"] == 9
    assert body["content"] == OUTPUT  # the forced end tokens are special: no text
    assert_idle(engine)


def test_prompt_shapes(app):
    client, _, engine, _ = app
    tok = qwen_tokenizer()
    ids = tok.encode(PROMPT)
    for prompt in (ids, [ids], [PROMPT], [ids[0], tok.decode(ids[1:])]):
        body = post(client, prompt=prompt).json()
        assert body["content"] == OUTPUT, prompt
        assert body["tokens_evaluated"] == len(ids) and body["prompt"] == PROMPT
    # mixed ids and text, and special-token text in a string, both encode the control token
    for prompt in ([248045, "user\nHi"], "<|im_start|>user\nHi"):
        body = post(client, prompt=prompt).json()
        assert body["content"] == "Hello!", prompt
        assert body["tokens_evaluated"] == 1 + len(tok.encode("user\nHi"))
        assert body["prompt"] == "<|im_start|>user\nHi"
    assert_idle(engine)


BAD_PROMPTS = [
    ({}, "missing_required_parameter", "prompt"),
    ({"prompt": None}, "missing_required_parameter", "prompt"),
    ({"prompt": 5}, "invalid_type", "prompt"),
    ({"prompt": {"text": "x"}}, "missing_required_parameter", "prompt.prompt_string"),
    ({"prompt": {"prompt_string": 5}}, "invalid_type", "prompt.prompt_string"),
    ({"prompt": {"prompt_string": "x", "multimodal_data": "abc"}}, "invalid_type", "prompt.multimodal_data"),
    ({"prompt": {"prompt_string": "x", "multimodal_data": ["aGk="]}}, "vision_disabled", "prompt.multimodal_data"),
    ({"prompt": []}, "invalid_value", "prompt"),
    ({"prompt": [[]]}, "invalid_value", "prompt[0]"),
    ({"prompt": [True]}, "invalid_type", "prompt[0]"),
    ({"prompt": ""}, "invalid_value", "prompt"),
    ({"prompt": ["a", ""]}, "invalid_value", "prompt[1]"),
    ({"prompt": [[1, 2], [3, True]]}, "invalid_type", "prompt[1][1]"),
    ({"prompt": [[1, 2], [[3]]]}, "invalid_type", "prompt[1][0]"),
    ({"prompt": ["x"] * 129}, "invalid_value", "prompt"),
    ({"prompt": [1, {"a": 1}]}, "invalid_type", "prompt[1]"),
    ({"prompt": [1, 10**9]}, "invalid_value", "prompt[1]"),
    ({"prompt": [-1]}, "invalid_value", "prompt[0]"),
    ({"prompt": [11] * 3000}, "context_length_exceeded", "prompt"),
]


@pytest.mark.parametrize("body,code,param", BAD_PROMPTS)
def test_bad_prompts(app, body, code, param):
    client, _, engine, _ = app
    r = client.post("/completion", json={"n_predict": 4, **body})
    assert_error(r, 400, code, param)
    assert post(client).json()["content"] == OUTPUT  # still serves
    assert_idle(engine)


NOT_NEUTRAL = {"repeat_penalty": 1.1, "typical_p": 0.9, "tfs_z": 0.5, "dynatemp_range": 0.5, "mirostat": 2,
               "xtc_probability": 0.1, "dry_multiplier": 0.8, "top_n_sigma": 1.0, "n_indent": 2,
               "t_max_predict_ms": 100}
NEUTRAL = {"repeat_penalty": 1, "typical_p": 1.0, "tfs_z": 1.0, "dynatemp_range": 0, "mirostat": 0,
           "xtc_probability": 0.0, "dry_multiplier": 0, "top_n_sigma": -1, "n_indent": 0,
           "t_max_predict_ms": 0}


def test_every_neutral_only_control_is_covered():
    assert set(NOT_NEUTRAL) == set(NEUTRAL) == {name for name, _, _ in NEUTRAL_ONLY}


@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
@pytest.mark.parametrize("field", sorted(NOT_NEUTRAL))
def test_sampler_controls_refused_unless_neutral(app, path, field):
    client, _, engine, _ = app
    assert_error(post(client, path, **{field: NOT_NEUTRAL[field]}), 400, f"{field}_not_supported", field)
    r = post(client, path, **{field: NEUTRAL[field]})
    assert r.status_code == 200, r.text
    assert_idle(engine)


ACCEPTED_WITHOUT_EFFECT = {
    "samplers": ["top_k", "temperature"], "n_keep": 4, "min_keep": 1, "id_slot": 3, "cache_prompt": False,
    "repeat_last_n": 64, "penalize_nl": True, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "xtc_threshold": 0.1,
    "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n"],
    "dynatemp_exponent": 1.0, "grammar": "", "lora": [], "logit_bias": {"11": 0}, "response_format": {"type": "text"},
    "timings_per_token": False, "unknown_field": {"x": 1},
}


def test_fields_accepted_without_effect(app):
    client, _, engine, _ = app
    body = post(client, **ACCEPTED_WITHOUT_EFFECT).json()
    assert body["content"] == OUTPUT and body["id_slot"] == -1
    assert body["generation_settings"]["cache_prompt"] is False
    assert post(client, logit_bias=[[11, 0], [12, 0.0]]).json()["content"] == OUTPUT
    assert_idle(engine)


BAD_FIELDS = [
    ({"grammar": "root ::= \"a\""}, "grammar_not_supported", "grammar"),
    ({"grammar": 5}, "invalid_type", "grammar"),
    ({"lora": [{"id": 0, "scale": 1.0}]}, "lora_not_supported", "lora"),
    ({"lora": "x"}, "invalid_type", "lora"),
    ({"logit_bias": {"11": 101}}, "invalid_value", "logit_bias[11]"),
    ({"logit_bias": [[11, True]]}, "invalid_type", "logit_bias[0][1]"),
    ({"logit_bias": [[10**9, -1]]}, "invalid_value", "logit_bias[0][0]"),
    ({"logit_bias": [["", -1]]}, "invalid_value", "logit_bias[0][0]"),
    ({"logit_bias": [[None, -1]]}, "invalid_type", "logit_bias[0][0]"),
    ({"logit_bias": [11]}, "invalid_type", "logit_bias[0]"),
    ({"n_probs": 21}, "invalid_value", "n_probs"),
    ({"n_probs": -1}, "invalid_value", "n_probs"),
    ({"post_sampling_probs": "yes"}, "invalid_type", "post_sampling_probs"),
    ({"logit_bias": {"11": "x"}}, "invalid_type", "logit_bias[11]"),
    ({"logit_bias": 3}, "invalid_type", "logit_bias"),
    ({"json_schema": {}}, "json_schema_not_supported", "json_schema"),
    ({"response_format": {"type": "json_object"}}, "response_format_not_supported", "response_format"),
    ({"response_format": {"type": "yaml"}}, "invalid_value", "response_format.type"),
    ({"response_format": "json"}, "invalid_type", "response_format"),
    ({"temperature": "hot"}, "invalid_type", "temperature"),
    ({"top_p": 1.5}, "invalid_value", "top_p"),
    ({"min_p": -0.1}, "invalid_value", "min_p"),
    ({"presence_penalty": 3}, "invalid_value", "presence_penalty"),
    ({"frequency_penalty": True}, "invalid_type", "frequency_penalty"),
    ({"top_k": 2.5}, "invalid_type", "top_k"),
    ({"seed": 2**63}, "invalid_value", "seed"),
    ({"n_predict": "8"}, "invalid_type", "n_predict"),
    ({"stream": "yes"}, "invalid_type", "stream"),
    ({"return_tokens": 1}, "invalid_type", "return_tokens"),
    ({"response_fields": "content"}, "invalid_type", "response_fields"),
    ({"response_fields": [""]}, "invalid_value", "response_fields[0]"),
    ({"stop": 5}, "invalid_type", "stop"),
    ({"stop": ["a", 5]}, "invalid_type", "stop[1]"),
    ({"stop": [""]}, "invalid_value", "stop[0]"),
    ({"stop": [str(i) for i in range(33)]}, "invalid_value", "stop"),
    ({"id_slot": "a"}, "invalid_type", "id_slot"),
    ({"cache_prompt": "no"}, "invalid_type", "cache_prompt"),
    ({"mirostat": 1.5}, "invalid_type", "mirostat"),
]


@pytest.mark.parametrize("body,code,param", BAD_FIELDS)
def test_bad_fields(app, body, code, param):
    client, _, engine, _ = app
    assert_error(post(client, **body), 400, code, param)
    assert post(client).status_code == 200
    assert_idle(engine)


def test_model_must_be_the_served_one(app):
    client, _, _, _ = app
    assert_error(post(client, model="other"), 404, "model_not_found", "model")
    assert_error(post(client, model=3), 400, "invalid_type", "model")
    assert post(client, model="toy-model").status_code == 200
    assert post(client, model="").status_code == 200


def test_malformed_bodies(app):
    client, _, _, _ = app
    r = client.post("/completion", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_json", None)
    assert_error(client.post("/completion", json=[1, 2]), 400, "invalid_type", None)
    assert post(client).status_code == 200


def test_sampler_resolution(app):
    client, _, engine, _ = app
    gs = post(client, temperature=-1, top_k=0, seed=42, top_p=0.5, min_p=0.1).json()["generation_settings"]
    assert gs["temperature"] == 0.0 and gs["top_k"] == 20 and gs["seed"] == 42
    assert gs["top_p"] == 0.5 and gs["min_p"] == 0.1
    assert post(client, top_k=-3).json()["generation_settings"]["top_k"] == 20
    assert post(client, top_k=50).json()["generation_settings"]["top_k"] == 20
    assert post(client, top_k=5).json()["generation_settings"]["top_k"] == 5
    seeds = {post(client, seed=-1).json()["generation_settings"]["seed"] for _ in range(3)}
    assert len(seeds) == 3  # a negative seed draws a fresh one each time
    assert_idle(engine)


def test_seeded_sampling_repeats(raw_app):
    client, _, engine, _ = raw_app()  # no forced output: the toy model's own logits
    a = post(client, seed=7, n_predict=6, temperature=1.0, return_tokens=True, ignore_eos=True).json()
    b = post(client, seed=7, n_predict=6, temperature=1.0, return_tokens=True, ignore_eos=True).json()
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 6
    g1 = post(client, temperature=-0.5, n_predict=6, return_tokens=True, ignore_eos=True).json()
    g2 = post(client, temperature=0, n_predict=6, return_tokens=True, ignore_eos=True, seed=99).json()
    assert g1["tokens"] == g2["tokens"]  # below zero is greedy, whatever the seed
    assert_idle(engine)


def test_process_seed_is_the_default(raw_app):
    client, _, _, _ = raw_app(engine_options={"seed": 1234})
    # two tokens each: the seed is reported whatever the length (unbounded, the toy model's own logits
    # ran to the context limit, 18 s of the suite for three numbers)
    assert post(client, n_predict=2).json()["generation_settings"]["seed"] == 1234
    assert post(client, n_predict=2, seed=-1).json()["generation_settings"]["seed"] == 1234
    assert post(client, n_predict=2, seed=5).json()["generation_settings"]["seed"] == 5


def test_response_fields(app):
    client, _, engine, _ = app
    tok = qwen_tokenizer()
    body = post(client, n_predict=2, response_fields=["content", "generation_settings/n_predict", "nope",
                                                      "timings/predicted_n", "stop_type"]).json()
    assert body == {"content": tok.decode(tok.encode(OUTPUT)[:2]), "generation_settings/n_predict": 2,
                    "timings/predicted_n": 2, "stop_type": "limit"}
    assert_idle(engine)


def test_stream(app):
    client, _, engine, _ = app
    tok = qwen_tokenizer()
    r = post(client, stream=True, return_tokens=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert "[DONE]" not in events
    *chunks, final = events
    assert chunks and all(c["stop"] is False and c["tokens"] == [] and c["id_slot"] == -1 for c in chunks)
    assert "".join(c["content"] for c in chunks) == OUTPUT
    counts = [c["tokens_predicted"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == len(tok.encode(OUTPUT))
    assert all(c["tokens_evaluated"] == len(tok.encode(PROMPT)) for c in chunks)
    assert "timings" not in chunks[0]
    assert set(final) == FINAL_KEYS and final["content"] == "" and final["stop"] is True
    assert final["tokens"] == tok.encode(OUTPUT) + [tok.token_to_id("<|im_end|>")]
    assert final["stop_type"] == "eos" and final["generation_settings"]["stream"] is True
    assert_idle(engine)


def test_stream_stop_word_and_response_fields(app):
    client, _, engine, _ = app
    events = sse(post(client, stream=True, stop=["\n"], response_fields=["content", "stop_type"]).text)
    assert events[-1] == {"content": "", "stop_type": "word"}
    assert "".join(e["content"] for e in events[:-1]) == " Paris."
    assert all(set(e) == {"content"} for e in events[:-1])
    assert_idle(engine)


def test_stream_timings_per_token_and_progress(app):
    client, _, engine, _ = app
    tok = qwen_tokenizer()
    total = len(tok.encode(PROMPT))
    events = sse(post(client, stream=True, timings_per_token=True, return_progress=True).text)
    progress = [e for e in events if "prompt_progress" in e]
    content = [e for e in events if e.get("content") and "prompt_progress" not in e]
    assert [p["prompt_progress"]["processed"] for p in progress] == [0, total]
    assert all(p["prompt_progress"]["total"] == total and p["prompt_progress"]["cache"] == 0 for p in progress)
    assert events.index(progress[-1]) < events.index(content[0])  # the final progress precedes output
    assert all(set(e["timings"]) >= TIMINGS for e in progress + content)
    assert progress[0]["timings"]["predicted_n"] == 0
    predicted = [e["timings"]["predicted_n"] for e in content]
    assert predicted == sorted(predicted) and predicted[0] >= 1
    assert set(events[-1]["timings"]) >= TIMINGS and events[-1]["stop"] is True
    assert_idle(engine)


def test_engine_failure(app):
    client, _, engine, runner = app
    runner.fail_if = lambda kind, views, tokens: kind == "decode"
    r = post(client)
    assert_error(r, 500, "server_error", None, type_="server_error")
    events = sse(post(client, stream=True).text)
    assert events[-1]["error"]["code"] == "server_error"
    runner.fail_if = None
    assert post(client).json()["content"] == OUTPUT
    assert_idle(engine)


def test_overload_is_429_and_releases(raw_app):
    client, ctx, engine, _ = raw_app(policy=script({PROMPT: OUTPUT}))
    ctx.ingress.admitted = ctx.ingress.capacity  # every ingress unit held
    assert_error(post(client), 429, "server_overloaded", None, type_="server_overloaded")
    ctx.ingress.admitted = 0
    assert post(client).status_code == 200
    assert ctx.ingress.admitted == 0
    assert_error(post(client, prompt=""), 400, "invalid_value", "prompt")
    assert ctx.ingress.admitted == 0  # a refused request gives its unit back
    assert_idle(engine)


# -- batches of prompts (llama.cpp: one result per prompt) -------------------------------------------

def test_batch_answers_an_array_in_prompt_order(raw_app):
    client, _, engine, _ = raw_app(policy=script({PROMPT: OUTPUT, "<|im_start|>user\nHi": "Hello!"}),
                                   engine_options={"max_concurrency": 2})
    hi = qwen_tokenizer().encode("<|im_start|>user\nHi")
    body = post(client, prompt=[PROMPT, hi, {"prompt_string": PROMPT}], response_fields=["index", "content"]).json()
    assert body == [{"index": 0, "content": OUTPUT}, {"index": 1, "content": "Hello!"},
                    {"index": 2, "content": OUTPUT}]
    # a one-prompt batch answers like that prompt alone
    one = post(client, prompt=[PROMPT]).json()
    assert isinstance(one, dict) and one["content"] == OUTPUT and one["index"] == 0
    events = sse(post(client, prompt=[PROMPT, hi], stream=True).text)
    finals = [e for e in events if e["stop"]]
    assert sorted(e["index"] for e in finals) == [0, 1]
    assert "".join(e["content"] for e in events if e["index"] == 1) == "Hello!"
    assert_idle(engine)


def test_batch_failure_cancels_the_other_prompts(raw_app):
    client, _, engine, _ = raw_app(policy=script({PROMPT: OUTPUT}))
    too_long = [11] * 3000
    assert_error(post(client, prompt=[PROMPT, too_long]), 400, "context_length_exceeded", "prompt[1]")
    assert_idle(engine)
    # one lane: prompt 1 is submitted after the stream started, so its refusal ends the stream
    events = sse(post(client, prompt=[PROMPT, too_long], stream=True, n_predict=4).text)
    assert events[-1]["error"]["code"] == "context_length_exceeded" and events[-1]["error"]["param"] == "prompt[1]"
    assert_idle(engine)
    assert post(client).json()["content"] == OUTPUT


def test_n_probs_with_the_toy_model(app):
    client, _, engine, _ = app
    tok = qwen_tokenizer()
    body = post(client, n_probs=2, temperature=0, return_tokens=True).json()
    probs = body["completion_probabilities"]
    end = tok.token_to_id("<|im_end|>")
    # the engine records no probabilities for the stop token (llama.cpp lists it too)
    assert body["tokens"][-1] == end and [p["id"] for p in probs] == body["tokens"][:-1]
    assert all(len(p["top_logprobs"]) == 2 and p["top_logprobs"][0]["id"] == p["id"] for p in probs)
    alternatives = [t for p in probs for t in p["top_logprobs"][1:]]
    assert all(t["token"] == "" and t["bytes"] == [] for t in alternatives if tok.is_special(t["id"]))
    post_body = post(client, n_probs=2, post_sampling_probs=True, temperature=0).json()
    assert all(p["prob"] == 1.0 for p in post_body["completion_probabilities"])
    assert_idle(engine)
