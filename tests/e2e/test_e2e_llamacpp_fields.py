"""End-to-end, issue 27: the request fields llama-server's clients rely on, against the real
`ninfer serve` (tiny random Qwen3.5 artifact, one lane): logit_bias in every form, n_probs with
completion_probabilities and post_sampling_probs, verbose's __verbose, the null role-chunk content,
prompt objects and batches of prompts.

llama.cpp behaviour cited from ggml-org/llama.cpp tools/server: README.md ("POST /completion"
options and response), server-task.cpp (params_from_json_cmpl's logit_bias parsing,
completion_token_output::probs_vector_to_json, to_json_non_oaicompat / to_json_oaicompat*),
server-context.cpp (handle_completions_impl: one result per prompt) and server-common.cpp
(tokenize_input_prompts, tokenize_input_subprompt). Random weights write random text, so outputs
are compared with themselves (greedy runs) and with what the bias forces.
"""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-qwen35-dense"
PROMPT = "Once upon a time"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer():
    from qwen_format import qwen35_tokenizer_section, with_format

    from ninfer_core.tokenizer import Tokenizer

    return with_format(Tokenizer.from_section(qwen35_tokenizer_section()))


def events_of(text: str) -> list:
    return [json.loads(b[len("data: "):]) if b != "data: [DONE]" else "[DONE]"
            for b in text.split("\n\n") if b and not b.startswith(":")]


def one_token(http, text: str) -> int:
    ids = http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert len(ids) == 1, ids
    return ids[0]


def complete(http, **body) -> dict:
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 6, "return_tokens": True, **GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


# -- logit_bias -------------------------------------------------------------------------------------

def test_logit_bias_every_form_on_completion(http):
    """README /completion `logit_bias`: `[[15043, 1.0]]` raises a token, `[[15043, false]]` bans it,
    `[["Hello, World!", -0.5]]` applies to every token of the string, and an OpenAI map
    `{"<string or token id>": bias}` is accepted too (server-task.cpp params_from_json_cmpl: an integer
    key is a token id, any other key is tokenized). Greedy honours the bias (temperature 0 takes the
    argmax of the biased logits), as does sampling."""
    hello = one_token(http, "Hello")
    plain = complete(http)["tokens"]
    for bias in ([[hello, 100]], [["Hello", 100]], {str(hello): 100}, {"Hello": 100}):
        body = complete(http, logit_bias=bias)
        assert body["tokens"] == [hello] * 6, bias
        assert body["generation_settings"]["logit_bias"] == [{"bias": 100.0, "token": hello}]
    sampled = complete(http, logit_bias=[[hello, 100]], temperature=1.0, top_k=20, seed=7)
    assert sampled["tokens"] == [hello] * 6
    # a ban holds at every position: the greedy choice moves elsewhere and never comes back
    banned = complete(http, logit_bias=[[plain[0], False]])
    assert plain[0] not in banned["tokens"] and banned["tokens"] != plain
    assert banned["generation_settings"]["logit_bias"] == [{"bias": None, "token": plain[0]}]
    # an all-zero bias changes nothing
    assert complete(http, logit_bias={str(plain[0]): 0})["tokens"] == plain


def test_logit_bias_on_openai_routes(live_server, http, tokenizer):
    """OpenAI's Chat Completions and legacy Completions take the map `{"token id": bias}` (-100..100);
    llama-server passes the same field to its sampler on those routes (oaicompat_*_params_parse copies
    it), so the list forms are accepted there too."""
    hello = one_token(http, "Hello")
    with openai.OpenAI(base_url=live_server.api_base, api_key="x", max_retries=0, timeout=120) as client:
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
            logit_bias={str(hello): 100},
            extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
        assert chat.choices[0].message.content == tokenizer.decode([hello] * 5)
        legacy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                           logit_bias={str(hello): 100}, extra_body={"ignore_eos": True})
        assert legacy.choices[0].text == tokenizer.decode([hello] * 5)
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
        "logit_bias": [["Hello", 100]], "chat_template_kwargs": {"enable_thinking": False}})
    assert r.json()["choices"][0]["message"]["content"] == tokenizer.decode([hello] * 3)


@pytest.mark.parametrize("path,bias,code,param", [
    ("/completion", {"5": 100.5}, "invalid_value", "logit_bias[5]"),
    ("/completion", [[10**9, 1]], "invalid_value", "logit_bias[0][0]"),
    ("/completion", [["", 1]], "invalid_value", "logit_bias[0][0]"),
    ("/completion", [[5, True]], "invalid_type", "logit_bias[0][1]"),
    ("/completion", [5], "invalid_type", "logit_bias[0]"),
    ("/completion", "x", "invalid_type", "logit_bias"),
    ("/v1/completions", {"5": "x"}, "invalid_type", "logit_bias[5]"),
    ("/v1/chat/completions", {"-3": 1}, "invalid_value", "logit_bias.-3"),
])
def test_logit_bias_refusals(http, path, bias, code, param):
    """NInfer refuses what llama.cpp would skip silently (an out-of-range id, an empty string, a bad
    value), in the protocol's envelope with the entry's path; the server keeps serving."""
    body = {"logit_bias": bias, "max_tokens": 2}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "x"})
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error")
    assert complete(http)["tokens_predicted"] == 6


# -- n_probs / completion_probabilities --------------------------------------------------------------

def _check_entry(entry: dict, key: str) -> None:
    assert set(entry) == {"id", "token", "bytes", key, f"top_{key}s" if key == "prob" else "top_logprobs"}


def test_n_probs_completion_probabilities(http, tokenizer):
    """README /completion `n_probs` and the response's `completion_probabilities`: per generated token
    {id, token, bytes, logprob, top_logprobs: [{id, token, bytes, logprob}] (at most n_probs)};
    server-task.cpp puts them on the final object of a non-streamed request and on each streamed
    partial instead. Greedy: the top alternative is the token itself."""
    body = complete(http, n_probs=3)
    probs = body["completion_probabilities"]
    assert [p["id"] for p in probs] == body["tokens"] and len(probs) == body["tokens_predicted"]
    for p in probs:
        _check_entry(p, "logprob")
        assert len(p["top_logprobs"]) == 3
        tops = [t["logprob"] for t in p["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and all(t <= 0 for t in tops)
        assert p["top_logprobs"][0]["id"] == p["id"] and p["top_logprobs"][0]["logprob"] == p["logprob"]
        assert bytes(p["bytes"]) == tokenizer.token_bytes(p["id"])
        assert p["token"] == bytes(p["bytes"]).decode("utf-8", errors="ignore")
    assert body["generation_settings"]["n_probs"] == 3
    # streamed: every chunk carries its tokens' entries; the final object carries none
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 6, "n_probs": 3, "stream": True, **GREEDY})
    events = events_of(r.text)
    streamed = [p for e in events[:-1] for p in e.get("completion_probabilities", [])]
    assert streamed == probs
    assert "completion_probabilities" not in events[-1] and events[-1]["stop"] is True
    # a bias shows in the reported distribution: the raised token leads it
    hello = one_token(http, "Hello")
    biased = complete(http, n_probs=1, logit_bias=[[hello, 100]])["completion_probabilities"]
    assert all(p["top_logprobs"][0]["id"] == hello and p["logprob"] > -1e-3 for p in biased)


def test_post_sampling_probs(http):
    """README `post_sampling_probs`: `logprob` becomes `prob` (0..1) and `top_logprobs` `top_probs`,
    the probabilities after the sampling chain, possibly fewer than n_probs. With top_k 3 at most three
    candidates survive and their probabilities sum to 1; greedy leaves one candidate with 1.0."""
    body = complete(http, n_probs=5, post_sampling_probs=True, temperature=1.0, top_k=3, top_p=1.0, min_p=0.0,
                    seed=11)
    for p in body["completion_probabilities"]:
        _check_entry(p, "prob")
        tops = p["top_probs"]
        assert 1 <= len(tops) <= 3 and math.isclose(sum(t["prob"] for t in tops), 1.0, rel_tol=1e-4)
        assert [t["prob"] for t in tops] == sorted((t["prob"] for t in tops), reverse=True)
        assert p["prob"] == next(t["prob"] for t in tops if t["id"] == p["id"])
    greedy = complete(http, n_probs=5, post_sampling_probs=True)
    for p in greedy["completion_probabilities"]:
        assert p["prob"] == 1.0 and [(t["id"], t["prob"]) for t in p["top_probs"]] == [(p["id"], 1.0)]
    assert greedy["generation_settings"]["post_sampling_probs"] is True


def test_n_probs_refusals(http):
    for value, code in ((21, "invalid_value"), (-1, "invalid_value"), ("3", "invalid_type")):
        r = http.post("/completion", json={"prompt": "x", "n_probs": value})
        assert r.status_code == 400 and (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, "n_probs")
    assert complete(http, n_probs=0)["tokens_predicted"] == 6


# -- verbose and the role chunk ---------------------------------------------------------------------

def test_verbose_and_null_role_content(http):
    """server-task.cpp: with verbose the OpenAI-shaped result carries `__verbose`, the same result in
    /completion's shape (to_json_non_oaicompat); a stream puts it on the first chunk of the final
    group. The first streamed chat delta is {"role": "assistant", "content": null}
    (to_json_oaicompat_chat's initial update)."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "verbose": True, **GREEDY}
    body = http.post("/v1/chat/completions", json=chat).json()
    v = body["__verbose"]
    assert v["stop"] is True and v["tokens_predicted"] == body["usage"]["completion_tokens"]
    assert v["tokens_evaluated"] == body["usage"]["prompt_tokens"] and v["model"] == MODEL
    prompt = http.post("/apply-template", json=chat).json()["prompt"]
    assert v["prompt"] == prompt and v["generation_settings"]["n_predict"] == 4
    assert "__verbose" not in http.post("/v1/chat/completions", json={**chat, "verbose": False}).json()
    events = events_of(http.post("/v1/chat/completions", json={**chat, "stream": True}).text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    finish = next(e for e in events if e != "[DONE]" and e["choices"] and e["choices"][0]["finish_reason"])
    assert finish["__verbose"]["content"] == "" and finish["__verbose"]["tokens_predicted"] == 4
    legacy = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "verbose": True, **GREEDY}).json()
    assert legacy["__verbose"]["content"] == legacy["choices"][0]["text"]
    assert legacy["__verbose"]["stop_type"] == "limit"
    chunks = events_of(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "verbose": True,
                                                          "stream": True, **GREEDY}).text)
    texts = [c for c in chunks[:-1] if c["choices"][0]["finish_reason"] is None]
    assert all(c["__verbose"]["content"] == c["choices"][0]["text"] and c["__verbose"]["stop"] is False
               for c in texts)
    assert chunks[-2]["__verbose"]["stop"] is True and chunks[-1] == "[DONE]"


# -- prompt objects and batches ---------------------------------------------------------------------

def test_prompt_object(http):
    """README /completion `prompt`: `{"prompt_string": "string", "multimodal_data": ["base64"]}`;
    server-common.cpp refuses multimodal data when the model has no multimodal support."""
    plain = complete(http)
    assert complete(http, prompt={"prompt_string": PROMPT})["tokens"] == plain["tokens"]
    assert complete(http, prompt={"prompt_string": PROMPT, "multimodal_data": []})["tokens"] == plain["tokens"]
    r = http.post("/completion", json={"prompt": {"prompt_string": PROMPT, "multimodal_data": ["aGk="]}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("vision_disabled", "prompt.multimodal_data")
    assert complete(http)["tokens"] == plain["tokens"]


def test_batch_of_prompts(http, live_server, tokenizer):
    """README: "Multiple prompts are also supported. In this case, the completion result will be an
    array" (strings, token lists and objects mixed); server-context.cpp handle_completions_impl
    merges the choices on /v1/completions and streams the results interleaved, each with its index."""
    ids = tokenizer.encode("The sky is")
    prompts = [PROMPT, ids, {"prompt_string": "Hello"}]
    singles = [complete(http, prompt=p)["tokens"] for p in prompts]
    body = http.post("/completion", json={"prompt": prompts, "n_predict": 6, "return_tokens": True, **GREEDY}).json()
    assert isinstance(body, list) and [b["index"] for b in body] == [0, 1, 2]
    assert [b["tokens"] for b in body] == singles
    events = events_of(http.post("/completion", json={"prompt": prompts, "n_predict": 6, "stream": True,
                                                      **GREEDY}).text)
    finals = {e["index"]: e for e in events if e["stop"]}
    assert sorted(finals) == [0, 1, 2] and all(finals[i]["tokens_predicted"] == 6 for i in finals)
    text = {i: "".join(e["content"] for e in events if e["index"] == i) for i in range(3)}
    assert text == {i: b["content"] for i, b in enumerate(body)}
    with openai.OpenAI(base_url=live_server.api_base, api_key="x", max_retries=0, timeout=120) as client:
        resp = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert [c.index for c in resp.choices] == [0, 1]
        assert [c.text for c in resp.choices] == [body[0]["content"], body[2]["content"]]
        assert resp.usage.completion_tokens == 12
        stream = list(client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=6,
                                                temperature=0, stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        joined = {i: "".join(c.choices[0].text for c in stream if c.choices and c.choices[0].index == i)
                  for i in (0, 1)}
        assert joined == {0: body[0]["content"], 1: body[2]["content"]}
        assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 12
    # a bad prompt of the batch names its place; nothing ran
    r = http.post("/completion", json={"prompt": [PROMPT, [1, 10**9]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1][1]"
    assert complete(http)["tokens"] == singles[0]
