"""End-to-end: llama.cpp routes (httpx), OpenAI legacy Completions (the `openai` client), the
tokenizer routes and rerank against the real `ninfer serve` with the tiny random Qwen3.5 artifact.

Random weights write random text, so outputs are compared with themselves (greedy runs, streamed
against aggregate, ids against text) and shapes are asserted exactly.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(300)

# A marker that must never reach the server log (logs carry no prompts or outputs).
SECRET = "zebra-quartz-7781"
PROMPT = f"The password is {SECRET}. Repeat it:"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(live_server):
    with openai.OpenAI(base_url=live_server.api_base, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer():
    from qwen_format import qwen35_tokenizer_section, with_format

    from ninfer_core.tokenizer import Tokenizer

    return with_format(Tokenizer.from_section(qwen35_tokenizer_section()))


def events_of(text: str) -> list:
    return [json.loads(b[len("data: "):]) if b != "data: [DONE]" else "[DONE]"
            for b in text.split("\n\n") if b and not b.startswith(":")]


def wait_idle(http) -> dict:
    deadline = time.monotonic() + 20
    while True:
        load = http.get("/v1/load").json()
        if not any(load["requests"][k] for k in ("running", "admitted", "waiting")):
            return load
        assert time.monotonic() < deadline, f"engine did not return to idle: {load}"
        time.sleep(0.05)


def test_completion_aggregate(http, tokenizer):
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 8, "return_tokens": True, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stop"] is True and body["stop_type"] == "limit" and body["tokens_predicted"] == 8
    assert len(body["tokens"]) == 8 and body["content"] == tokenizer.decode(body["tokens"])
    assert body["tokens_evaluated"] == len(tokenizer.encode(PROMPT)) and body["prompt"] == PROMPT
    assert body["model"] == "tiny-qwen35-dense" and body["truncated"] is False
    assert body["generation_settings"]["n_predict"] == 8 and body["generation_settings"]["temperature"] == 0
    t = body["timings"]
    assert t["prompt_n"] + t["cache_n"] == body["tokens_evaluated"] and t["predicted_n"] == 8
    # greedy: the same request gives the same tokens; ids as the prompt give the same as the text
    again = http.post("/completions", json={"prompt": tokenizer.encode(PROMPT), "n_predict": 8,
                                            "return_tokens": True, **GREEDY}).json()
    assert again["tokens"] == body["tokens"]
    wait_idle(http)


def test_completion_stream_matches_aggregate(http):
    req = {"prompt": PROMPT, "n_predict": 10, "return_tokens": True, **GREEDY}
    agg = http.post("/completion", json=req).json()
    with http.stream("POST", "/completion", json={**req, "stream": True, "timings_per_token": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = events_of(r.read().decode())
    assert "[DONE]" not in events
    *chunks, final = events
    assert "".join(c["content"] for c in chunks) == agg["content"]
    assert all(c["stop"] is False and "timings" in c for c in chunks)
    assert final["stop"] is True and final["content"] == "" and final["tokens"] == agg["tokens"]
    assert final["tokens_predicted"] == 10
    wait_idle(http)


def test_completion_stop_word(http):
    req = {"prompt": PROMPT, "n_predict": 24, **GREEDY}
    full = http.post("/completion", json=req).json()["content"]
    start = len(full) // 2
    stop = full[start:start + 2]
    if not stop.strip() or "\ufffd" in stop:
        pytest.skip("the random model wrote no usable stop string")
    cut = http.post("/completion", json={**req, "stop": [stop]}).json()
    assert cut["stop_type"] == "word" and cut["stopping_word"] == stop
    assert cut["content"] == full[: full.index(stop)]


@pytest.mark.parametrize("body,code,param", [
    ({"prompt": ["a", {"text": "b"}]}, "missing_required_parameter", "prompt[1].prompt_string"),
    ({"prompt": "x", "repeat_penalty": 1.3}, "repeat_penalty_not_supported", "repeat_penalty"),
    ({"prompt": "x", "mirostat": 2}, "mirostat_not_supported", "mirostat"),
    ({"prompt": "x", "grammar": "root ::= \"a\""}, "grammar_not_supported", "grammar"),
    ({"prompt": [1, 10**9]}, "invalid_value", "prompt[1]"),
])
def test_completion_refusals(http, body, code, param):
    r = http.post("/completion", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error")
    assert http.post("/completion", json={"prompt": "x", "n_predict": 2}).status_code == 200


def test_openai_completions(client, tokenizer):
    kw = dict(model="tiny-qwen35-dense", prompt=PROMPT, max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True})
    r = client.completions.with_raw_response.create(**kw)
    assert r.headers["x-request-id"].startswith("req_")
    resp = r.parse()
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.index == 0 and choice.logprobs is None
    assert resp.usage.prompt_tokens == len(tokenizer.encode(PROMPT)) and resp.usage.completion_tokens == 8
    assert resp.model_extra["timings"]["predicted_n"] == 8
    echoed = client.completions.create(echo=True, **kw).choices[0].text
    assert echoed == PROMPT + choice.text
    stream = client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    # log probabilities of the generated tokens (legacy object)
    lp = client.completions.create(logprobs=2, **kw).choices[0]
    assert lp.text == choice.text
    assert "".join(lp.logprobs.tokens) == choice.text or "\ufffd" in "".join(lp.logprobs.tokens)
    assert len(lp.logprobs.tokens) == len(lp.logprobs.token_logprobs) == 8
    assert all(x <= 0 for x in lp.logprobs.token_logprobs)
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v, abs=1e-4)  # greedy picks the top
               for top, v in zip(lp.logprobs.top_logprobs, lp.logprobs.token_logprobs))


def test_openai_completions_refusals(client, http):
    for extra, code, param in ((dict(n=0), "invalid_value", "n"),
                               (dict(suffix="}"), "suffix_not_supported", "suffix"),
                               (dict(logprobs=2, echo=True), "logprobs_not_supported", "echo"),
                               (dict(best_of=2), "best_of_not_supported", "best_of"),
                               (dict(prompt=["a", ""]), "invalid_value", "prompt[1]")):
        kw = {"model": "tiny-qwen35-dense", "prompt": "x", "max_tokens": 2, **extra}
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**kw)
        assert e.value.status_code == 400
        assert (e.value.body["code"], e.value.body["param"]) == (code, param)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-3.5-turbo-instruct", prompt="x", max_tokens=2)
    assert client.completions.create(model="tiny-qwen35-dense", prompt="x", max_tokens=2).choices
    wait_idle(http)


def test_cancelled_completion_stream_returns_engine_to_idle(http):
    def decoded() -> int:
        counters = http.get("/v1/load").json()["counters"]
        return counters.get("committed_decode_tokens", counters.get("generated_tokens_total", 0))

    before = decoded()
    with http.stream("POST", "/completion", json={"prompt": PROMPT, "n_predict": 4000, "stream": True,
                                                  **GREEDY}) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen == 3:
                break
    wait_idle(http)
    assert 2 <= decoded() - before < 4000  # it decoded, and ended with its client, not at its limit
    # the server keeps serving
    assert http.post("/completion", json={"prompt": "x", "n_predict": 2}).json()["tokens_predicted"] <= 2


def test_tokenizer_routes(http, tokenizer):
    text = "<|im_start|>user\nHello 🦙"
    ids = http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert ids == tokenizer.encode(text) and ids[0] == 248045
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and pieces[0]["piece"] == "<|im_start|>"
    assert any(isinstance(p["piece"], list) for p in pieces)  # the emoji's partial byte tokens
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"content": text}
    prompt = http.post("/apply-template", json={"messages": [{"role": "user", "content": "Hi"}],
                                                 "enable_thinking": False}).json()["prompt"]
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    r = http.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[0]"


def test_rerank(http):
    docs = ["The giant panda is a bear species endemic to China.", "Paris is in France.", SECRET]
    r = http.post("/v1/rerank", json={"query": "What is a panda?", "documents": docs, "top_n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    results = body["results"]
    assert len(results) == 2 and body["model"] == "tiny-qwen35-dense"
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True) and all(0.0 <= s <= 1.0 for s in scores)
    assert all(x["document"]["text"] == docs[x["index"]] for x in results)
    assert body["usage"]["prompt_tokens"] > 3 * 40
    # the same judgement through every path and the TEI shape
    for path in ("/rerank", "/v1/reranking", "/reranking"):
        again = http.post(path, json={"query": "What is a panda?", "documents": docs}).json()["results"]
        assert [x["relevance_score"] for x in again][:2] == pytest.approx(scores, abs=1e-6)
    tei = http.post("/rerank", json={"query": "What is a panda?", "texts": docs, "return_text": True}).json()
    assert [x["index"] for x in tei][:2] == [x["index"] for x in results]
    assert tei[0]["text"] == docs[tei[0]["index"]]
    bad = http.post("/v1/rerank", json={"query": "q", "documents": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"
    wait_idle(http)


def test_logs_hold_no_prompt_or_output(live_server, http):
    http.post("/completion", json={"prompt": PROMPT, "n_predict": 2})
    log = live_server.log()
    assert SECRET not in log


def test_regenerated_long_prompt_resumes_one_token_short(http, tokenizer):
    ids = tokenizer.encode(" ".join(f"w{i}" for i in range(400)))
    assert len(ids) >= 512
    req = {"prompt": ids, "n_predict": 4, "return_tokens": True, **GREEDY}
    first = http.post("/completion", json=req).json()
    again = http.post("/completion", json=req).json()
    assert again["tokens"] == first["tokens"]  # the resumed state gives the same greedy output
    assert again["tokens_cached"] == len(ids) - 1 == again["timings"]["cache_n"]
    assert again["timings"]["prompt_n"] == 1
    wait_idle(http)
