"""The sampler's logit_bias (apply_logit_adjustments) and the post-sampling distribution it reports
(filtered_candidates, TokenLogprob.post_*), and the protocol parser of logit_bias's wire forms."""

from __future__ import annotations

import math

import pytest
import torch

from ninfer_core.engine.api import EngineError, SamplingParams
from ninfer_core.engine.sampler import (
    SamplerState,
    apply_logit_adjustments,
    filtered_candidates,
    sample,
    token_logprobs,
)
from ninfer_core.protocols.logit_bias import parse_logit_bias

BAN = float("-inf")


def state(**kw) -> SamplerState:
    return SamplerState.create(SamplingParams(**kw))


def test_greedy_takes_the_argmax_of_the_biased_logits():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    top = logits.argmax(-1).tolist()
    states = [state(temperature=0.0, logit_bias={7: 100.0}),  # raised
              state(temperature=0.0, logit_bias={top[1]: BAN}),  # its argmax banned
              state(temperature=0.0)]  # no bias: the exact argmax, untouched
    picks = sample(logits, states)
    second = logits[1].clone()
    second[top[1]] = BAN
    assert picks == [7, int(second.argmax()), top[2]]
    assert logits.argmax(-1).tolist() == top  # the caller's logits are not modified


def test_greedy_ignores_penalties_but_not_the_bias():
    logits = torch.zeros(10)
    logits[3] = 1.0
    s = state(temperature=0.0, presence_penalty=2.0)
    s.observe(3)
    s.counts[3] = 1  # a penalty that would move a drawn row off token 3
    assert sample(logits, [s]) == [3]
    s.params.logit_bias = {5: 2.0}
    assert sample(logits, [s]) == [5]


def test_drawn_rows_honour_bias_and_bans():
    logits = torch.randn(60, generator=torch.Generator().manual_seed(3))
    raised = state(temperature=1.0, seed=5, logit_bias={11: 100.0})
    assert {sample(logits, [raised])[0] for _ in range(50)} == {11}
    top5 = logits.topk(5).indices.tolist()
    banned = state(temperature=2.0, seed=6, logit_bias={t: BAN for t in top5})
    drawn = {sample(logits, [banned])[0] for _ in range(200)}
    assert drawn and not drawn & set(top5)


def test_apply_logit_adjustments_adds_bias_then_penalties():
    x = torch.zeros(6)
    s = state(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={1: 2.0, 4: BAN})
    s.observe(1)
    s.observe(1)
    apply_logit_adjustments(x, s)
    assert x.tolist() == [0.0, 2.0 - 0.5 - 0.5, 0.0, 0.0, BAN, 0.0]
    y = apply_logit_adjustments(torch.zeros(6), s, penalties=False)
    assert y.tolist() == [0.0, 2.0, 0.0, 0.0, BAN, 0.0]


def test_filtered_candidates_is_the_distribution_the_draw_samples():
    """The reported post-sampling probabilities match the draw's frequencies."""
    vocab = 30
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(9)) * 2
    params = dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05)
    ids, probs = filtered_candidates(row.clone(), state(**params))
    assert len(ids) <= 6 and math.isclose(sum(probs), 1.0, rel_tol=1e-5)
    assert probs == sorted(probs, reverse=True)
    n = 6000
    states = [state(seed=i, **params) for i in range(n)]
    picks = sample(row.expand(n, vocab).contiguous(), states)
    assert set(picks) <= set(ids)
    for i, p in zip(ids, probs):
        assert abs(picks.count(i) / n - p) < 0.03, (i, p)


def test_token_logprobs_report_the_biased_distribution():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(4))
    s_greedy = state(temperature=0.0, logit_bias={9: 100.0})
    banned = logits[1].topk(35).indices.tolist()  # 15 tokens left: fewer than the 20 alternatives asked
    s_drawn = state(temperature=1.0, top_k=3, seed=1, logit_bias={t: BAN for t in banned})
    tokens = sample(logits, [s_greedy, s_drawn])
    greedy, drawn = token_logprobs(logits, [s_greedy, s_drawn], tokens, [3, 20])
    assert tokens[0] == 9 and greedy.top[0][0] == 9 and greedy.logprob > -1e-3
    assert (greedy.post_prob, greedy.post_top) == (1.0, [(9, 1.0)])
    assert not set(banned) & {i for i, _ in drawn.top} and len(drawn.top) == 15  # no -inf entries
    assert all(math.isfinite(lp) for _, lp in drawn.top) and tokens[1] not in banned
    assert len(drawn.post_top) <= 3 and tokens[1] in dict(drawn.post_top)
    assert math.isclose(sum(p for _, p in drawn.post_top), 1.0, rel_tol=1e-5)
    assert drawn.post_prob == dict(drawn.post_top)[tokens[1]]


class WordTokenizer:
    """Each space-separated word is one token id (its position in WORDS)."""

    WORDS = ["Hello", "World", "!"]

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        return [self.WORDS.index(w) for w in text.split()]


@pytest.mark.parametrize("wire,want", [
    (None, {}),
    ({"2": 1.5, "0": 0}, {2: 1.5}),  # OpenAI's map; zero biases dropped
    ([[1, -3], ["Hello !", False]], {1: -3.0, 0: BAN, 2: BAN}),  # llama.cpp's pairs, a string is every token
    ({"World": 4, "1": 1}, {1: 5.0}),  # a text key, and a token named twice adds up
    ([[2, 100], [2, -100]], {}),
])
def test_logit_bias_wire_forms(wire, want):
    assert parse_logit_bias(wire, WordTokenizer(), 3) == want


@pytest.mark.parametrize("wire,code,param", [
    ("x", "invalid_type", "logit_bias"),
    ([3], "invalid_type", "logit_bias.0"),
    ([[1, 2, 3]], "invalid_type", "logit_bias.0"),
    ([[1.5, 1]], "invalid_type", "logit_bias.0.0"),
    ([[7, 1]], "invalid_value", "logit_bias.0.0"),
    ([["", 1]], "invalid_value", "logit_bias.0.0"),
    ([[1, True]], "invalid_type", "logit_bias.0.1"),
    ([[1, float("nan")]], "invalid_value", "logit_bias.0.1"),
    ({"1": 100.01}, "invalid_value", "logit_bias.1"),
    ({"-1": 1}, "invalid_value", "logit_bias.-1"),
    ({"0": False, "1": False, "2": False}, "invalid_value", "logit_bias"),  # nothing left to generate
])
def test_logit_bias_refusals(wire, code, param):
    with pytest.raises(EngineError) as e:
        parse_logit_bias(wire, WordTokenizer(), 3)
    assert (e.value.status, e.value.code, e.value.param) == (400, code, param)


def test_request_log_records_the_bias_as_a_count():
    """The JSONL request log writes strict JSON: a ban (minus infinity) and the client's token ids
    are logged as the number of biased tokens."""
    import json

    from ninfer_core.server.request_log import _sampler_record

    rec = _sampler_record(SamplingParams(logit_bias={5: BAN, 9: 2.0}))
    assert rec["logit_bias"] == 2
    json.dumps(rec, allow_nan=False)
