"""The checkpoint catalog inside the Engine, on the toy runner.

The toy runner's logits are a function of the whole prefix read back out of the KV pages and
checked against the state slot, so a wrong state copy, a missed copy-on-write of a tail page or a
page freed too early raises or changes the output. Every scenario compares greedy output served
from a checkpoint with the same prompt served from root by a root-only engine, reports the reuse
path, and ends with the pool accounting audited and, after the catalog is cleared, back to idle.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.checkpoints import CheckpointHints
from ninfer_core.engine.engine import Engine
from ninfer_core.testing import ToyRunner, ToyTokenizer, collect, run_async

TOK = ToyTokenizer()
GREEDY = SamplingParams(temperature=0.0)
_engines: list[Engine] = []


@pytest.fixture(autouse=True)
def _shutdown():
    yield
    while _engines:
        eng = _engines.pop()
        eng.runner.resume()
        eng.shutdown(timeout=30)


def engine(reuse: bool = True, **opts) -> Engine:
    eng = Engine(ToyRunner(), TOK, EngineOptions(**{"max_context": 2048, "prefill_chunk": 64,
                                                     "prefix_reuse": reuse, **opts}))
    _engines.append(eng)
    eng.start()
    return eng


def run(eng: Engine, prompt, max_tokens=8, hints=None):
    async def go():
        h = eng.submit(GenerationRequest(prompt_ids=list(prompt), sampling=GREEDY, max_tokens=max_tokens,
                                         checkpoint_hints=hints or CheckpointHints()))
        return await collect(h)

    out = run_async(go())
    assert out.finish is not None, out.events
    return out


def root_output(prompt, max_tokens=8) -> list[int]:
    eng = engine(reuse=False)
    try:
        return run(eng, prompt, max_tokens).token_ids
    finally:
        _engines.remove(eng)
        eng.shutdown(timeout=30)


def audit(eng: Engine) -> None:
    """Accounting matches the holders now, and returns exactly to idle once the catalog is cleared."""
    with eng._cv:
        assert not eng.scheduler.lanes and not eng.scheduler.waiting
        eng.cache.audit([])
    eng.run_control(eng.cache.clear).result(30)
    snap = eng.snapshot()
    assert snap["pages_free"] == snap["pages_total"], snap
    assert snap["slots_free"] == snap["slots_total"]
    cc = snap["context_cache"]
    assert cc["device_state_slots_used"] == 0 and cc["host_state_slots_used"] == 0, cc
    assert cc["checkpoints"] == 0 and cc["private_continuations"] == 0 and cc["shared_prefixes"] == 0


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 256) for _ in range(n)]


def source_of(eng: Engine, before: dict) -> str:
    now = eng.snapshot()["context_cache"]["selections"]
    changed = [k for k in now if now[k] != before.get(k, 0)]
    assert len(changed) == 1, (before, now)
    return changed[0]


def selections(eng):
    return dict(eng.snapshot()["context_cache"]["selections"])


def test_endpoint_reuse_equals_root_and_reports_cached_tokens():
    rng = random.Random(1)
    eng = engine()
    p1 = toks(rng, 150)
    o1 = run(eng, p1)
    p2 = p1 + o1.token_ids + toks(rng, 40)
    sel = selections(eng)
    o2 = run(eng, p2)
    assert source_of(eng, sel) == "private_endpoint"
    frontier = len(p1) + len(o1.token_ids) - 1  # the last sampled token is not in the KV yet
    assert o2.finish.usage.cached_tokens == frontier
    assert o2.finish.timings["cache_n"] == frontier
    assert o2.finish.timings["prompt_n"] == len(p2) - frontier
    assert o2.token_ids == root_output(p2)
    ctx = o2.finish.context
    assert ctx["source"] == "private_endpoint" and ctx["cache_n"] == frontier
    assert eng.cache.continuations[ctx["id_slot"]].digest == ctx["session_digest"]
    counters = eng.snapshot()["context_cache"]
    assert counters["reused_prompt_tokens"] == frontier
    assert counters["computed_prefill_tokens"] == len(p1) + len(p2) - frontier
    audit(eng)


def test_turn_closure_serves_a_regenerated_reply():
    rng = random.Random(2)
    eng = engine()
    p1 = toks(rng, 130)
    hints = CheckpointHints(turn_closure=127)  # before a 3-token "assistant opener"
    o1 = run(eng, p1, hints=hints)
    sel = selections(eng)
    o2 = run(eng, p1, hints=hints)  # the same prompt again: regenerate
    assert source_of(eng, sel) == "private_turn_closure"
    assert o2.finish.usage.cached_tokens == 127
    assert o2.token_ids == o1.token_ids == root_output(p1)
    # An edited last message after the closure point resumes there too.
    p3 = p1[:127] + toks(rng, 20)
    sel = selections(eng)
    o3 = run(eng, p3)
    assert source_of(eng, sel) == "private_turn_closure"
    assert o3.token_ids == root_output(p3)
    audit(eng)


def test_marker_long_anchor_and_endpoint_anchor():
    rng = random.Random(3)
    eng = engine()
    p1 = toks(rng, 200)
    o1 = run(eng, p1, hints=CheckpointHints(markers=[70]))
    # A rewrite of history after the marker resumes from the marker's long anchor.
    p_rw = p1[:70] + toks(rng, 30)
    sel = selections(eng)
    o_rw = run(eng, p_rw)
    assert source_of(eng, sel) == "private_long_anchor"
    assert o_rw.finish.usage.cached_tokens == 70
    assert o_rw.token_ids == root_output(p_rw)
    # Extend the original conversation at its endpoint, then branch right at that old endpoint:
    # the endpoint was kept as an endpoint anchor of the extended conversation.
    end1 = p1 + o1.token_ids[:-1]
    p2 = p1 + o1.token_ids + toks(rng, 30)
    sel = selections(eng)
    run(eng, p2)
    assert source_of(eng, sel) == "private_endpoint"
    p_branch = end1 + toks(rng, 25)
    sel = selections(eng)
    o_b = run(eng, p_branch)
    assert source_of(eng, sel) == "private_long_anchor"
    assert o_b.finish.usage.cached_tokens == len(end1)
    assert o_b.token_ids == root_output(p_branch)
    audit(eng)


def test_no_endpoint_anchors_flag_drops_them():
    rng = random.Random(4)
    eng = engine(endpoint_anchors=False)
    p1 = toks(rng, 100)
    o1 = run(eng, p1)
    run(eng, p1 + o1.token_ids + toks(rng, 10))
    sel = selections(eng)
    run(eng, p1 + o1.token_ids[:-1] + toks(rng, 10))
    assert source_of(eng, sel) == "root"
    audit(eng)


def test_shared_stable_prefix_published_on_second_sighting():
    rng = random.Random(5)
    eng = engine()
    system = toks(rng, 90)
    hints = CheckpointHints(stable_prefix=90)
    prompts = [system + toks(rng, 30) for _ in range(3)]
    sel = selections(eng)
    run(eng, prompts[0], hints=hints)  # first sighting: remembered only
    run(eng, prompts[1], hints=hints)  # second sighting: captured during prefill and published
    assert eng.snapshot()["context_cache"]["shared_prefixes"] == 1
    after_two = selections(eng)
    assert after_two["root"] - sel["root"] == 2
    o3 = run(eng, prompts[2], hints=hints)
    assert source_of(eng, after_two) == "shared_stable_prefix"
    assert o3.finish.usage.cached_tokens == 90
    assert o3.token_ids == root_output(prompts[2])
    audit(eng)


def test_max_shared_prefixes_keeps_the_most_recently_used():
    """--max-shared-prefixes 1: a second published prefix replaces the first (least recently used);
    the kept one serves from the shared checkpoint, the replaced one no longer does (its own
    retained conversation may still serve it privately)."""
    rng = random.Random(15)
    eng = engine(max_shared_prefixes=1)
    systems = [toks(rng, 90), toks(rng, 90)]
    hints = CheckpointHints(stable_prefix=90)
    for system in systems:
        for _ in range(2):  # the second sighting publishes
            run(eng, system + toks(rng, 30), hints=hints)
    cc = eng.snapshot()["context_cache"]
    assert cc["shared_prefixes"] == 1
    assert eng.cache.counters["pressure"]["shared_owner_evicted"] == 1
    kept = [e.ckpt.tokens for e in eng.cache.shared]
    assert kept == [tuple(systems[1])]
    p_old = systems[0] + toks(rng, 30)
    p_new = systems[1] + toks(rng, 30)
    sel = selections(eng)
    o_new = run(eng, p_new, hints=CheckpointHints())
    assert source_of(eng, sel) == "shared_stable_prefix" and o_new.finish.usage.cached_tokens == 90
    sel = selections(eng)
    o_old = run(eng, p_old, hints=CheckpointHints())
    # no longer shared: at most a retained conversation of that system prompt serves it privately
    assert source_of(eng, sel) != "shared_stable_prefix"
    assert o_new.token_ids == root_output(p_new) and o_old.token_ids == root_output(p_old)
    audit(eng)


@pytest.mark.parametrize("limit,expected", [(0, []), (1, [240]), (2, [100, 240])])
def test_max_long_anchors_per_continuation_caps_auto_anchors(limit, expected):
    """The same boundaries as the spacing test below: the cap keeps the anchors nearest the end."""
    rng = random.Random(6)
    eng = engine(auto_long_anchors=True, long_anchor_spacing=32, max_long_anchors_per_continuation=limit)
    p1 = toks(rng, 300)
    run(eng, p1, hints=CheckpointHints(boundaries=[40, 100, 180, 240, 280], turn_closure=297))
    cont = next(c for c in eng.cache.continuations if c is not None)
    assert sorted(e.ckpt.frontier for e in cont.entries if e.kind == "long_anchor") == expected
    audit(eng)


def test_auto_long_anchors_at_message_boundaries_with_spacing():
    rng = random.Random(6)
    eng = engine(auto_long_anchors=True, long_anchor_spacing=32)
    p1 = toks(rng, 300)
    boundaries = [40, 100, 180, 240, 280]
    run(eng, p1, hints=CheckpointHints(boundaries=boundaries, turn_closure=297))
    cont = next(c for c in eng.cache.continuations if c is not None)
    anchors = sorted(e.ckpt.frontier for e in cont.entries if e.kind == "long_anchor")
    # From the end: 280 is < 32 below 297? no: grid starts at the prompt end (300): 280 is 20 below,
    # skipped; 240 is 60 >= 32 below 300; then >= 64 below 240: 100 is 140 below (180 is 60, skipped).
    assert anchors == [100, 240]
    p_edit = p1[:100] + toks(rng, 50)
    sel = selections(eng)
    o = run(eng, p_edit)
    assert source_of(eng, sel) == "private_long_anchor" and o.finish.usage.cached_tokens == 100
    assert o.token_ids == root_output(p_edit)
    audit(eng)


def test_branch_anchor_where_a_prompt_leaves_a_retained_conversation():
    rng = random.Random(7)
    eng = engine(branch_anchors=True, max_context=4096, kv_capacity=8192)
    p1 = toks(rng, 1500)
    run(eng, p1, max_tokens=2)
    # Diverges at 1200, > 1024 above every checkpoint of the conversation (it has only an endpoint).
    b1 = p1[:1200] + toks(rng, 20)
    run(eng, b1, max_tokens=2)
    b2 = p1[:1200] + toks(rng, 20)
    sel = selections(eng)
    o = run(eng, b2, max_tokens=4)
    assert source_of(eng, sel) == "private_long_anchor" and o.finish.usage.cached_tokens == 1200
    assert o.token_ids == root_output(b2, 4)
    audit(eng)


def test_host_tier_demotion_and_restore_under_device_slot_pressure():
    rng = random.Random(8)
    eng = engine(device_state_slots=1, host_state_slots=4, max_private_continuations=4)
    convs = [toks(rng, 70 + 10 * i) for i in range(3)]
    outs = [run(eng, p) for p in convs]
    cc = eng.snapshot()["context_cache"]
    assert cc["device_state_slots_used"] == 1 and cc["host_state_slots_used"] == 2, cc
    assert cc["transfer_bytes"]["state_d2h"] > 0
    for p, o in zip(convs, outs):  # the demoted ones restore from Host copies
        p2 = p + o.token_ids + toks(rng, 5)
        sel = selections(eng)
        o2 = run(eng, p2)
        assert source_of(eng, sel) == "private_endpoint"
        assert o2.token_ids == root_output(p2)
    assert eng.snapshot()["context_cache"]["transfer_bytes"]["state_h2d"] > 0
    audit(eng)


def test_page_pressure_evicts_inactive_owners_and_requests_still_run():
    rng = random.Random(9)
    # 12 pages of 64 tokens: each request needs 3-4; retained conversations must give way (no Host KV).
    eng = engine(kv_capacity=12 * 64, max_context=12 * 64, max_private_continuations=8, host_kv_mib=0)
    for i in range(8):
        p = toks(rng, 150 + i)
        assert run(eng, p, max_tokens=6).token_ids == root_output(p, 6)
    cc = eng.snapshot()["context_cache"]
    assert cc["pressure"]["private_owner_evicted"] > 0
    audit(eng)


def test_continuation_capacity_evicts_the_least_recent_of_equals():
    rng = random.Random(10)
    eng = engine(max_private_continuations=2)
    ps = [toks(rng, 80) for _ in range(3)]
    outs = [run(eng, p) for p in ps]
    assert eng.snapshot()["context_cache"]["private_continuations"] == 2
    sel = selections(eng)
    run(eng, ps[0] + outs[0].token_ids + [1, 2, 3])  # the oldest was evicted
    assert source_of(eng, sel) == "root"
    audit(eng)


def test_two_lanes_resume_the_same_checkpoint_at_once_copy_on_write():
    rng = random.Random(11)
    eng = engine(max_concurrency=2, concurrent_prefill=True)
    p1 = toks(rng, 100)  # frontier 100 + 7: the tail page is partly filled
    o1 = run(eng, p1)
    a = p1 + o1.token_ids + toks(rng, 20)
    b = p1 + o1.token_ids + toks(rng, 25)

    async def both():
        ha = eng.submit(GenerationRequest(prompt_ids=a, sampling=GREEDY, max_tokens=12))
        hb = eng.submit(GenerationRequest(prompt_ids=b, sampling=GREEDY, max_tokens=12))
        return await asyncio.gather(collect(ha), collect(hb))

    ra, rb = run_async(both())
    assert ra.finish.usage.cached_tokens > 0 and rb.finish.usage.cached_tokens > 0
    assert ra.token_ids == root_output(a, 12) and rb.token_ids == root_output(b, 12)
    audit(eng)


def test_cancel_mid_prefill_releases_every_hold():
    rng = random.Random(12)
    eng = engine(prefill_chunk=32)
    p1 = toks(rng, 100)
    o1 = run(eng, p1, hints=CheckpointHints(markers=[50]))
    p2 = p1 + o1.token_ids + toks(rng, 200)
    eng.runner.pause()

    async def go():
        h = eng.submit(GenerationRequest(prompt_ids=p2, sampling=GREEDY, max_tokens=4,
                                         checkpoint_hints=CheckpointHints(markers=[150, 250])))
        await asyncio.to_thread(eng.runner.entered.wait, 30)
        h.cancel()
        eng.runner.resume()
        return await collect(h)

    out = run_async(go())
    assert out.finish.finish_reason == "cancelled"
    audit(eng)


def test_no_prefix_reuse_is_root_only():
    eng = engine(reuse=False)
    p = list(range(50, 150))
    run(eng, p)
    run(eng, p)
    snap = eng.snapshot()
    assert snap["context_cache"] is None and snap["pages_free"] == snap["pages_total"]


def test_host_kv_tier_demotes_pages_under_pressure_and_resumes_exactly():
    rng = random.Random(13)
    # 12 pages: a 3rd conversation does not fit beside two retained ones, so the least recently
    # used one's KV pages move to Host memory (one copy for all of its checkpoints).
    eng = engine(kv_capacity=12 * 64, max_context=12 * 64, max_private_continuations=8)
    convs = [toks(rng, 260) for _ in range(3)]
    outs = [run(eng, p, max_tokens=6, hints=CheckpointHints(turn_closure=250)) for p in convs]
    cc = eng.snapshot()["context_cache"]
    assert cc["pressure"]["private_owner_degraded"] >= 1 and cc["host_kv_bytes_used"] > 0
    assert cc["transfer_bytes"]["main_kv_d2h"] == cc["host_kv_bytes_used"]
    with eng._cv:
        eng.cache.audit([])
    demoted = [c for c in eng.cache.continuations if c is not None and c.entries[0].ckpt.host_kv is not None]
    assert demoted
    first = convs[0]
    nxt = first + outs[0].token_ids + toks(rng, 10)
    sel = selections(eng)
    o = run(eng, nxt, max_tokens=6)
    assert source_of(eng, sel) == "private_endpoint"
    assert o.token_ids == root_output(nxt, 6)
    assert eng.snapshot()["context_cache"]["transfer_bytes"]["main_kv_h2d"] > 0
    # A regenerate of the demoted conversation's first turn resumes from its Host turn closure.
    sel = selections(eng)
    again = run(eng, convs[1], max_tokens=6)
    assert source_of(eng, sel) in ("private_turn_closure", "root")
    assert again.token_ids == outs[1].token_ids
    audit(eng)
    assert eng.snapshot()["context_cache"]["host_kv_bytes_used"] == 0


def test_continuation_limit_evicts_the_cheapest_to_rebuild_not_the_least_recent():
    rng = random.Random(14)
    eng = engine(max_private_continuations=2)
    long_conv = toks(rng, 600)
    short_conv = toks(rng, 70)
    out_long = run(eng, long_conv)
    run(eng, short_conv)  # used more recently, but 8x cheaper to rebuild
    run(eng, toks(rng, 90))  # needs a cell: LRU would evict the long conversation
    sel = selections(eng)
    nxt = long_conv + out_long.token_ids + toks(rng, 5)
    o = run(eng, nxt)
    assert source_of(eng, sel) == "private_endpoint"
    assert o.token_ids == root_output(nxt)
    sel = selections(eng)
    run(eng, short_conv + [1, 2])
    assert source_of(eng, sel) == "root"
    audit(eng)


def test_page_pressure_drops_an_endpoint_and_keeps_the_turn_closure():
    rng = random.Random(15)
    # 12 pages, no Host KV. A keeps a turn closure at 130 (3 pages) and an endpoint at 305 (5 pages).
    # B needs 8 pages with 7 free: dropping A's endpoint frees 2 pages at a rebuild cost of 175
    # tokens; LRU evicted all of A.
    eng = engine(kv_capacity=12 * 64, max_context=12 * 64, max_private_continuations=4, host_kv_mib=0)
    a = toks(rng, 300)
    out_a = run(eng, a, max_tokens=6, hints=CheckpointHints(turn_closure=130))
    assert out_a.finish.usage.completion_tokens == 6
    b = toks(rng, 455)
    assert run(eng, b, max_tokens=6).token_ids == root_output(b, 6)
    cc = eng.snapshot()["context_cache"]
    assert cc["pressure"]["checkpoint_dropped"] == 1 and cc["pressure"]["private_owner_evicted"] == 0
    assert cc["pressure"]["private_owner_degraded"] >= 1
    cont = next(c for c in eng.cache.continuations if c is not None and c.session[:300] == tuple(a))
    assert [e.kind for e in cont.entries] == ["turn_closure"]
    # An edit of A's last message still resumes at its closure, exactly.
    edit = a[:130] + toks(rng, 40)
    sel = selections(eng)
    o = run(eng, edit, max_tokens=6)
    assert source_of(eng, sel) == "private_turn_closure" and o.finish.usage.cached_tokens == 130
    assert o.token_ids == root_output(edit, 6)
    audit(eng)


def test_host_kv_is_accounted_in_pages_shared_by_the_checkpoints_that_share_them():
    rng = random.Random(16)
    eng = engine(kv_capacity=12 * 64, max_context=12 * 64, max_private_continuations=8)
    convs = [toks(rng, 260) for _ in range(3)]
    for p in convs:
        run(eng, p, max_tokens=6, hints=CheckpointHints(turn_closure=250))
    cc = eng.snapshot()["context_cache"]
    assert cc["host_kv_pages_used"] > 0
    assert cc["host_kv_bytes_used"] == cc["host_kv_pages_used"] * eng.cache.page_bytes
    assert cc["pressure"]["private_owner_demoted"] >= 1
    for c in eng.cache.continuations:
        if c is None or not any(e.ckpt.host_pages for e in c.entries):
            continue
        # Closure (4 pages) and endpoint (5 pages) share their first four Host pages: 5 in all.
        held = {p for e in c.entries for p in e.ckpt.host_pages}
        assert len(held) == 5
    with eng._cv:
        eng.cache.audit([])
    audit(eng)
    assert eng.snapshot()["context_cache"]["host_kv_pages_used"] == 0


def _cancel_after(eng, prompt, cached_at_least, max_tokens=4, hints=None):
    """Submit, let the prefill reach `cached_at_least` tokens, cancel, and collect."""
    def hold(kind, views, tokens):
        if kind == "prefill" and views[0].num_cached >= cached_at_least:
            eng.runner.pause()
        return False

    eng.runner.fail_if = hold

    async def go():
        h = eng.submit(GenerationRequest(prompt_ids=list(prompt), sampling=GREEDY, max_tokens=max_tokens,
                                         checkpoint_hints=hints or CheckpointHints()))
        await asyncio.to_thread(eng.runner.entered.wait, 30)
        h.cancel()
        eng.runner.fail_if = None
        eng.runner.resume()
        return await collect(h)

    return run_async(go())


def test_a_cancelled_prefill_is_salvaged_and_the_retry_resumes_there():
    rng = random.Random(17)
    eng = engine(prefill_chunk=32)
    p = toks(rng, 300)
    out = _cancel_after(eng, p, 96)
    assert out.finish.finish_reason == "cancelled"
    cc = eng.snapshot()["context_cache"]
    assert cc["salvage"]["cancelled_prefills"] == 1 and cc["salvage"]["cancelled_prefills_salvaged"] == 1
    (cont,) = [c for c in eng.cache.continuations if c is not None]
    reached = len(cont.session)
    assert 96 < reached < 300 and cont.session == tuple(p[:reached])
    assert out.finish.context["id_slot"] == cont.slot
    with eng._cv:
        eng.cache.audit([])
    sel = selections(eng)
    retry = run(eng, p, max_tokens=6)
    assert source_of(eng, sel) == "private_endpoint" and retry.finish.usage.cached_tokens == reached
    assert retry.token_ids == root_output(p, 6)
    audit(eng)


def test_a_prefill_cancelled_before_computing_anything_new_publishes_nothing():
    rng = random.Random(18)
    eng = engine(prefill_chunk=32)
    p = toks(rng, 200)
    out = _cancel_after(eng, p, 0)
    assert out.finish.finish_reason == "cancelled"
    # The held forward was the first chunk: it finishes, so 32 tokens are kept; a request cancelled
    # while waiting (never admitted) keeps nothing.
    cc = eng.snapshot()["context_cache"]
    assert cc["salvage"]["cancelled_prefills"] == 1
    assert cc["private_continuations"] == cc["salvage"]["cancelled_prefills_salvaged"]
    audit(eng)


def test_a_capture_worth_less_than_the_room_it_needs_is_skipped():
    rng = random.Random(19)
    # One StateImage in all (no Device checkpoint slot, one Host slot): a long conversation holds it.
    eng = engine(device_state_slots=0, host_state_slots=1, max_private_continuations=4)
    a = toks(rng, 900)
    out_a = run(eng, a)
    # A short request's marker anchor (50 tokens) and endpoint (~65) would cost A's 905-token state:
    # skipped, where LRU evicted A.
    run(eng, toks(rng, 60), hints=CheckpointHints(markers=[50]))
    cc = eng.snapshot()["context_cache"]
    assert cc["captures_skipped"] == 2 and cc["pressure"]["private_owner_evicted"] == 0
    sel = selections(eng)
    nxt = a + out_a.token_ids + toks(rng, 4)
    o = run(eng, nxt)
    assert source_of(eng, sel) == "private_endpoint" and o.token_ids == root_output(nxt)
    audit(eng)


def test_a_full_host_tier_drops_its_stale_resident_to_take_a_demotion():
    rng = random.Random(20)
    # 12 Device pages, Host KV of 5 pages (one conversation). A is demoted to Host first; once A has
    # gone unused for an hour, the next demotion drops A from Host instead of evicting a fresh one.
    page_bytes = 64 * ToyRunner().cache_spec().kv_bytes_per_token
    eng = engine(kv_capacity=12 * 64, max_context=12 * 64, max_private_continuations=8,
                 host_kv_mib=5 * page_bytes / 2**20)
    convs = [toks(rng, 260) for _ in range(4)]
    outs = [run(eng, p, max_tokens=6, hints=CheckpointHints(turn_closure=250)) for p in convs[:3]]
    cc = eng.snapshot()["context_cache"]
    assert cc["host_kv_pages"] == 5 and cc["host_kv_pages_used"] == 5
    with eng._cv:
        (a,) = [c for c in eng.cache.continuations if c is not None and c.entries[0].ckpt.host_pages]
        assert a.session[:260] == tuple(convs[0])
        for e in a.entries:
            e.ckpt.last_used -= 3600
    run(eng, convs[3], max_tokens=6, hints=CheckpointHints(turn_closure=250))
    cc = eng.snapshot()["context_cache"]
    assert cc["pressure"]["private_owner_evicted"] == 1 and cc["host_kv_pages_used"] == 5
    assert a not in eng.cache.continuations
    host = [c for c in eng.cache.continuations if c is not None and c.entries[0].ckpt.host_pages]
    assert len(host) == 1 and host[0].session[:260] in (tuple(convs[1]), tuple(convs[2]))
    # The conversation now on Host resumes exactly.
    i = 1 if host[0].session[:260] == tuple(convs[1]) else 2
    nxt = convs[i] + outs[i].token_ids + toks(rng, 5)
    sel = selections(eng)
    o = run(eng, nxt, max_tokens=6)
    assert source_of(eng, sel) == "private_endpoint" and o.token_ids == root_output(nxt, 6)
    audit(eng)


def _demote_kv(eng: Engine, ckpt) -> None:
    """Move one checkpoint's KV pages to Host, as a pressure plan would."""
    from ninfer_core.engine.cache_planner import Plan

    with eng._cv:
        _, _, entries, ckpts = eng.cache._pressure_view(None, eng.cache._clock())
        eng.cache._apply(Plan(demote=[ckpt.id]), entries, ckpts)


@pytest.mark.parametrize("host_pages,expect", [(5, "private_turn_closure"), (10, "private_endpoint")])
def test_admission_degrades_to_a_shallower_checkpoint_when_the_room_costs_more(host_pages, expect):
    rng = random.Random(22)
    # 12 Device pages. A's endpoint (265 tokens) has its KV on Host, its turn closure (192, 3 pages)
    # is on Device; X (305 tokens, 5 pages) is retained; 4 pages are free. A's next turn (366 prompt
    # tokens, 6 pages) from the endpoint needs 2 more pages: with a full Host tier that costs A's
    # closure (192) or X (305), more than prefilling the 73 tokens between closure and endpoint, so
    # it resumes from the closure. With Host room, demoting the closure is cheap: the endpoint wins.
    page_bytes = 64 * ToyRunner().cache_spec().kv_bytes_per_token
    eng = engine(kv_capacity=12 * 64, max_context=12 * 64, max_private_continuations=8,
                 host_kv_mib=host_pages * page_bytes / 2**20)
    a = toks(rng, 260)
    out_a = run(eng, a, max_tokens=6, hints=CheckpointHints(turn_closure=192))
    with eng._cv:
        (cont,) = [c for c in eng.cache.continuations if c is not None]
        end = cont.endpoint().ckpt
    _demote_kv(eng, end)
    assert end.host_pages and end.frontier == 265
    x = toks(rng, 300)
    run(eng, x, max_tokens=6)
    assert eng.snapshot()["pages_free"] == 4
    nxt = a + out_a.token_ids + toks(rng, 100)
    sel = selections(eng)
    o = run(eng, nxt, max_tokens=6)
    assert source_of(eng, sel) == expect
    mat = o.finish.context["materialization"]
    assert mat["best_reuse_prompt_tokens"] == 265 and mat["targets_evaluated"] == 3
    if expect == "private_turn_closure":
        assert o.finish.usage.cached_tokens == 192 and mat["degradation_tokens"] == 73
        assert eng.snapshot()["context_cache"]["degraded_admissions"] == 1
        with eng._cv:  # X and A's closure stayed
            assert any(c is not None and c.session[:300] == tuple(x) for c in eng.cache.continuations)
    else:
        assert o.finish.usage.cached_tokens == 265 and mat["degradation_tokens"] == 0
    assert o.token_ids == root_output(nxt, 6)
    cc = eng.snapshot()["context_cache"]
    # A plan is counted when one is applied: the degraded admission made no room at all.
    assert cc["searches"]["started"] == (0 if expect == "private_turn_closure" else 1)
    assert cc["searches"]["budget_exhausted"] == 0
    audit(eng)


def test_a_search_past_its_budget_takes_the_maximal_fallback(monkeypatch):
    import ninfer_core.engine.cache_planner as planner_mod

    rng = random.Random(23)
    eng = engine(kv_capacity=12 * 64, max_context=12 * 64, max_private_continuations=8, host_kv_mib=0)
    for _ in range(3):
        run(eng, toks(rng, 150), max_tokens=6)  # three 3-page conversations, 3 pages free
    monkeypatch.setattr(planner_mod, "SEARCH_WORK", 1)
    p = toks(rng, 300)
    assert run(eng, p, max_tokens=6).token_ids == root_output(p, 6)
    cc = eng.snapshot()["context_cache"]
    assert cc["searches"]["budget_exhausted"] >= 1 and cc["searches"]["maximal_fallback"] >= 1
    assert cc["pressure"]["private_owner_evicted"] == 3  # everything evictable went
    audit(eng)


def test_pressure_events_and_searches_reach_metrics():
    from test_cache_metrics import samples

    from ninfer_core.engine.cache_metrics import context_cache_metrics

    rng = random.Random(24)
    # As in the Host KV test: the third conversation demotes an earlier one's pages to Host.
    eng = engine(kv_capacity=12 * 64, max_context=12 * 64, max_private_continuations=8)
    for _ in range(3):
        run(eng, toks(rng, 260), max_tokens=6, hints=CheckpointHints(turn_closure=250))
    snap = eng.snapshot()
    cc = snap["context_cache"]
    lines = {k: str(int(v)) for k, v in samples(context_cache_metrics(snap)).items()}
    demoted = cc["pressure"]["private_owner_demoted"]
    assert demoted >= 1 and demoted <= cc["pressure"]["private_owner_degraded"]
    assert lines['ninfer:context_pressure_events_total{event="private_owner_demoted"}'] == str(demoted)
    assert lines['ninfer:context_pressure_events_total{event="private_owner_degraded"}'] == \
        str(cc["pressure"]["private_owner_degraded"])
    assert int(lines['ninfer:context_pressure_searches_total{result="started"}']) == cc["searches"]["started"] >= 1
    assert lines['ninfer:context_pressure_searches_total{result="budget_exhausted"}'] == "0"
    assert lines['ninfer:context_pressure_searches_total{result="maximal_fallback"}'] == "0"
    audit(eng)


def test_device_state_slots_demote_the_cheapest_image_not_the_least_recent():
    from ninfer_core.engine.cache_planner import HOST_RESUME_COST

    rng = random.Random(25)
    eng = engine(device_state_slots=3, host_state_slots=8, max_private_continuations=4)
    with eng._cv:  # a model whose StateImage copy back is worth 64 tokens of prefill
        eng.cache.state_bytes = int(64 * eng.cache.kv_bytes_per_token / HOST_RESUME_COST)
    b = toks(rng, 100)
    run(eng, b, max_tokens=6)  # B: endpoint 105 (one Device slot)
    a = toks(rng, 600)
    out_a = run(eng, a, max_tokens=6, hints=CheckpointHints(turn_closure=590))  # closure 590, endpoint 605
    with eng._cv:
        cells = [c for c in eng.cache.continuations if c is not None]
        cont_b = next(c for c in cells if c.session[:100] == tuple(b))
        cont_a = next(c for c in cells if c.session[:600] == tuple(a))
        for e in cont_b.entries:  # B went unused for a half life: LRU would demote it
            e.ckpt.last_used -= 600
        cont_b.last_used -= 600
        assert eng.cache.device_slots_used == 3
    # C's endpoint needs a Device slot. B: 0.5 x min(64, 105) = 32; A's endpoint: 1 x 15 tokens above
    # its closure = 15; A's closure: 1 x 64. A's endpoint goes to Host.
    run(eng, toks(rng, 80), max_tokens=6)
    with eng._cv:
        end_a = cont_a.endpoint().ckpt
        assert end_a.device_slot is None and end_a.image is not None
        assert all(e.ckpt.device_slot is not None for e in cont_b.entries)
    cc = eng.snapshot()["context_cache"]
    assert cc["pressure"]["private_owner_demoted"] == 1
    nxt = a + out_a.token_ids + toks(rng, 5)
    sel = selections(eng)
    o = run(eng, nxt, max_tokens=6)
    assert source_of(eng, sel) == "private_endpoint" and o.token_ids == root_output(nxt, 6)
    audit(eng)
