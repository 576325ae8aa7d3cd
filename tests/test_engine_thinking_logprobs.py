"""Engine: thinking budgets (early close, C/B/R), post-thinking sampling, token log probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.sampler import LOGPROB_FLOOR, SamplerState, token_logprobs
from ninfer_core.engine.thinking import effective_budget
from ninfer_core.testing import ScriptPolicy, ToyRunner, ToyTokenizer, collect, run_async

TOK = ToyTokenizer()
GREEDY = SamplingParams(temperature=0.0)
CLOSE = ord("#")  # the toy "</think>"
CLOSE_IDS = TOK.encode("ok#\n")  # guidance "ok" + close + format newline
A, B = ord("a"), ord("b")


def run(runner: ToyRunner, *reqs: GenerationRequest, **opts):
    async def go():
        eng = Engine(runner, TOK, EngineOptions(**{"max_context": 512, **opts}))
        eng.start()
        try:
            outs = [await collect(eng.submit(r)) for r in reqs]
            snap = eng.snapshot()
            assert snap["lanes_active"] == 0 and snap["pages_free"] == snap["pages_total"]
            return outs
        finally:
            eng.shutdown(timeout=30)

    return run_async(go())


def thinking_req(prompt, max_tokens, budget=None, sampling=GREEDY, **kw):
    return GenerationRequest(prompt_ids=list(prompt), sampling=sampling, max_tokens=max_tokens,
                             in_reasoning=True, think_end_ids=[CLOSE], thinking_budget=budget,
                             budget_close_ids=list(CLOSE_IDS), **kw)


PROMPT = TOK.encode("think")


def scripted(output, after=TOK.EOS):
    return ToyRunner(policy=ScriptPolicy({tuple(PROMPT): output}, after=after))


# -- C/B/R -------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget,capacity,close_len,want", [
    (5, 100, 3, 5),     # plenty of room
    (5, 5, 3, 5),       # C <= B: thinking hits the output limit first
    (5, 3, 3, 5),
    (5, 9, 3, 5),       # C - B == R
    (5, 8, 3, 4),       # B < C < B + R, C > R: C - R
    (5, 6, 3, 2),       # C - B < R and C > R: C - R
    (3, 4, 3, None),    # C <= R and C > B: not enforced
    (None, 10, 3, None),
])
def test_effective_budget(budget, capacity, close_len, want):
    assert effective_budget(budget, capacity, close_len) == want


# -- early close -------------------------------------------------------------------------------


def test_budget_inserts_guidance_and_close_then_generation_continues():
    runner = scripted([A] * 30)
    (out,) = run(runner, thinking_req(PROMPT, 12, budget=4))
    ids = out.token_ids
    assert ids[:4] == [A] * 4
    assert ids[4:4 + len(CLOSE_IDS)] == CLOSE_IDS
    assert len(ids) == 12 and out.finish.usage.completion_tokens == 12  # inserted tokens count
    assert out.finish.thinking == {"budget_requested": 4, "budget_effective": 4, "early_close": True,
                                   "reasoning_tokens": 4 + CLOSE_IDS.index(CLOSE) + 1, "post_thinking_sampling": False}
    assert "ok#\n" in out.text


def test_natural_close_before_the_budget_inserts_nothing():
    runner = scripted([A, A, CLOSE, B, B])
    (out,) = run(runner, thinking_req(PROMPT, 20, budget=4))
    assert out.token_ids == [A, A, CLOSE, B, B, TOK.EOS]
    assert out.finish.thinking["early_close"] is False


def test_budget_shrinks_near_the_output_limit():
    # B=5, R=len(CLOSE_IDS)+1=5, C=8: C-B=3 < R and C > R -> effective budget 3
    runner = scripted([A] * 30)
    (out,) = run(runner, thinking_req(PROMPT, 8, budget=5))
    assert out.token_ids[:3] == [A] * 3 and out.token_ids[3:7] == CLOSE_IDS and len(out.token_ids) == 8
    assert out.finish.thinking["budget_effective"] == 3 and out.finish.finish_reason == "length"


def test_budget_that_cannot_be_enforced_runs_to_the_limit():
    runner = scripted([A] * 30)
    (out,) = run(runner, thinking_req(PROMPT, 5, budget=3))  # C=5 <= R=5, C > B
    assert out.token_ids == [A] * 5
    assert out.finish.thinking["budget_effective"] is None and out.finish.thinking["early_close"] is False


def test_non_thinking_request_gets_no_cap():
    runner = scripted([A] * 30)
    r = GenerationRequest(prompt_ids=PROMPT, sampling=GREEDY, max_tokens=10, in_reasoning=False,
                          think_end_ids=[CLOSE], thinking_budget=2, budget_close_ids=CLOSE_IDS)
    (out,) = run(runner, r)
    assert out.token_ids == [A] * 10 and out.finish.thinking is None


# -- post-thinking sampling --------------------------------------------------------------------


def test_post_thinking_switches_to_its_sampler_after_the_close():
    prefix = [A, B, CLOSE]
    hot = SamplingParams(temperature=1.5, seed=7)
    greedy_all = run(ToyRunner(policy=ScriptPolicy({tuple(PROMPT): prefix}, after=None)),
                     thinking_req(PROMPT, 20, ignore_eos=True))[0]
    switched = run(ToyRunner(policy=ScriptPolicy({tuple(PROMPT): prefix}, after=None)),
                   thinking_req(PROMPT, 20, sampling=hot, post_thinking=SamplingParams(temperature=0.0),
                                ignore_eos=True))[0]
    assert switched.token_ids[:3] == prefix
    assert switched.token_ids == greedy_all.token_ids  # greedy after the close, like an all-greedy run
    assert switched.finish.thinking["post_thinking_sampling"] is True
    unswitched = run(ToyRunner(policy=ScriptPolicy({tuple(PROMPT): prefix}, after=None)),
                     thinking_req(PROMPT, 20, sampling=hot, ignore_eos=True))[0]
    assert unswitched.token_ids != greedy_all.token_ids


def test_post_thinking_never_switches_when_reasoning_stays_open():
    r = thinking_req(PROMPT, 6, post_thinking=SamplingParams(temperature=0.0))
    (out,) = run(scripted([A] * 10), r)
    assert out.finish.thinking["post_thinking_sampling"] is False


def test_post_thinking_after_an_early_close():
    r = thinking_req(PROMPT, 12, budget=2, post_thinking=SamplingParams(temperature=0.0))
    (out,) = run(scripted([A] * 30), r)
    assert out.finish.thinking["early_close"] and out.finish.thinking["post_thinking_sampling"]


# -- log probabilities -------------------------------------------------------------------------


def records(out):
    return [r for e in out.events if e.kind == "delta" for r in (e.logprobs or [])]


def test_no_records_unless_asked():
    (out,) = run(ToyRunner(), GenerationRequest(prompt_ids=[1, 2], sampling=GREEDY, max_tokens=5,
                                                ignore_eos=True))
    assert all(e.logprobs is None for e in out.events if e.kind == "delta")


def test_greedy_records_are_the_argmax_and_sorted():
    (out,) = run(ToyRunner(), GenerationRequest(prompt_ids=[1, 2], sampling=GREEDY, max_tokens=8,
                                                ignore_eos=True, logprobs=5))
    recs = records(out)
    assert [r.token_id for r in recs] == out.token_ids
    for r in recs:
        assert len(r.top) == 5
        vals = [v for _, v in r.top]
        assert vals == sorted(vals, reverse=True) and vals[0] <= 0.0
        assert r.top[0][0] == r.token_id and r.logprob == pytest.approx(vals[0])
        assert sum(math.exp(v) for v in vals) <= 1.0 + 1e-6


def test_values_follow_temperature_not_the_filters():
    base = dict(prompt_ids=[5, 6, 7], max_tokens=1, logprobs=20)
    (t1,) = run(ToyRunner(), GenerationRequest(sampling=GREEDY, **base))
    (t1_filtered,) = run(ToyRunner(), GenerationRequest(
        sampling=SamplingParams(temperature=1.0, top_k=1, top_p=0.1, min_p=0.9, seed=1), **base))
    (t2,) = run(ToyRunner(), GenerationRequest(sampling=SamplingParams(temperature=2.0, seed=1), **base))
    a, b, c = records(t1)[0], records(t1_filtered)[0], records(t2)[0]
    assert [i for i, _ in a.top] == [i for i, _ in b.top] == [i for i, _ in c.top]
    assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)  # filters change nothing
    # dividing by the temperature halves every log-odds gap
    for (_, va), (_, vc) in zip(a.top[1:], c.top[1:]):
        assert (vc - c.top[0][1]) == pytest.approx((va - a.top[0][1]) / 2, abs=1e-4)


def test_token_outside_the_top_20_reports_the_floor():
    logits = torch.arange(100, dtype=torch.float32)  # token 0 is the least likely
    state = SamplerState.create(SamplingParams(temperature=1.0, seed=1))
    low, high = token_logprobs(torch.stack([logits, logits]), [state, state], [0, 99], [3, 0])
    assert low.logprob == LOGPROB_FLOOR and [i for i, _ in low.top] == [99, 98, 97]
    assert high.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[99])) and high.top == []


def test_stop_string_drops_the_records_of_the_tokens_it_cuts():
    out_ids = TOK.encode("hi STOP more")
    runner = scripted(out_ids)
    (out,) = run(runner, GenerationRequest(prompt_ids=PROMPT, sampling=GREEDY, max_tokens=20, stop=["STOP"],
                                           logprobs=1))
    assert out.text == "hi "
    assert [r.token_id for r in records(out)] == TOK.encode("hi ")
    assert out.finish.usage.completion_tokens == len(TOK.encode("hi STOP"))


def test_inserted_close_tokens_have_no_records():
    (out,) = run(scripted([A] * 30), thinking_req(PROMPT, 10, budget=2, logprobs=1))
    recs = records(out)
    assert len(recs) == 10 - len(CLOSE_IDS)
    assert [r.token_id for r in recs] == [t for i, t in enumerate(out.token_ids) if not 2 <= i < 2 + len(CLOSE_IDS)]


def test_batched_rows_get_their_own_records():
    async def go():
        eng = Engine(ToyRunner(), TOK, EngineOptions(max_context=512, max_concurrency=2))
        eng.start()
        try:
            import asyncio

            a = eng.submit(GenerationRequest(prompt_ids=[1, 2, 3], sampling=GREEDY, max_tokens=6, ignore_eos=True,
                                             logprobs=2))
            b = eng.submit(GenerationRequest(prompt_ids=[4, 5], sampling=GREEDY, max_tokens=6, ignore_eos=True))
            return await asyncio.gather(collect(a), collect(b))
        finally:
            eng.shutdown(timeout=30)

    batched_a, batched_b = run_async(go())
    (solo_a,) = run(ToyRunner(), GenerationRequest(prompt_ids=[1, 2, 3], sampling=GREEDY, max_tokens=6,
                                                   ignore_eos=True, logprobs=2))
    assert all(e.logprobs is None for e in batched_b.events if e.kind == "delta")
    got = [(r.token_id, r.top) for r in records(batched_a)]
    want = [(r.token_id, r.top) for r in records(solo_a)]
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, gt), (_, wt) in zip(got, want):
        assert [i for i, _ in gt] == [i for i, _ in wt]
        assert [v for _, v in gt] == pytest.approx([v for _, v in wt], abs=1e-5)


def test_penalties_shape_the_values():
    base = dict(prompt_ids=[3, 4], max_tokens=6, ignore_eos=True, logprobs=1)
    (plain,) = run(ToyRunner(), GenerationRequest(sampling=SamplingParams(temperature=1.0, seed=5), **base))
    (penal,) = run(ToyRunner(), GenerationRequest(
        sampling=SamplingParams(temperature=1.0, seed=5, presence_penalty=2.0), **base))
    # the first position has no generated tokens yet: identical; later ones differ once a token repeats
    assert records(plain)[0].logprob == pytest.approx(records(penal)[0].logprob)
    assert [r.logprob for r in records(plain)] != [r.logprob for r in records(penal)]
