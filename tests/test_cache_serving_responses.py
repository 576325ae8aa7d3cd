"""Responses replay checkpoints on a real server (tiny Qwen3.5, httpx): a request that replays a
stored Response (previous_response_id) resumes from the session's replay checkpoint, reported as
private_response_replay in the log, the timings-free usage and /metrics, and its greedy output equals
the same request served from root.
"""

from __future__ import annotations

import httpx
import pytest
from test_cache_serving_metrics import parse

pytestmark = pytest.mark.timeout(600)


def create(base: str, **body) -> dict:
    body = {"model": "tiny-qwen35-dense", "max_output_tokens": 8, "temperature": 0, **body}
    body.pop("model")
    r = httpx.post(base + "/v1/responses", json={"model": _model(base), **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _model(base: str) -> str:
    return httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]


def selections(base: str) -> dict[str, float]:
    samples = parse(httpx.get(base + "/metrics", timeout=30).text)[0]
    prefix = 'ninfer:context_selections_total{source="'
    return {k[len(prefix):-2]: v for k, v in samples.items() if k.startswith(prefix)}


def text_of(resp: dict) -> list:
    """The output Items without their generated ids (reasoning and message text, calls)."""
    out = []
    for item in resp["output"]:
        if item["type"] == "reasoning":
            out.append(("reasoning", [c["text"] for c in item.get("content") or []]))
        elif item["type"] == "message":
            out.append(("message", [c.get("text") for c in item["content"]]))
        else:
            out.append((item["type"], item.get("arguments")))
    return out


def cached(resp: dict) -> int:
    return resp["usage"]["input_tokens_details"]["cached_tokens"]


def test_sibling_replays_the_stored_response_from_its_replay_checkpoint(start_server):
    cache = start_server("--max-private-continuations", "4")
    root = start_server("--no-prefix-reuse")
    instructions = "Answer in one short sentence."
    first = {"instructions": instructions, "input": "What does a context cache keep between turns?"}

    a = create(cache.base_url, **first)
    create(cache.base_url, previous_response_id=a["id"], instructions=instructions, input="Name one cost of it.")
    before = selections(cache.base_url)
    # A sibling of that child: the same stored history, other new input. The child captured the
    # replay checkpoint at the end of a's replayed output; the sibling resumes there.
    b2 = create(cache.base_url, previous_response_id=a["id"], instructions=instructions,
                input="Name one benefit of it.")
    after = selections(cache.base_url)
    assert after["private_response_replay"] == before["private_response_replay"] + 1
    assert sum(after.values()) == sum(before.values()) + 1
    assert 0 < cached(b2) < b2["usage"]["input_tokens"]
    assert f"source=private_response_replay cache={cached(b2)}" in cache.log()
    # A store:false probe of the same chain reads the session's replay checkpoint too.
    b3 = create(cache.base_url, previous_response_id=a["id"], instructions=instructions,
                input="Name one benefit of it.", store=False)
    assert cached(b3) >= cached(b2)

    # Exactness: the same requests served from root give the same greedy output.
    ra = create(root.base_url, **first)
    assert text_of(ra) == text_of(a)
    rb2 = create(root.base_url, previous_response_id=ra["id"], instructions=instructions,
                 input="Name one benefit of it.")
    assert cached(rb2) == 0 and rb2["usage"]["input_tokens"] == b2["usage"]["input_tokens"]
    assert text_of(rb2) == text_of(b2)


def test_replay_checkpoints_stay_in_their_session(start_server):
    cache = start_server("--max-private-continuations", "4")
    first = {"input": "Count to three."}
    a = create(cache.base_url, **first)
    create(cache.base_url, previous_response_id=a["id"], input="Again, slower.")
    # Another stored root with the same input starts another session: its child cannot use the first
    # session's replay checkpoint (it may reuse anything else that matches).
    a2 = create(cache.base_url, **first)
    before = selections(cache.base_url)
    create(cache.base_url, previous_response_id=a2["id"], input="Now backwards.")
    after = selections(cache.base_url)
    assert after["private_response_replay"] == before["private_response_replay"]
