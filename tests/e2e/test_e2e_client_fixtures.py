"""End-to-end: the request sequences real agent clients sent, replayed against the real server.

tests/e2e/fixtures/clients/<client>.json were captured by scripts/capture_clients.sh: Claude Code
and Codex, installed from npm, each run for two turns of one conversation against `ninfer serve`
(default model ninfer-tiny, started as docs/clients.md says) behind a logging proxy. Each request
is sent again as the client sent it (body, query and its own headers), in order, to a fresh server
started with the same options. Every request must be answered 200 in its protocol's shape, and
every generation request after a conversation's first must reuse at least 95% of its prompt from
the context cache: an agent's next request never re-prefills the conversation. The outputs differ
from the captured ones (ninfer-tiny samples); the prompts, which carry the captured outputs, do not.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.timeout(3600)
FIXTURES = Path(__file__).parent / "fixtures" / "clients"
CLIENTS = sorted(p.stem for p in FIXTURES.glob("*.json"))
MIN_REUSE = 0.95
# The client's own headers are replayed; transport ones are the replaying client's business.
SKIP_HEADERS = {"host", "content-length", "accept-encoding", "connection"}


def sse(text: str) -> list[tuple[str | None, dict]]:
    """[(event name, data)] of an SSE body (comments and [DONE] left out)."""
    out, name = [], None
    for line in text.splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: ") and line != "data: [DONE]":
            out.append((name, json.loads(line[6:])))
            name = None
    return out


def anthropic_usage(events: list[tuple[str | None, dict]]) -> tuple[int, int]:
    """(prompt tokens, reused tokens) of a Messages stream, after checking its block lifecycle."""
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    assert "message_delta" in names
    for n, data in events:
        assert data["type"] == n, (n, data)
    open_blocks = set()
    for n, data in events:
        if n == "content_block_start":
            open_blocks.add(data["index"])
        elif n == "content_block_stop":
            open_blocks.remove(data["index"])
    assert not open_blocks
    delta = [d for n, d in events if n == "message_delta"][-1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "tool_use", "max_tokens", "stop_sequence",
                                             "model_context_window_exceeded")
    u = delta["usage"]
    return u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]


def responses_usage(events: list[tuple[str | None, dict]]) -> tuple[int, int]:
    """(prompt tokens, reused tokens) of a Responses stream, after checking its event lifecycle."""
    names = [n for n, _ in events]
    assert names[0] == "response.created" and names[-1] in ("response.completed", "response.incomplete"), names
    seqs = [d["sequence_number"] for _, d in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    for n, data in events:
        assert data["type"] == n
    u = events[-1][1]["response"]["usage"]
    return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]


def replay_one(client: httpx.Client, req: dict) -> tuple[int, int] | None:
    headers = {k: v for k, v in req.get("headers", {}).items() if k.lower() not in SKIP_HEADERS}
    content = json.dumps(req["body"]).encode() if req.get("body") is not None else None
    r = client.request(req["method"], req["path"], params=req.get("query") or None, headers=headers,
                       content=content)
    assert r.status_code == 200, (req["method"], req["path"], r.status_code, r.text[:500])
    if req["method"] != "POST":
        return None
    body = req["body"]
    if req["path"] == "/v1/messages":
        if body.get("stream"):
            return anthropic_usage(sse(r.text))
        msg = r.json()
        assert msg["type"] == "message" and msg["role"] == "assistant"
        u = msg["usage"]
        return u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]
    if req["path"] == "/v1/responses":
        if body.get("stream"):
            return responses_usage(sse(r.text))
        resp = r.json()
        assert resp["object"] == "response"
        return resp["usage"]["input_tokens"], resp["usage"]["input_tokens_details"]["cached_tokens"]
    return None


@pytest.fixture(scope="module")
def webui_dir(tmp_path_factory):
    # The default server serves a WebUI once one is built; Claude Code probes HEAD / with it.
    d = tmp_path_factory.mktemp("webui")
    (d / "index.html").write_text("<!doctype html><title>llama-ui</title>")
    return d


@pytest.mark.parametrize("name", CLIENTS)
def test_replay_client_fixture(name, launch, tmp_path, webui_dir):
    pytest.importorskip("ninfer_tiny", reason="the fixtures were captured on ninfer-tiny (plugins/tiny)")
    doc = json.loads((FIXTURES / f"{name}.json").read_text())
    assert doc["server"].startswith("ninfer serve")
    flags = doc["server"].split()[2:]
    server = launch(None, *flags, "--webui-dir", str(webui_dir), log_dir=tmp_path, timeout=600)
    try:
        reuse: list[tuple[int, int, int]] = []  # (turn, prompt, reused)
        with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(1800.0)) as client:
            for turn, t in enumerate(doc["turns"], 1):
                for req in t["requests"]:
                    got = replay_one(client, req)
                    if got is not None:
                        reuse.append((turn, *got))
        assert len({t for t, _, _ in reuse}) == len(doc["turns"]) >= 2, reuse
        first, later = reuse[0], reuse[1:]
        assert first[2] == 0  # a fresh server: the first prompt is prefilled from root
        for turn, prompt, reused in later:
            assert reused / prompt >= MIN_REUSE, (name, turn, prompt, reused, server.log()[-3000:])
    finally:
        server.stop()
