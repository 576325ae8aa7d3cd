"""Structured output end to end (issue 17): the 56-schema corpus through the real server with
--structured-output, on the trained ninfer-tiny and on a random-weight Qwen3.5 model (the real
248k-token tokenizer), aggregate and streaming, on every protocol (Chat Completions, Responses,
Anthropic Messages, llama.cpp /completion, /v1/completions), with the real clients. Every completed
output must be valid under its schema (the `jsonschema` package, formats checked).

Each schema runs on one protocol in both modes (schema k on protocol k mod 5), so every protocol
and mode sees about eleven schemas per model and every schema runs on both models;
NINFER_STRUCTURED_FULL=1 runs every schema on every protocol and mode (5x the requests).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("ninfer_qwen35")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from structured_corpus import CORPUS, STRICT  # noqa: E402

pytestmark = pytest.mark.timeout(900)
PROTOCOLS = ("chat", "responses", "messages", "completion", "completions")
FULL = os.environ.get("NINFER_STRUCTURED_FULL") == "1"
FLAGS = ("--structured-output", "--max-concurrency", "8", "--max-context", "2048", "--greedy")
ASK = "Give the answer as JSON."


def _launch(request, tmp_path_factory, artifact, *extra):
    conftest = request.config.pluginmanager.get_plugin(
        str(Path(__file__).resolve().parents[1] / "conftest.py")
    )
    tmp = tmp_path_factory.mktemp("structured")
    return conftest.launch_server(
        artifact, *FLAGS, *extra, log_dir=tmp, env={"NINFER_CACHE_DIR": str(tmp / "cache")}
    )


@pytest.fixture(scope="module")
def tiny_server(request, tmp_path_factory):
    pytest.importorskip("ninfer_tiny")
    s = _launch(request, tmp_path_factory, None)  # the packaged default: ninfer-tiny
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tiny_spec_server(request, tmp_path_factory):
    """ninfer-tiny with its MTP head drafting (issue 17's speculative part): constrained lanes
    verify K drafts a round with one grammar mask per draft position."""
    pytest.importorskip("ninfer_tiny")
    pytest.importorskip("ninfer_spec_mtp")
    s = _launch(request, tmp_path_factory, None, "--spec", "mtp", "--draft-tokens", "3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def random_server(request, tmp_path_factory, tiny_artifact):
    s = _launch(request, tmp_path_factory, tiny_artifact)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def random_spec_server(request, tmp_path_factory, tiny_artifact):
    pytest.importorskip("ninfer_spec_mtp")
    s = _launch(request, tmp_path_factory, tiny_artifact, "--spec", "mtp", "--draft-tokens", "3")
    yield s
    s.stop()


def _model(server) -> str:
    return httpx.get(server.api_base + "/models", timeout=30).json()["data"][0]["id"]


def _chat(server, model, schema, strict, stream, max_tokens):
    c = openai.OpenAI(base_url=server.api_base, api_key="x", max_retries=0, timeout=300)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "strict": strict, "schema": schema}}
    args = dict(
        model=model, messages=[{"role": "user", "content": ASK}], response_format=fmt, max_tokens=max_tokens
    )
    if not stream:
        r = c.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason == "stop"
    text, finish = "", None
    for chunk in c.chat.completions.create(**args, stream=True):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    return text, finish == "stop"


def _responses(server, model, schema, strict, stream, max_tokens):
    c = openai.OpenAI(base_url=server.api_base, api_key="x", max_retries=0, timeout=300)
    text_fmt = {"format": {"type": "json_schema", "name": "answer", "strict": strict, "schema": schema}}
    args = dict(model=model, input=ASK, text=text_fmt, max_output_tokens=max_tokens, store=False)
    if not stream:
        r = c.responses.create(**args)
        assert r.text.format.type == "json_schema"
        return r.output_text, r.status == "completed"
    text, status = "", None
    for ev in c.responses.create(**args, stream=True):
        if ev.type == "response.output_text.delta":
            text += ev.delta
        elif ev.type in ("response.completed", "response.incomplete"):
            status = ev.response.status
    return text, status == "completed"


def _messages(server, model, schema, strict, stream, max_tokens):
    c = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)
    args = dict(
        model=model,
        max_tokens=max_tokens,
        messages=[{"role": "user", "content": ASK}],
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    if not stream:
        m = c.messages.create(**args)
        return "".join(b.text for b in m.content if b.type == "text"), m.stop_reason == "end_turn"
    with c.messages.stream(**args) as s:
        text = "".join(s.text_stream)
        return text, s.get_final_message().stop_reason == "end_turn"


def _completion(server, model, schema, strict, stream, max_tokens):
    body = {"prompt": "JSON: ", "json_schema": schema, "n_predict": max_tokens, "stream": stream}
    if not stream:
        r = httpx.post(server.base_url + "/completion", json=body, timeout=300).json()
        return r["content"], r["stop_type"] == "eos"
    text, last = "", None
    with httpx.stream("POST", server.base_url + "/completion", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                text += ev.get("content", "")
                last = ev
    return text, last is not None and last.get("stop_type") == "eos"


def _completions(server, model, schema, strict, stream, max_tokens):
    c = openai.OpenAI(base_url=server.api_base, api_key="x", max_retries=0, timeout=300)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "strict": strict, "schema": schema}}
    args = dict(model=model, prompt="JSON: ", max_tokens=max_tokens, extra_body={"response_format": fmt})
    if not stream:
        r = c.completions.create(**args)
        return r.choices[0].text, r.choices[0].finish_reason == "stop"
    text, finish = "", None
    for chunk in c.completions.create(**args, stream=True):
        for ch in chunk.choices:
            text += ch.text
            finish = ch.finish_reason or finish
    return text, finish == "stop"


CALLS = {
    "chat": _chat,
    "responses": _responses,
    "messages": _messages,
    "completion": _completion,
    "completions": _completions,
}


def _plan() -> list[tuple[int, str, bool]]:
    runs = []
    for k in range(len(CORPUS)):
        for stream in (False, True):
            protocols = PROTOCOLS if FULL else (PROTOCOLS[k % len(PROTOCOLS)],)
            runs += [(k, p, stream) for p in protocols]
    return runs


_RUNS: dict = {}  # (server, max_tokens) -> (total, done, info, texts): each server's corpus runs once


def _corpus(server, max_tokens: int, texts: dict | None = None) -> tuple[int, int, dict]:
    key = (id(server), max_tokens)
    if key not in _RUNS:
        got: dict = {}
        _RUNS[key] = (*_corpus_once(server, max_tokens, got), got)
    total, done, info, got = _RUNS[key]
    if texts is not None:
        texts.update(got)
    return total, done, info


def _corpus_once(server, max_tokens: int, texts: dict) -> tuple[int, int, dict]:
    model = _model(server)
    # a schema's validity is checked with formats asserted, as the subset promises them
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER

    def one(run):
        k, protocol, stream = run
        schema = CORPUS[k]
        text, completed = CALLS[protocol](server, model, schema, k in STRICT, stream, max_tokens)
        if completed:
            try:
                jsonschema.validate(
                    json.loads(text), schema, cls=jsonschema.Draft202012Validator, format_checker=checker
                )
            except Exception as e:  # noqa: BLE001 - report which run broke
                return run, completed, f"{type(e).__name__}: {str(e)[:300]} in {text[:300]!r}", text
        return run, completed, None, text

    runs = _plan()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, runs))
    texts.update((r, t) for r, _, _, t in results)
    results = [(r, c, why) for r, c, why, _ in results]
    bad = {r: why for r, _, why in results if why}
    done = sum(1 for _, c, _ in results if c)
    per = {}
    for (k, p, s), c, _ in results:
        per.setdefault((p, s), [0, 0])
        per[(p, s)][0] += 1
        per[(p, s)][1] += int(c)
    return len(runs), done, {"invalid": bad, "per_protocol": per}


def test_corpus_on_ninfer_tiny_is_valid_on_every_protocol(tiny_server):
    total, done, info = _corpus(tiny_server, max_tokens=96)
    assert not info["invalid"], info["invalid"]
    print(f"ninfer-tiny: {done}/{total} completed, all valid; per protocol {info['per_protocol']}")
    assert done >= 0.8 * total, info["per_protocol"]
    for (protocol, stream), (n, completed) in info["per_protocol"].items():
        assert completed >= 1, (protocol, stream, n)


def test_corpus_with_mtp_drafts_is_valid_and_greedy_equal_to_plain_decoding(tiny_server, tiny_spec_server):
    plain, spec = {}, {}
    _corpus(tiny_server, max_tokens=96, texts=plain)
    total, done, info = _corpus(tiny_spec_server, max_tokens=96, texts=spec)
    assert not info["invalid"], info["invalid"]
    assert done >= 0.8 * total, info["per_protocol"]
    drafted, accepted = _spec_counters(tiny_spec_server)
    differ = [r for r in plain if plain[r] != spec[r]]
    print(f"ninfer-tiny --spec mtp: {done}/{total} completed, all valid; drafts {accepted}/{drafted} "
          f"accepted; {len(differ)} of {total} outputs differ from plain decoding")
    assert drafted > 0 and accepted > 0
    # greedy verification commits what plain decoding commits (fp32 on the CPU: no near-ties)
    assert not differ, [(r, plain[r][:80], spec[r][:80]) for r in differ[:3]]


def _spec_counters(server) -> tuple[float, float]:
    got = {}
    for line in httpx.get(server.base_url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("ninfer:draft_tokens_total", "ninfer:draft_accepted_tokens_total"):
            got[name] = float(value)
    return got.get("ninfer:draft_tokens_total", 0.0), got.get("ninfer:draft_accepted_tokens_total", 0.0)


def test_corpus_on_a_random_weight_model_is_valid_on_every_protocol(random_server):
    total, done, info = _corpus(random_server, max_tokens=64)
    assert not info["invalid"], info["invalid"]
    print(f"random-weight: {done}/{total} completed, all valid; per protocol {info['per_protocol']}")
    assert done >= 0.25 * total, info["per_protocol"]
    for (protocol, stream), (n, completed) in info["per_protocol"].items():
        assert completed >= 1, (protocol, stream, n)


def test_random_weight_corpus_with_mtp_drafts_is_valid_and_greedy_equal(random_server, random_spec_server):
    plain, spec = {}, {}
    _corpus(random_server, max_tokens=64, texts=plain)
    total, done, info = _corpus(random_spec_server, max_tokens=64, texts=spec)
    assert not info["invalid"], info["invalid"]
    drafted, accepted = _spec_counters(random_spec_server)
    differ = [r for r in plain if plain[r] != spec[r]]
    print(f"random-weight --spec mtp: {done}/{total} completed, all valid; drafts {accepted}/{drafted} "
          f"accepted; {len(differ)} of {total} outputs differ from plain decoding")
    assert done >= 0.25 * total, info["per_protocol"]
    assert drafted > 0
    assert not differ, [(r, plain[r][:80], spec[r][:80]) for r in differ[:3]]
