"""End-to-end: a request that needs the whole KV pool is admitted past idle retained conversations.

The server runs with a pool of exactly one context (--max-context 512: 8 pages of 64 tokens). A
few short conversations are retained by the context cache; then a request whose output limit is
-1 (the derived budget: the whole remaining context, so the whole pool) arrives. Admission must
demote or evict the idle conversations for it. It used to wait until its pending timeout (503
request_queue_timeout) because two retained conversations shared a page that no single step of
the pressure search freed.
"""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.timeout(600)

TOOL = [{"role": "tool"}]


def post(client, body):
    return client.post("/v1/chat/completions", json={"messages": TOOL, **body})


def test_a_whole_pool_request_is_admitted_past_idle_retained_conversations(start_server):
    server = start_server("--max-context", "512", "--default-max-tokens", "8", "--pending-timeout-ms", "60000")
    with httpx.Client(base_url=server.base_url, timeout=300) as c:
        load = c.get("/v1/load").json()
        assert load["capacity"]["kv_capacity_tokens"] == 512  # the pool is exactly one context
        # The sequence the fuzz found: two retained turns, one that generates nothing, then -1.
        for body in ({}, {}, {"max_tokens": 0}):
            assert post(c, body).status_code == 200
        occupancy = c.get("/v1/load").json()["occupancy"]
        assert occupancy["device_main_kv_pages"] >= 2  # retained conversations hold pages
        r = post(c, {"max_tokens": -1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
        stats = c.get("/stats").json()
        pressure = stats["context_cache"]["pressure"]
        assert pressure["private_owner_degraded"] + pressure["private_owner_evicted"] >= 1, pressure
        # The other limit fields take the same path, and the server still serves afterwards.
        for body in ({"max_completion_tokens": -1}, {"max_tokens": 8, "max_completion_tokens": -1}, {"max_tokens": -1}):
            r = post(c, body)
            assert r.status_code == 200, (body, r.text)
        load = c.get("/v1/load").json()
        assert load["requests"]["waiting"] == 0 and load["requests"]["running"] == 0
