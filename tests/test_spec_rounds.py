"""The speculative round (engine/rounds.py) on the toy runner: exactness, stops inside a round,
sampling, n-gram drafting, counters. The toy runner checks every forward's pages and state slot
against the tokens it holds, so a commit that keeps the wrong prefix raises instead of passing."""

from __future__ import annotations

import math
import random

import pytest
import torch

from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.sampler import SamplerState, accept_with_residual, filtered_probs, pick_tokens
from ninfer_core.testing import OracleDrafter, ScriptPolicy, ToyRunner, ToyTokenizer, collect, run_async

TOK = ToyTokenizer()
GREEDY = SamplingParams(temperature=0.0)


def run(reqs, runner=None, spec=None, concurrent=False, **opts):
    """Outcomes of `reqs` on one engine (all submitted together when `concurrent`)."""
    runner = runner or ToyRunner()

    async def go():
        eng = Engine(runner, TOK, EngineOptions(**{"max_context": 1024, **opts}), spec=spec)
        eng.start()
        try:
            if concurrent:
                handles = [eng.submit(r) for r in reqs]
                outs = [await collect(h) for h in handles]
            else:
                outs = [await collect(eng.submit(r)) for r in reqs]
            snap = eng.snapshot()
            assert snap["lanes_active"] == 0
            if not opts.get("prefix_reuse"):  # (the context cache keeps retained conversations' pages)
                assert snap["pages_free"] == snap["pages_total"]
            return outs, snap
        finally:
            eng.shutdown(timeout=30)

    return run_async(go())


def oracle(runner, k, corrupt=0.0, seed=0):
    return OracleDrafter(runner.greedy_continuation, draft_tokens=k, corrupt=corrupt, seed=seed)


def req(prompt, n=40, sampling=GREEDY, **kw):
    return GenerationRequest(prompt_ids=list(prompt), sampling=sampling, max_tokens=n, **kw)


PROMPTS = [TOK.encode(t) for t in ("hello there", "the quick brown fox", "x", "speculate on this prompt")]


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("corrupt", [0.0, 0.3, 1.0])
def test_greedy_output_equals_plain_decode(k, corrupt):
    plain, _ = run([req(p) for p in PROMPTS])
    r = ToyRunner()
    spec, snap = run([req(p) for p in PROMPTS], runner=r, spec=oracle(r, k, corrupt))
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids and b.text == a.text
        assert b.finish.finish_reason == a.finish.finish_reason
    c = snap["counters"]
    assert c["draft_tokens"] > 0 and c["committed_decode_tokens"] == sum(len(o.token_ids) - 1 for o in spec)
    verifies = [x for x in r.calls if x[0] == "verify"]
    assert verifies, "no verify round ran"
    if corrupt == 0.0:  # every draft is the target's own pick: all accepted, K + 1 tokens a round
        # (but drafts after the request's end in its last round)
        assert c["draft_tokens"] - k * len(PROMPTS) <= c["draft_accepted_tokens"] < c["draft_tokens"] + 1
        assert max(x[2] for x in verifies) == k + 1
    if corrupt == 1.0:
        assert c["draft_accepted_tokens"] == 0


def test_mixed_batch_of_lanes_with_sampling_and_different_lengths():
    reqs = [req(PROMPTS[0], 30), req(PROMPTS[1], 7, SamplingParams(temperature=0.9, seed=4)),
            req(PROMPTS[2], 50), req(PROMPTS[3], 19, SamplingParams(temperature=1.3, top_p=0.8, seed=-2))]
    plain, _ = run(reqs, max_concurrency=4, concurrent=True)
    r = ToyRunner()
    spec, _ = run(reqs, runner=r, spec=oracle(r, 4, 0.25), max_concurrency=4, concurrent=True)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert any(len(x[1]) > 1 for x in r.calls if x[0] == "verify"), "lanes never verified together"


def test_seeded_sampling_is_the_same_token_for_token_with_and_without_drafts():
    s = SamplingParams(temperature=1.0, top_k=0, seed=12345, presence_penalty=0.4, frequency_penalty=0.2)
    plain, _ = run([req(PROMPTS[1], 60, s)])
    for corrupt in (0.0, 0.5):
        r = ToyRunner(logit_scale=0.5)  # flat logits: the greedy drafts are often rejected
        r2 = ToyRunner(logit_scale=0.5)
        base, _ = run([req(PROMPTS[1], 60, s)], runner=r2)
        spec, snap = run([req(PROMPTS[1], 60, s)], runner=r, spec=oracle(r, 3, corrupt))
        assert spec[0].token_ids == base[0].token_ids
        assert 0 < snap["counters"]["draft_accepted_tokens"] < snap["counters"]["draft_tokens"]
    assert plain[0].token_ids  # the unflattened run is a different model; it only has to run


@pytest.mark.parametrize("stop", ["eos", "string", "length"])
def test_a_stop_inside_a_round_commits_the_exact_prefix(stop):
    """The output ends inside an accepted run of drafts; the endpoint captured for prefix reuse is
    exact (the next turn resumes from it and the toy runner checks the state against the pages)."""
    script = TOK.encode("abcdefghijklmnop")
    prompt = TOK.encode("Q:")
    policy = ScriptPolicy({tuple(prompt): script + ([TOK.EOS] if stop == "eos" else [])}, after=ord("z"))
    kw = {"stop": ["ghi"]} if stop == "string" else {}
    n = 9 if stop == "length" else 40
    plain, _ = run([req(prompt, n, **kw)], runner=ToyRunner(policy=policy), prefix_reuse=True)
    r = ToyRunner(policy=policy)
    (out,), _ = run([req(prompt, n, **kw)], runner=r, spec=oracle(r, 7), prefix_reuse=True)
    assert out.token_ids == plain[0].token_ids and out.text == plain[0].text
    assert out.finish.stop_reason == {"eos": "eos", "string": "stop_string", "length": "max_tokens"}[stop]
    # the second turn: the first turn's prompt and output, then more; it resumes from the endpoint
    turn2 = prompt + out.token_ids + TOK.encode(" more")
    r2 = ToyRunner(policy=policy)
    outs, snap = run([req(prompt, n, **kw), req(turn2, 12)], runner=r2, spec=oracle(r2, 7), prefix_reuse=True)
    assert outs[1].finish.usage.cached_tokens > len(prompt)
    (cold,), _ = run([req(turn2, 12)], runner=ToyRunner(policy=policy))
    assert outs[1].token_ids == cold.token_ids


def test_logprobs_and_thinking_close_are_unchanged_by_drafts():
    close = ord("#")
    prompt = TOK.encode("think")
    policy = ScriptPolicy({tuple(prompt): TOK.encode("abc#de")}, after=TOK.EOS)
    post = SamplingParams(temperature=0.7, seed=3)
    r0 = ToyRunner(policy=policy)
    kw = dict(sampling=SamplingParams(temperature=0.0), max_tokens=20, logprobs=3, in_reasoning=True,
              think_end_ids=[close], post_thinking=post)
    (plain,), _ = run([GenerationRequest(prompt_ids=prompt, **kw)], runner=r0)
    r = ToyRunner(policy=policy)
    (spec,), _ = run([GenerationRequest(prompt_ids=prompt, **kw)], runner=r, spec=oracle(r, 5))
    assert spec.token_ids == plain.token_ids
    lp = [(x.token_id, round(x.logprob, 5)) for d in spec.events if d.kind == "delta" for x in (d.logprobs or [])]
    lp0 = [(x.token_id, round(x.logprob, 5)) for d in plain.events if d.kind == "delta" for x in (d.logprobs or [])]
    assert lp == lp0 and lp


def test_timings_report_draft_counts_and_the_finish_event_the_speculative_facts():
    r = ToyRunner()
    (out,), _ = run([req(PROMPTS[3], 30)], runner=r, spec=oracle(r, 3, 0.5, seed=9))
    t = out.finish.timings
    sp = out.finish.speculative
    assert t["draft_n"] == sp["drafted_tokens"] > 0 and t["draft_n_accepted"] == sp["accepted_tokens"]
    assert sp["backend"] == "oracle" and sp["rounds"] == sp["model_rounds"] > 0
    assert sum(sp["accepted_per_position"]) == sp["accepted_tokens"]
    assert sp["accepted_per_position"] == sorted(sp["accepted_per_position"], reverse=True)


# -- n-gram copy drafting --------------------------------------------------------------------------


def test_ngram_copies_repeated_text_without_a_backend():
    rep = TOK.encode("one two three four five six seven eight nine ten ")
    prompt = rep * 3
    policy = ScriptPolicy({tuple(prompt): rep * 2}, after=TOK.EOS)
    (plain,), _ = run([req(prompt, 80)], runner=ToyRunner(policy=policy))
    r = ToyRunner(policy=policy)
    (spec,), snap = run([req(prompt, 80)], runner=r, ngram_draft_tokens=15, ngram_min_match=4)
    assert spec.token_ids == plain.token_ids
    sp = spec.finish.speculative
    assert sp["backend"] is None and sp["ngram_rounds"] > 0 and sp["ngram_accepted_tokens"] > 20
    assert sp["ngram_drafted_tokens"] == sp["drafted_tokens"]
    # the copy run commits many tokens per round
    assert max(x[2] for x in r.calls if x[0] == "verify") == 16


def test_ngram_with_a_backend_falls_back_to_the_model_drafter():
    r = ToyRunner()
    (spec,), _ = run([req(PROMPTS[3], 30)], runner=r, spec=oracle(r, 3), ngram_min_match=4)
    sp = spec.finish.speculative
    assert sp["model_rounds"] > 0 and sp["rounds"] == sp["model_rounds"] + sp["ngram_rounds"]


def test_lookup_ngram_proposes_after_a_short_match():
    prompt = TOK.encode("ab cd ab cd ab cd ab")
    policy = ScriptPolicy({tuple(prompt): TOK.encode(" cd ab cd ab cd")}, after=TOK.EOS)
    (plain,), _ = run([req(prompt, 30)], runner=ToyRunner(policy=policy))
    r = ToyRunner(policy=policy)
    (spec,), _ = run([req(prompt, 30)], runner=r, lookup_ngram=2, ngram_draft_tokens=0)
    assert spec.token_ids == plain.token_ids and spec.finish.speculative["ngram_accepted_tokens"] > 0


def test_draft_session_archive_serves_copies_across_requests():
    text = TOK.encode("alpha beta gamma delta epsilon zeta eta theta iota kappa")
    p1 = TOK.encode("first:")
    p2 = TOK.encode("second: ") + text[:14]
    policy = ScriptPolicy({tuple(p1): text, tuple(p2): text[14:]}, after=TOK.EOS)
    reqs = [req(p1, 80, draft_session="s1"), req(p2, 80, draft_session="s1")]
    r = ToyRunner(policy=policy)
    outs, _ = run(reqs, runner=r, ngram_draft_tokens=15, ngram_min_match=4, ngram_archive_mib=1)
    sp = outs[1].finish.speculative
    assert sp["ngram_archive_accepted_tokens"] > 10 and sp["ngram_archive"]["bound"]
    assert outs[0].finish.speculative["ngram_archive"]["published"]
    (alone,), _ = run([req(p2, 80)], runner=ToyRunner(policy=policy))
    assert outs[1].token_ids == alone.token_ids
    # without the session header the second request has nothing to copy from
    r3 = ToyRunner(policy=policy)
    outs3, _ = run([req(p1, 80), req(p2, 80)], runner=r3, ngram_draft_tokens=15, ngram_min_match=4,
                   ngram_archive_mib=1)
    assert outs3[1].finish.speculative["ngram_archive_rounds"] == 0


# -- sampling: the verified tokens follow the target distribution ------------------------------------


def _chi2_p(observed: dict, expected: dict, n: int) -> float:
    """Pearson chi-square p-value (Wilson-Hilferty normal approximation)."""
    keys = [k for k in expected if expected[k] * n >= 5]
    chi = sum((observed.get(k, 0) - expected[k] * n) ** 2 / (expected[k] * n) for k in keys)
    rest = n - sum(observed.get(k, 0) for k in keys)
    rest_e = n * (1 - sum(expected[k] for k in keys))
    if rest_e >= 5:
        chi += (rest - rest_e) ** 2 / rest_e
        df = len(keys)
    else:
        df = len(keys) - 1
    z = ((chi / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_verified_positions_follow_the_target_distribution():
    """Many seeded requests: the token at the third output position (verified against a draft of
    the target's greedy pick, accepted about p(draft) of the time) is distributed as the target's
    filtered distribution at that position."""
    prompt = TOK.encode("dist")
    policy = ScriptPolicy({tuple(prompt): [ord("a"), ord("b")]}, after=None)
    sampling = dict(temperature=1.0, top_k=6)
    r = ToyRunner(policy=policy, logit_scale=0.6)
    n = 600
    reqs = [req(prompt, 3, SamplingParams(seed=s, **sampling)) for s in range(n)]
    outs, snap = run(reqs, runner=r, spec=oracle(r, 2))
    assert snap["counters"]["draft_accepted_tokens"] > 0
    got: dict = {}
    for o in outs:
        got[o.token_ids[2]] = got.get(o.token_ids[2], 0) + 1
    logits = r.logits_of(prompt + [ord("a"), ord("b")])
    probs, ids = filtered_probs(logits[None], [SamplerState.create(SamplingParams(**sampling))])
    want = {int(i): float(p) for i, p in zip(ids[0], probs[0]) if p > 0}
    assert _chi2_p(got, want, n) > 1e-3, (got, want)


def test_residual_rejection_sampling_matches_the_target():
    """The general test for a sampled draft (q not a point mass): over many draws the output is p."""
    vocab = 8
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(vocab, generator=gen), 0)
    q = torch.softmax(torch.randn(vocab, generator=gen), 0)
    rng = random.Random(1)
    counts: dict = {}
    n = 20000
    for _ in range(n):
        d = rng.choices(range(vocab), weights=q.tolist())[0]
        _, tok = accept_with_residual(p, torch.arange(vocab), d, q, rng.random(), rng.random())
        counts[tok] = counts.get(tok, 0) + 1
    assert _chi2_p(counts, {i: float(p[i]) for i in range(vocab)}, n) > 1e-3


def test_pick_tokens_couples_the_position_number():
    """The pick is a function of the row's distribution and its number: a draft equal to it is
    accepted, so the result never depends on the draft."""
    s = SamplerState.create(SamplingParams(temperature=1.0, seed=5))
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    u = [0.1, 0.5, 0.93]
    a = pick_tokens(logits, [s] * 3, u)
    assert a == pick_tokens(logits, [s] * 3, u)
    assert a != pick_tokens(logits, [s] * 3, [0.9, 0.05, 0.4])
