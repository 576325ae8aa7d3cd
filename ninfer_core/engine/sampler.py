"""Token selection: exact argmax, or penalties, temperature and the top-k / top-p / min-p filters
over the 20 most likely candidates, then a per-request draw. A request's logit_bias applies before
either (`apply_logit_adjustments`).

Every sampling request owns a stream of uniform numbers seeded from its signed 64-bit seed
(`UniformStream`, on the host) and spends one number per output position, whichever way the
position's token was found, so its output does not depend on which other requests share the batch.
The token of a position is the inverse-CDF pick of that position's filtered distribution at its
number. A speculative round verifies drafts against exactly that pick (`pick_tokens` over the
verify rows): a draft is accepted when it equals the pick, which happens with probability p(draft),
and on a rejection the pick is a draw from the residual distribution p(. | != draft), so the output
distribution is the target's (rejection sampling with the drafter's point-mass proposal, coupled
through the position's one number), and a seeded request's output is the same token for token with
or without a speculative backend. Drafts that come with their own distribution q use the general
test `accept_with_residual` instead.
"""

from __future__ import annotations

import random
import secrets
from collections import deque
from dataclasses import dataclass, field

import torch

from ninfer_core.engine.api import SamplingParams

CANDIDATES = 20  # the sampler's candidate domain (top_k 0 or above 20 means 20)
_U64 = (1 << 64) - 1


def seed_to_u64(seed: int) -> int:
    """Map a signed 64-bit seed to the generator's unsigned domain (two's complement)."""
    return int(seed) & _U64


def random_seed() -> int:
    """A fresh signed 64-bit seed."""
    return secrets.randbits(64) - (1 << 63)


class UniformStream:
    """One request's uniform numbers in [0, 1), one per output position, read ahead on demand.

    A host PRNG (Python's Mersenne Twister seeded with the unsigned seed): a verify round peeks at
    the numbers of its k+1 positions and consumes only those of the tokens it commits."""

    def __init__(self, seed: int):
        self._rng = random.Random(seed_to_u64(seed))
        self._ahead: deque[float] = deque()

    def peek(self, n: int) -> list[float]:
        while len(self._ahead) < n:
            self._ahead.append(self._rng.random())
        return [self._ahead[i] for i in range(n)]

    def take(self, n: int = 1) -> list[float]:
        got = self.peek(n)
        for _ in range(n):
            self._ahead.popleft()
        return got


@dataclass
class SamplerState:
    """One request's sampling parameters, uniform stream and generated-token counts."""

    params: SamplingParams
    seed: int  # signed 64-bit, as reported to the caller
    greedy: bool = False
    counts: dict[int, int] = field(default_factory=dict)
    stream: UniformStream | None = None
    _bias: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)  # (ids, values) on device

    @classmethod
    def create(cls, params: SamplingParams, *, force_greedy: bool = False,
               default_seed: int | None = None) -> "SamplerState":
        """`force_greedy` is the process --greedy; `default_seed` the process --seed."""
        seed = params.seed if params.seed is not None else default_seed
        if seed is None:
            seed = random_seed()
        greedy = force_greedy or params.greedy or params.temperature <= 0
        return cls(params=params, seed=seed, greedy=greedy)

    @property
    def top_k(self) -> int:
        k = self.params.top_k
        return CANDIDATES if k <= 0 or k > CANDIDATES else k

    @property
    def has_penalties(self) -> bool:
        return bool(self.params.presence_penalty or self.params.frequency_penalty)

    def uniforms(self) -> UniformStream:
        if self.stream is None:
            self.stream = UniformStream(self.seed)
        return self.stream

    @property
    def has_bias(self) -> bool:
        return bool(self.params.logit_bias)

    def bias_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The logit_bias as (ids, values) on `device`, built once per request."""
        if self._bias is None or self._bias[0].device != device:
            bias = self.params.logit_bias
            self._bias = (torch.tensor(list(bias), device=device, dtype=torch.long),
                          torch.tensor(list(bias.values()), device=device, dtype=torch.float32))
        return self._bias

    def observe(self, token_id: int) -> None:
        """Count a committed output token (penalties apply to generated tokens only)."""
        if self.has_penalties:
            self.counts[token_id] = self.counts.get(token_id, 0) + 1

    def counts_with(self, drafts) -> dict[int, int]:
        """The penalty counts at a verify position: committed tokens plus the drafts before it."""
        if not self.has_penalties or not drafts:
            return self.counts
        out = dict(self.counts)
        for t in drafts:
            out[t] = out.get(t, 0) + 1
        return out


def apply_logit_adjustments(x: torch.Tensor, state: SamplerState, penalties: bool = True,
                            counts: dict[int, int] | None = None) -> torch.Tensor:
    """Add the request's logit_bias to one row `x` [vocab] (fp32, modified in place) and, with
    `penalties`, subtract its presence/frequency penalties over `counts` (default: the generated
    tokens; a verify position passes the counts with the drafts before it).

    Every path that reads a request's logits goes through here (the draw, the greedy argmax, the
    reported log probabilities, verification), so they see the same distribution. Greedy passes
    penalties=False: it is the exact argmax of the model's logits, bias included."""
    if state.has_bias:
        ids, values = state.bias_tensors(x.device)
        x[ids] += values.to(x.dtype)
    counts = state.counts if counts is None else counts
    if penalties and state.has_penalties and counts:
        ids = torch.tensor(list(counts), device=x.device)
        n = torch.tensor(list(counts.values()), device=x.device, dtype=x.dtype)
        x[ids] -= state.params.presence_penalty + state.params.frequency_penalty * n
    return x


def filtered_probs(logits: torch.Tensor, states: list[SamplerState], counts: list | None = None):
    """The sampling distribution of each row over its candidates: (probs [B, k], ids [B, k]).

    Penalties, then the 20 most likely, temperature, top-k, top-p, min-p, renormalised."""
    device = logits.device
    x = logits.float().clone()  # [B, vocab]
    for row, s in enumerate(states):
        apply_logit_adjustments(x[row], s, True, None if counts is None else counts[row])
    k = min(CANDIDATES, x.shape[-1])
    vals, ids = x.topk(k, dim=-1)  # [B, k], sorted descending

    def column(values):
        return torch.tensor(values, device=device, dtype=vals.dtype).unsqueeze(1)  # [B, 1]

    vals = vals / column([s.params.temperature for s in states])
    probs = torch.softmax(vals, dim=-1)
    rank = torch.arange(k, device=device).unsqueeze(0)
    probs = probs * (rank < column([s.top_k for s in states]))
    probs = probs / probs.sum(-1, keepdim=True)
    # top_p: keep a candidate while the mass before it is below top_p (the first always stays)
    before = probs.cumsum(-1) - probs
    probs = probs * (before < column([s.params.top_p for s in states]))
    # min_p: relative to the most likely candidate
    probs = probs * (probs >= column([s.params.min_p for s in states]) * probs[:, :1])
    return probs / probs.sum(-1, keepdim=True), ids


def _inverse_cdf(probs: torch.Tensor, ids: torch.Tensor, u: list[float]) -> list[int]:
    cum = probs.cumsum(-1)
    target = torch.tensor(u, device=probs.device, dtype=cum.dtype).unsqueeze(1) * cum[:, -1:]
    choice = (cum < target).sum(-1).clamp_(max=probs.shape[-1] - 1)  # first candidate reaching u
    return ids.gather(1, choice.unsqueeze(1)).squeeze(1).tolist()


def pick_tokens(logits: torch.Tensor, states: list[SamplerState], uniforms: list[float | None],
                counts: list | None = None) -> list[int]:
    """The token of each row [B, vocab]: argmax for greedy rows, else the inverse-CDF pick of the
    row's filtered distribution at its uniform number (`counts[row]`: its penalty counts)."""
    if logits.dim() == 1:
        logits = logits.unsqueeze(0)
    out = [0] * len(states)
    greedy = [i for i, s in enumerate(states) if s.greedy]
    drawn = [i for i, s in enumerate(states) if not s.greedy]
    if greedy:
        rows = logits[greedy]
        biased = [j for j, i in enumerate(greedy) if states[i].has_bias]
        if biased:  # only rows with a bias pay for fp32 (the indexing above already copied)
            rows = rows.float()
            for j in biased:
                apply_logit_adjustments(rows[j], states[greedy[j]], penalties=False)
        for i, t in zip(greedy, rows.argmax(dim=-1).tolist()):
            out[i] = t
    if drawn:
        probs, ids = filtered_probs(logits[drawn], [states[i] for i in drawn],
                                    None if counts is None else [counts[i] for i in drawn])
        for i, t in zip(drawn, _inverse_cdf(probs, ids, [uniforms[i] for i in drawn])):
            out[i] = t
    return out


def sample(logits: torch.Tensor, states: list[SamplerState]) -> list[int]:
    """Pick one token per row of `logits` [B, vocab] (fp32), spending each sampling row's number."""
    return pick_tokens(logits, states, [None if s.greedy else s.uniforms().take(1)[0] for s in states])


def accept_with_residual(p_probs: torch.Tensor, p_ids: torch.Tensor, draft: int, q: torch.Tensor,
                         u_accept: float, u_residual: float) -> tuple[bool, int]:
    """Rejection sampling for a draft drawn from a distribution q [vocab]: accept with probability
    min(1, p(d)/q(d)); otherwise draw from the residual max(p - q, 0), renormalised.

    p is given over its candidates (p_probs [k], p_ids [k]). Returns (accepted, token)."""
    p = torch.zeros_like(q, dtype=torch.float32)
    p[p_ids] = p_probs.float()
    qd = float(q[draft])
    if qd > 0 and u_accept < min(1.0, float(p[draft]) / qd):
        return True, draft
    resid = (p - q.float()).clamp_(min=0)
    total = float(resid.sum())
    if total <= 0:  # p == q: the draft's rejection cannot happen; fall back to p itself
        resid, total = p, float(p.sum())
    cum = resid.cumsum(0)
    return False, int((cum < u_residual * total).sum().clamp(max=q.numel() - 1))


LOGPROB_FLOOR = -9999.0  # OpenAI's value for a sampled token outside its position's top 20


def filtered_candidates(x: torch.Tensor, state: SamplerState,
                        top: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[list[int], list[float]]:
    """The distribution a drawn row samples from: candidate ids and probabilities after the
    temperature and the top_k / top_p / min_p filters, renormalised; `x` [vocab] is the adjusted
    row (`apply_logit_adjustments`) of a row that is not greedy. Descending; filtered-out
    candidates are left out.

    The same steps as `filtered_probs`, for one row: kept apart so reporting never touches the
    draw. `top` is `x.topk(CANDIDATES)` when the caller has it."""
    k = min(CANDIDATES, x.shape[-1])
    vals, ids = top if top is not None else x.topk(k)  # [k], descending
    probs = torch.softmax(vals / state.params.temperature, dim=-1)
    probs = probs * (torch.arange(k, device=x.device) < state.top_k)
    probs = probs / probs.sum()
    before = probs.cumsum(-1) - probs
    probs = probs * (before < state.params.top_p)
    probs = probs * (probs >= state.params.min_p * probs[0])
    total = float(probs.sum())
    if not total > 0:  # top_p 0 keeps no mass: the draw then takes the first candidate
        return [int(ids[0])], [1.0]
    probs = probs / total
    keep = probs > 0
    return ids[keep].tolist(), probs[keep].tolist()


def token_logprobs(logits: torch.Tensor, states: list[SamplerState], tokens: list[int],
                   ks: list[int], counts: list | None = None) -> list:
    """TokenLogprob per row for the tokens just picked (call before `observe`).

    Values: the logits after the logit_bias and the presence/frequency penalties (`counts[row]`:
    a verify position's counts), divided by the temperature (1 for greedy), log-softmaxed over the
    whole vocabulary; top_k/top_p/min_p do not change them. A token outside the position's 20 most
    likely reports LOGPROB_FLOOR; a token the bias bans never appears among the alternatives.
    `post_prob` / `post_top` are the same position after the filters (`filtered_candidates`)."""
    from ninfer_core.engine.api import TokenLogprob

    if logits.dim() == 1:
        logits = logits.unsqueeze(0)
    out = []
    for row, (s, token, k) in enumerate(zip(states, tokens, ks)):
        x = apply_logit_adjustments(logits[row].float().clone(), s, True,
                                    None if counts is None else counts[row])  # [vocab]
        n = min(CANDIDATES, x.shape[-1])
        top = x.topk(n)  # the log-softmax keeps this order: one top-k serves both distributions
        # a greedy row's distribution after sampling is its pick alone
        post = [(int(token), 1.0)] if s.greedy else list(zip(*filtered_candidates(x, s, top)))
        if not s.greedy and s.params.temperature > 0:
            x = x / s.params.temperature
        lp = torch.log_softmax(x, dim=-1)
        ids = top.indices
        vals, ids = lp[ids].tolist(), ids.tolist()
        finite = [(i, v) for i, v in zip(ids, vals) if v != float("-inf")]
        chosen = float(lp[token]) if token in ids and float(lp[token]) != float("-inf") else LOGPROB_FLOOR
        m = max(0, min(k, n))
        out.append(TokenLogprob(int(token), chosen, finite[:m], dict(post).get(int(token), 0.0), post[:m]))
    return out
