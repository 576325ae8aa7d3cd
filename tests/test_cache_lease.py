"""Admission page leases (ninfer_core.engine.cache_lease) on the toy runner.

The toy runner reads every logit back out of the KV pages, so a page re-homed or collected wrongly
changes the output or raises. Each scenario compares greedy output with the same prompt served
cold by a root-only engine and audits the pool accounting afterwards.
"""

from __future__ import annotations

import random

import pytest

from ninfer_core.engine import cache_lease
from ninfer_core.engine.api import GenerationRequest
from ninfer_core.engine.checkpoints import CheckpointHints
from ninfer_core.testing import collect, run_async

from test_cache_engine import GREEDY, audit, engine, root_output, run, toks  # noqa: F401 - fixtures too
from test_cache_engine import _shutdown  # noqa: F401 - the engines' autouse teardown


def _conversation(rng, eng, first_len=200, closure=190, extra=60):
    """Turn 1 retained with a turn closure; returns turn 2's prompt (closure prefix + new turn)."""
    first = toks(rng, first_len)
    run(eng, first, max_tokens=20, hints=CheckpointHints(turn_closure=closure))
    return first[:closure] + toks(rng, extra)


def test_a_request_without_max_tokens_resumes_the_conversation_it_continues():
    # A pool of exactly --max-context: a request that omits max_tokens is entitled to all of it.
    rng = random.Random(1)
    eng = engine(max_context=512)
    second = _conversation(rng, eng)
    out = run(eng, second, max_tokens=None)
    assert out.finish.context["source"] == "private_turn_closure"
    assert out.finish.usage.cached_tokens == 190
    # It ran to the end of the context, into the pages the old conversation held: they were
    # collected from its lease, and the output is the one a cold run gives.
    assert out.finish.stop_reason in ("context", "eos")
    assert out.token_ids == root_output(second, max_tokens=512 - len(second))
    assert eng.leases.counters["lease_pages_collected"] > 0 or out.finish.stop_reason == "eos"
    mat = out.finish.context["materialization"]
    assert mat["lease_pages"] > 0 and mat["degradation_tokens"] == 0
    audit(eng)


def test_reserve_continuation_pages_restores_the_old_admission():
    rng = random.Random(1)
    eng = engine(max_context=512, reserve_continuation_pages=True)
    second = _conversation(rng, eng)
    out = run(eng, second, max_tokens=None)
    assert out.finish.usage.cached_tokens < 190  # the old conversation had to make room
    assert out.finish.context["materialization"]["degradation_tokens"] > 0
    audit(eng)


def test_an_unused_lease_leaves_the_old_conversation_in_place():
    rng = random.Random(2)
    eng = engine(max_context=512)
    second = _conversation(rng, eng)
    out = run(eng, second, max_tokens=4)  # the explicit small limit needs no lease
    assert out.finish.usage.cached_tokens == 190
    eng2_prompt = second + out.token_ids[:-1] + toks(rng, 10)
    big = run(eng, eng2_prompt, max_tokens=100_000)  # more than the context leaves: clamped, leased
    assert big.finish.usage.cached_tokens >= len(second)
    assert big.token_ids == root_output(eng2_prompt, max_tokens=512 - len(eng2_prompt))
    audit(eng)


def test_lease_pins_keep_other_admissions_off_the_leased_pages():
    rng = random.Random(3)
    eng = engine(max_context=512)
    second = _conversation(rng, eng)

    async def go():
        h = eng.submit(GenerationRequest(prompt_ids=second, sampling=GREEDY, max_tokens=None,
                                         checkpoint_hints=CheckpointHints()))
        return await collect(h)

    out = run_async(go())
    with eng._cv:
        for c in eng.cache.continuations:
            for e in c.entries if c is not None else []:
                assert e.ckpt.pins == 0  # the lease was returned with the request
    assert out.token_ids == root_output(second, max_tokens=512 - len(second))
    audit(eng)


@pytest.fixture
def small_window(monkeypatch):
    monkeypatch.setattr(cache_lease, "LEASE_WINDOW_TOKENS", 128)


def test_kv_lease_growth_admits_with_a_window_and_grows_exactly(small_window):
    rng = random.Random(4)
    prompt = toks(rng, 100)
    eng = engine(max_context=1024, kv_lease_growth=True)
    out = run(eng, prompt, max_tokens=700)
    assert len(out.token_ids) == 700 or out.finish.stop_reason == "eos"
    assert eng.leases.counters["lease_growth_pages"] > 0
    assert out.token_ids == root_output(prompt, max_tokens=700)
    audit(eng)


def test_kv_lease_growth_releases_idle_owners_then_ends_with_length(small_window):
    rng = random.Random(5)
    # 8 pages (512 tokens); a retained conversation holds some of them.
    eng = engine(max_context=2048, kv_capacity=512, kv_lease_growth=True)
    run(eng, toks(rng, 150), max_tokens=10)
    assert eng.snapshot()["context_cache"]["private_continuations"] == 1
    prompt = toks(rng, 60)

    async def go():
        h = eng.submit(GenerationRequest(prompt_ids=prompt, sampling=GREEDY, max_tokens=1500,
                                         ignore_eos=True, checkpoint_hints=CheckpointHints()))
        return await collect(h)

    out = run_async(go())
    # The idle conversation went first; then the pool ran out before max_tokens.
    assert eng.leases.counters["lease_growth_released_owners"] >= 1
    assert out.finish.finish_reason == "length" and out.finish.stop_reason == "max_tokens"
    assert len(prompt) + len(out.token_ids) <= 512 + 1 and len(out.token_ids) < 1500
    assert eng.leases.counters["lease_growth_short"] == 1
    audit(eng)
