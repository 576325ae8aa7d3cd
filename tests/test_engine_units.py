"""Engine pieces without the worker: page pool, slots, scheduler, budgets, detok, sampler."""

from __future__ import annotations

import pytest
import torch

from ninfer_core.engine.api import EngineError, GenerationRequest, SamplingParams
from ninfer_core.engine.budget import BudgetPolicy
from ninfer_core.engine.detok import OutputText, StopMatcher
from ninfer_core.engine.pages import PagePool, pages_for
from ninfer_core.engine.request import Sequence, SeqStatus
from ninfer_core.engine.sampler import SamplerState, sample, seed_to_u64
from ninfer_core.engine.scheduler import Scheduler
from ninfer_core.engine.slots import SlotPool
from ninfer_core.testing import ToyTokenizer

# -- pages and slots ----------------------------------------------------------------------------


def test_pages_for_rounds_up():
    assert [pages_for(n) for n in (0, 1, 63, 64, 65, 128, 129)] == [0, 1, 1, 1, 2, 2, 3]
    assert pages_for(10, page_size=4) == 3


def test_page_pool_allocate_free_and_reuse():
    pool = PagePool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    assert not pool.can_allocate(2)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert pool.num_free == 1  # a failed allocation takes nothing
    pool.free(a[:2])
    b = pool.allocate(3)
    assert set(b) == set(a[:2]) | (set(range(4)) - set(a))
    assert pool.num_free == 0


def test_page_pool_refuses_double_and_foreign_free():
    pool = PagePool(3)
    a = pool.allocate(2)
    pool.free(a)
    with pytest.raises(RuntimeError):
        pool.free(a)
    b = pool.allocate(1)
    with pytest.raises(RuntimeError):
        pool.free(b + b)
    assert pool.num_free == 2


def test_slot_pool():
    slots = SlotPool(2)
    assert (slots.allocate(), slots.allocate()) == (0, 1)
    with pytest.raises(RuntimeError):
        slots.allocate()
    slots.free(0)
    with pytest.raises(RuntimeError):
        slots.free(0)
    assert slots.allocate() == 0 and slots.num_free == 0


# -- scheduler ----------------------------------------------------------------------------------

_order = iter(range(10**9))


def make_seq(prompt_len: int, pages: int, deadline: float | None = None) -> Sequence:
    req = GenerationRequest(prompt_ids=[1] * prompt_len, deadline=deadline)
    return Sequence(req, "r", 1, False, pages, SamplerState.create(SamplingParams(greedy=True)),
                    OutputText(ToyTokenizer()), order=next(_order))


def test_scheduler_admits_fifo_within_lanes_and_entitlement():
    sched = Scheduler(2, PagePool(10), SlotPool(2))
    a, b, c = make_seq(10, 6), make_seq(10, 5), make_seq(10, 1)
    for s in (a, b, c):
        sched.add(s)
    assert sched.admit(concurrent_prefill=True) == [a]  # b's 5 pages do not fit the 4 left; c may not overtake b
    assert list(sched.waiting) == [b, c]
    assert a.status is SeqStatus.PREFILL and len(a.pages) == 6 and a.slot == 0
    sched.release(a)
    assert a.status is SeqStatus.FINISHED and sched.pages.num_free == 10
    assert sched.admit(concurrent_prefill=True) == [b, c]
    assert sched.admit(concurrent_prefill=True) == []  # lanes full
    assert {b.slot, c.slot} == {0, 1} and not set(b.pages) & set(c.pages)


def test_scheduler_lane_limit_and_release_of_waiting():
    sched = Scheduler(1, PagePool(10), SlotPool(1))
    a, b = make_seq(5, 1), make_seq(5, 1)
    sched.add(a)
    sched.add(b)
    assert sched.admit(concurrent_prefill=True) == [a]
    sched.release(b)  # a waiting request holds nothing
    assert not sched.waiting and b.status is SeqStatus.FINISHED
    sched.release(a)
    assert sched.pages.num_free == 10 and sched.slots.num_free == 1 and not sched.lanes


def test_scheduler_rejects_an_entitlement_larger_than_the_pool():
    sched = Scheduler(1, PagePool(2), SlotPool(1))
    with pytest.raises(ValueError):
        sched.add(make_seq(5, 3))


def test_scheduler_expired():
    sched = Scheduler(1, PagePool(4), SlotPool(1))
    a, b, c = make_seq(1, 1, deadline=5.0), make_seq(1, 1, deadline=None), make_seq(1, 1, deadline=20.0)
    for s in (a, b, c):
        sched.add(s)
    assert sched.expired(10.0) == [a]
    assert sched.expired(30.0) == [a, c]


def test_decode_batch_is_compacted_in_admission_order():
    sched = Scheduler(4, PagePool(8), SlotPool(4))
    seqs = [make_seq(3, 1) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    sched.admit(concurrent_prefill=True)
    seqs[0].status = seqs[2].status = seqs[3].status = SeqStatus.DECODE
    assert sched.decode_batch() == [seqs[0], seqs[2], seqs[3]]
    sched.release(seqs[2])
    assert sched.decode_batch() == [seqs[0], seqs[3]]
    assert sched.staged() == [seqs[1]]


def test_pick_prefill_shortest_remaining_first():
    sched = Scheduler(3, PagePool(9), SlotPool(3))
    long, short, mid = make_seq(500, 3), make_seq(20, 3), make_seq(100, 3)
    for s in (long, short, mid):
        sched.add(s)
    sched.admit(concurrent_prefill=True)
    assert sched.pick_prefill() is short
    short.num_cached = 20
    short.status = SeqStatus.DECODE
    mid.num_cached = 40
    assert sched.pick_prefill() is mid
    assert long.passed_over == 2 and mid.passed_over == 0


def test_pick_prefill_runs_a_lane_passed_over_eight_times():
    sched = Scheduler(2, PagePool(4), SlotPool(2))
    long, short = make_seq(1000, 2), make_seq(900, 2)
    sched.add(long)
    sched.add(short)
    sched.admit(concurrent_prefill=True)
    picks = [sched.pick_prefill() for _ in range(18)]
    # the long prompt waits eight units, runs one, and waits eight again
    assert picks[:8] == [short] * 8 and picks[8] is long
    assert picks[9:17] == [short] * 8 and picks[17] is long


def test_pick_prefill_none_without_staged_lanes():
    sched = Scheduler(1, PagePool(1), SlotPool(1))
    assert sched.pick_prefill() is None


# -- budgets ------------------------------------------------------------------------------------


def test_default_output_limit_one_lane_is_the_remaining_context():
    pol = BudgetPolicy(max_context=1024, lanes=1, pool_pages=16, page_size=64)
    assert pol.default_output_limit(100) == 924
    assert pol.default_output_limit(1000) == 24


def test_default_output_limit_four_lanes_share_a_small_pool():
    # 16 pages over 4 lanes: 4 pages = 256 tokens per lane
    pol = BudgetPolicy(max_context=1024, lanes=4, pool_pages=16, page_size=64)
    assert pol.default_output_limit(100) == 156
    assert pol.default_output_limit(255) == 1
    # a prompt that alone overruns one lane's share keeps the whole remaining context
    assert pol.default_output_limit(256) == 768
    assert pol.default_output_limit(600) == 424
    # every lane stays admissible at once: four limitless requests fit the pool together
    assert 4 * pages_for(100 + pol.default_output_limit(100)) <= 16


def test_default_output_limit_big_pool_gives_the_remaining_context():
    pol = BudgetPolicy(max_context=1024, lanes=4, pool_pages=64, page_size=64)
    assert pol.default_output_limit(100) == 924


def test_default_output_limit_stays_inside_the_pool():
    pol = BudgetPolicy(max_context=4096, lanes=1, pool_pages=4, page_size=64)
    assert pol.default_output_limit(100) == 156


def test_default_max_tokens_replaces_the_derived_default():
    pol = BudgetPolicy(max_context=1024, lanes=4, pool_pages=16, page_size=64, default_max_tokens=500)
    assert pol.default_output_limit(100) == 500
    assert pol.default_output_limit(900) == 124  # still bounded by the remaining context


def test_resolve_explicit_limit_bounded_by_the_remaining_context():
    pol = BudgetPolicy(max_context=1024, lanes=2, pool_pages=16, page_size=64)
    b = pol.resolve(100, 50)
    assert (b.max_tokens, b.at_context, b.entitlement_pages) == (50, False, 3)
    b = pol.resolve(100, 5000)
    assert (b.max_tokens, b.at_context, b.entitlement_pages) == (924, True, 16)
    b = pol.resolve(100, 0)
    assert (b.max_tokens, b.entitlement_pages) == (0, 2)
    b = pol.resolve(100, None)
    assert (b.max_tokens, b.at_context, b.entitlement_pages) == (412, False, 8)


def test_resolve_rejections():
    pol = BudgetPolicy(max_context=1024, lanes=1, pool_pages=4, page_size=64)
    with pytest.raises(EngineError) as e:
        pol.resolve(0, None)
    assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_prompt", "messages")
    with pytest.raises(EngineError) as e:
        pol.resolve(1024, 1)
    assert (e.value.status, e.value.code, e.value.param) == (400, "context_length_exceeded", "messages")
    assert "1024" in e.value.message and "--max-context" in e.value.message
    with pytest.raises(EngineError) as e:
        pol.resolve(300, 0)  # the prompt alone overruns the 256-token pool
    assert e.value.code == "context_length_exceeded" and "--kv-capacity" in e.value.message
    assert e.value.param == "messages"
    with pytest.raises(EngineError) as e:
        pol.resolve(100, 200)
    assert e.value.code == "context_length_exceeded" and "--kv-capacity" in e.value.message
    assert e.value.param == "max_tokens"
    assert pol.resolve(100, 156).entitlement_pages == 4


# -- detokenisation and stop strings ------------------------------------------------------------


def test_stop_matcher_holds_back_possible_prefixes():
    m = StopMatcher(["</end>"])
    assert m.feed("abc<") == "abc"
    assert m.feed("/e") == ""
    assert m.feed("x") == "</ex"
    assert m.feed("</en") == ""
    assert m.feed("d>tail") == ""
    assert m.matched == "</end>"
    assert m.flush() == "" and m.feed("more") == ""


def test_stop_matcher_flushes_an_unfinished_prefix():
    m = StopMatcher(["STOP!"])
    assert m.feed("go ST") == "go "
    assert m.feed("OP") == ""
    assert m.flush() == "STOP"


def test_stop_matcher_picks_the_earliest_of_several():
    m = StopMatcher(["world", "lo w", ""])
    assert m.feed("hel") == "he"  # "l" may start "lo w"
    assert m.feed("lo world") == "l"  # "he" + "l" = "hel", cut before "lo w"
    assert m.matched == "lo w"


def test_stop_matcher_without_stops_passes_text():
    m = StopMatcher([])
    assert m.feed("abc") == "abc" and m.flush() == ""


def test_output_text_utf8_split_and_specials():
    tok = ToyTokenizer()
    out = OutputText(tok)
    assert out.feed(ToyTokenizer.EURO_HEAD) == ""
    assert out.feed(tok.TOOL) == ""  # a special token between the halves adds no text
    assert out.feed(0xAC) == "€"
    assert out.feed(0xC3) == ""
    assert out.feed(0xA9) == "é"
    assert out.feed(0xC3) == ""
    assert out.finish() == "\ufffd"  # an incomplete tail at the end is replaced, not dropped


def test_output_text_stop_across_tokens():
    tok = ToyTokenizer()
    out = OutputText(tok, ["o wo"])
    texts = [out.feed(t) for t in tok.encode("hello world")]
    assert "".join(texts) == "hell" and out.stopped and out.matched_stop == "o wo"


# -- sampler ------------------------------------------------------------------------------------


def test_greedy_is_exact_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    states = [SamplerState.create(SamplingParams(temperature=0.0)),
              SamplerState.create(SamplingParams(temperature=1.0, greedy=True)),
              SamplerState.create(SamplingParams(temperature=1.0), force_greedy=True)]
    assert sample(logits, states) == logits.argmax(-1).tolist()


def test_seeded_draws_repeat_and_ignore_the_batch():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))

    def state(seed):
        return SamplerState.create(SamplingParams(temperature=1.5, seed=seed))

    alone = [sample(logits[1], [state(7)])[0] for _ in range(1)]
    a, b = state(7), state(7)
    seq_a = [sample(logits[1:2], [a])[0] for _ in range(30)]
    seq_b = []
    others = [state(s) for s in (1, 2, 3)]
    for _ in range(30):
        picks = sample(logits, [others[0], b, others[1], others[2]])
        seq_b.append(picks[1])
    assert seq_a == seq_b and seq_a[0] == alone[0]
    assert len(set(seq_a)) > 3  # it really samples


def test_negative_seeds_map_deterministically():
    assert seed_to_u64(-1) == 2**64 - 1 and seed_to_u64(5) == 5
    logits = torch.randn(100, generator=torch.Generator().manual_seed(2))
    s1 = SamplerState.create(SamplingParams(temperature=2.0, seed=-12345))
    s2 = SamplerState.create(SamplingParams(temperature=2.0, seed=-12345))
    s3 = SamplerState.create(SamplingParams(temperature=2.0, seed=12345))
    a = [sample(logits, [s1])[0] for _ in range(20)]
    assert a == [sample(logits, [s2])[0] for _ in range(20)]
    assert a != [sample(logits, [s3])[0] for _ in range(20)]


def test_seed_defaults():
    assert SamplerState.create(SamplingParams(seed=None), default_seed=99).seed == 99
    assert SamplerState.create(SamplingParams(seed=3), default_seed=99).seed == 3
    fresh = {SamplerState.create(SamplingParams()).seed for _ in range(5)}
    assert len(fresh) == 5 and all(-(2**63) <= s < 2**63 for s in fresh)


def _draws(logits, n=400, **params):
    s = SamplerState.create(SamplingParams(seed=11, **params))
    return [sample(logits, [s])[0] for _ in range(n)]


def test_top_k_limits_the_candidates():
    logits = torch.zeros(100)
    logits[:30] = torch.linspace(3.0, 2.0, 30)
    assert set(_draws(logits, top_k=3, temperature=5.0)) == {0, 1, 2}
    assert set(_draws(logits, top_k=1)) == {0}
    wide = set(_draws(logits, top_k=0, temperature=10.0, n=2000))
    assert wide <= set(range(20)) and len(wide) > 15  # 0 and >20 mean the 20-candidate domain
    assert set(_draws(logits, top_k=50, temperature=10.0, n=2000)) <= set(range(20))


def test_top_p_and_min_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05] + [1e-9] * 20))
    assert set(_draws(logits, top_p=0.7)) == {0, 1}
    assert set(_draws(logits, top_p=0.81)) == {0, 1, 2}
    assert set(_draws(logits, min_p=0.5)) == {0, 1}  # 0.15 < 0.5 * 0.5
    assert set(_draws(logits, min_p=0.2)) == {0, 1, 2}


def test_presence_and_frequency_penalties():
    logits = torch.tensor([5.0, 4.9, 0.0, -1.0])
    s = SamplerState.create(SamplingParams(temperature=0.01, presence_penalty=1.0, seed=0))
    assert sample(logits, [s]) == [0]
    s.observe(0)
    assert sample(logits, [s]) == [1]  # 5.0 - 1.0 < 4.9
    f = SamplerState.create(SamplingParams(temperature=0.01, frequency_penalty=0.06, seed=0))
    f.observe(0)
    assert sample(logits, [f]) == [0]  # 5.0 - 0.06 > 4.9
    f.observe(0)
    assert sample(logits, [f]) == [1]  # 5.0 - 0.12 < 4.9
    plain = SamplerState.create(SamplingParams(temperature=0.01, seed=0))
    plain.observe(0)
    assert sample(logits, [plain]) == [0] and not plain.counts
