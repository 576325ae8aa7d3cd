"""The reuse path reported everywhere on a real server (tiny Qwen3.5), through the real clients:
Chat Completions (aggregate and streamed usage + timings), Anthropic Messages (cache_read_input_tokens,
message_start and terminal usage), Responses streaming (input_tokens_details.cached_tokens), the
request log line and ninfer:reused_prompt_tokens_total all agree on the reused prefix.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from test_cache_serving_metrics import parse

pytestmark = pytest.mark.timeout(600)


def reused_total(base: str) -> float:
    return parse(httpx.get(base + "/metrics", timeout=30).text)[0]["ninfer:reused_prompt_tokens_total"]


@pytest.fixture(scope="module")
def server(tiny_artifact, tmp_path_factory, launch):
    s = launch(tiny_artifact, "--max-private-continuations", "4",
                      log_dir=tmp_path_factory.mktemp("usage-logs"))
    yield s
    s.stop()


def test_chat_stream_reports_the_reused_prefix(server):
    base = server.base_url
    turn1 = [{"role": "user", "content": "Describe a prefix cache in one line."}]
    with openai.OpenAI(base_url=server.api_base, api_key="x", max_retries=0, timeout=300) as c:
        one = c.chat.completions.create(model="", messages=turn1, max_tokens=6, temperature=0)
        turn2 = turn1 + [{"role": "assistant", "content": one.choices[0].message.content or ""},
                         {"role": "user", "content": "Shorter."}]
        before = reused_total(base)
        chunks = list(c.chat.completions.create(model="", messages=turn2, max_tokens=6, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
    last = chunks[-1]
    cached = last.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    timings = last.model_extra["timings"]
    assert timings["cache_n"] == cached and timings["cache_n"] + timings["prompt_n"] == last.usage.prompt_tokens
    assert reused_total(base) - before == cached
    assert f"source=private_turn_closure cache={cached} prompt={last.usage.prompt_tokens}" in server.log()
    assert f"prompt {last.usage.prompt_tokens} tokens, cache={cached} via private_turn_closure" in server.log()


def test_anthropic_reports_cache_reads(server):
    base = server.base_url
    with anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=300) as c:
        turn1 = [{"role": "user", "content": "Name a cache eviction policy."}]
        one = c.messages.create(model="local", max_tokens=6, messages=turn1, extra_body={"temperature": 0},
                                thinking={"type": "disabled"})
        assert one.usage.cache_read_input_tokens == 0
        reply = "".join(b.text for b in one.content if b.type == "text")
        turn2 = turn1 + [{"role": "assistant", "content": reply or "LRU."},
                         {"role": "user", "content": "Another one?"}]
        before = reused_total(base)
        two = c.messages.create(model="local", max_tokens=6, messages=turn2, extra_body={"temperature": 0},
                                thinking={"type": "disabled"})
        count = c.messages.count_tokens(model="local", messages=turn2, thinking={"type": "disabled"}).input_tokens
        assert two.usage.cache_read_input_tokens > 0
        assert two.usage.input_tokens + two.usage.cache_read_input_tokens == count
        assert reused_total(base) - before == two.usage.cache_read_input_tokens
        # Streamed: message_start already carries the exact split, the terminal usage matches.
        with c.messages.stream(model="local", max_tokens=6, messages=turn2, extra_body={"temperature": 0},
                               thinking={"type": "disabled"}) as stream:
            events = list(stream)
            final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start")
    assert start.message.usage.cache_read_input_tokens >= two.usage.cache_read_input_tokens
    assert final.usage.cache_read_input_tokens == start.message.usage.cache_read_input_tokens


def test_responses_stream_reports_cached_tokens(server):
    with openai.OpenAI(base_url=server.api_base, api_key="x", max_retries=0, timeout=300) as c:
        model = c.models.list().data[0].id
        a = c.responses.create(model=model, input="Say one word.", max_output_tokens=6, temperature=0)
        assert a.usage.input_tokens_details.cached_tokens == 0
        events = list(c.responses.create(model=model, previous_response_id=a.id, input="Another word.",
                                         max_output_tokens=6, temperature=0, stream=True))
    done = next(e for e in events if e.type in ("response.completed", "response.incomplete"))
    assert 0 < done.response.usage.input_tokens_details.cached_tokens < done.response.usage.input_tokens
