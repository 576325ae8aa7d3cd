"""`ninfer serve` on a `ninfer convert`ed random Flash-Next checkpoint, with the real openai client:
chat and streaming, a forced tool call in the Qwen3.5 XML syntax and its result sent back, a second
turn served from the context cache (GDN, PLE and indexer state restored) whose greedy output equals
a server without prefix reuse, and the residency options (experts on host / disk, n-gram rows in
RAM / from a mapping) giving the device-resident output, with their counters in /stats."""

import json

import httpx
import pytest
from flash_next_test_support import plugin_flags

pytest.importorskip("openai")
import openai

MODEL = "flash-next-tiny"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
FLAGS = ("--greedy", "--prefill-chunk", "16")


@pytest.fixture(scope="module")
def server(converted, launch, tmp_path_factory):
    s = launch(converted, *plugin_flags(), *FLAGS, log_dir=tmp_path_factory.mktemp("flash-serve"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_base, api_key="none", max_retries=0)


def _ask(c, text, max_tokens=12):
    return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                     max_tokens=max_tokens)


def test_chat_and_stream_agree(client, server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
    parts = [c.choices[0].delta.content or "" for c in
             client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, stream=True) if c.choices]
    assert "".join(parts) == (r.choices[0].message.content or "")
    stats = httpx.get(server.base_url + "/stats", timeout=30).json()
    assert stats["ngram_table"]["rows"] % 8 == 0 and stats["ngram_table"]["rows"] > 0  # 8 rows a token
    assert "experts" not in stats  # device residency has no expert cache to report


def test_forced_tool_call_round_trip(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=16,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    # random weights rarely close the call: then the parser reports it as malformed, naming the tool
    assert call.function.name == "get_weather" or (
        call.function.name == "malformed_tool_call" and "get_weather" in call.function.arguments)
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": "sunny, 21 C"}]
    r2 = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    assert r2.choices[0].finish_reason in ("length", "stop", "tool_calls")


def _two_turns(c):
    first = [{"role": "user", "content": "Tell me about the quick brown fox and the lazy dog."}]
    r1 = c.chat.completions.create(model=MODEL, messages=first, max_tokens=10)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content or ""},
                      {"role": "user", "content": "And the weather in London?"}]
    return c.chat.completions.create(model=MODEL, messages=second, max_tokens=10)


def test_second_turn_from_cache_equals_root(client, converted, launch, tmp_path):
    cached = _two_turns(client)
    assert cached.usage.prompt_tokens_details.cached_tokens > 0
    root = launch(converted, *plugin_flags(), *FLAGS, "--no-prefix-reuse", log_dir=tmp_path)
    try:
        plain = _two_turns(openai.OpenAI(base_url=root.api_base, api_key="none", max_retries=0))
        assert (plain.usage.prompt_tokens_details.cached_tokens or 0) == 0
        assert plain.choices[0].message.content == cached.choices[0].message.content
    finally:
        root.stop()


@pytest.mark.parametrize("flags", [
    ("--expert-residency", "disk", "--expert-cache-mib", "1", "--ngram-residency", "ram"),
    ("--expert-residency", "host", "--expert-cache-mib", "0", "--ngram-io", "mmap", "--ngram-io-depth", "4"),
], ids=["disk-experts", "host-experts"])
def test_residency_options_keep_the_output(client, converted, launch, tmp_path, flags):
    prompts = ["The quick brown fox", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12"]
    want = [_ask(client, p).choices[0].message.content for p in prompts]
    s = launch(converted, *plugin_flags(), *FLAGS, *flags, log_dir=tmp_path)
    try:
        c = openai.OpenAI(base_url=s.api_base, api_key="none", max_retries=0)
        assert [_ask(c, p).choices[0].message.content for p in prompts] == want
        stats = httpx.get(s.base_url + "/stats", timeout=30).json()
        ex = stats["experts"]
        assert ex["routes"] > 0 and ex["routes"] == ex["hits"] + ex["misses"]
        if "disk" in flags:
            assert ex["slots"] > 0 and ex["admitted"] > 0 and ex["transferred_bytes"] > 0 and ex["cpu_routes"] == 0
        else:
            assert ex["slots"] == 0 and ex["cpu_routes"] == ex["routes"] and ex["hits"] == 0
        ng = stats["ngram_table"]
        assert ng["rows"] > 0 and (ng["resident_rows"] == ng["rows"]) == ("ram" in flags)
    finally:
        s.stop()


def test_bad_option_value_stops_startup(converted, launch, tmp_path):
    with pytest.raises(RuntimeError) as e:
        launch(converted, *plugin_flags(), "--expert-residency", "disk", "--expert-cache-mib", "0", log_dir=tmp_path)
    assert "needs a device expert cache" in str(e.value)


def test_spec_mtp_keeps_greedy_output(mtp_artifact_path, launch, tmp_path):
    """The artifact's MTP block drafts through --spec mtp; verification keeps the greedy output."""
    pytest.importorskip("ninfer_spec_mtp")  # --spec mtp is that package's backend (CI tests this one alone too)
    prompts = ["The quick brown fox", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12"]
    plain = launch(mtp_artifact_path, *plugin_flags(), *FLAGS, log_dir=tmp_path)
    try:
        c = openai.OpenAI(base_url=plain.api_base, api_key="none", max_retries=0)
        want = [_ask(c, p, 16).choices[0].message.content for p in prompts]
    finally:
        plain.stop()
    log = tmp_path / "requests.jsonl"
    spec = launch(mtp_artifact_path, *plugin_flags(), *FLAGS, "--spec", "mtp", "--draft-tokens", "3",
                  "--request-log-jsonl", str(log), log_dir=tmp_path)
    try:
        c = openai.OpenAI(base_url=spec.api_base, api_key="none", max_retries=0)
        assert [_ask(c, p, 16).choices[0].message.content for p in prompts] == want
    finally:
        spec.stop()
    done = [r for r in map(json.loads, log.read_text().splitlines()) if r.get("event") == "request_done"]
    assert len(done) == 2
    for rec in done:  # the drafts came from the MTP block and were verified
        assert rec["speculative"]["backend"] == "mtp" and rec["speculative"]["drafted_tokens"] > 0
    # --draft-min-p 0.999: a random model's drafts are never that sure, so every MTP round verifies
    # through its first draft only; the output stays the greedy one
    log2 = tmp_path / "requests-min-p.jsonl"
    spec = launch(mtp_artifact_path, *plugin_flags(), *FLAGS, "--spec", "mtp", "--draft-tokens", "3",
                  "--draft-min-p", "0.999", "--ngram-draft-tokens", "0", "--request-log-jsonl", str(log2),
                  log_dir=tmp_path)
    try:
        c = openai.OpenAI(base_url=spec.api_base, api_key="none", max_retries=0)
        assert [_ask(c, p, 16).choices[0].message.content for p in prompts] == want
    finally:
        spec.stop()
    for rec in [r for r in map(json.loads, log2.read_text().splitlines()) if r.get("event") == "request_done"]:
        sp = rec["speculative"]
        assert sp["rounds"] > 0 and sp["drafted_tokens"] == sp["rounds"], sp
