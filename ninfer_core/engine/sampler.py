"""Token selection on the logits' device: exact argmax, or penalties, temperature and the
top-k / top-p / min-p filters over the 20 most likely candidates, then a per-request draw.

Every sampling request owns a torch.Generator seeded from its signed 64-bit seed and draws one
uniform number per token from it, so its output does not depend on which other requests share
the batch.
"""

from __future__ import annotations

import secrets
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


@dataclass
class SamplerState:
    """One request's sampling parameters, generator and generated-token counts."""

    params: SamplingParams
    seed: int  # signed 64-bit, as reported to the caller
    greedy: bool = False
    counts: dict[int, int] = field(default_factory=dict)
    _generator: torch.Generator | None = None

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

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(seed_to_u64(self.seed))
        return self._generator

    def observe(self, token_id: int) -> None:
        """Count a committed output token (penalties apply to generated tokens only)."""
        if self.has_penalties:
            self.counts[token_id] = self.counts.get(token_id, 0) + 1


def sample(logits: torch.Tensor, states: list[SamplerState]) -> list[int]:
    """Pick one token per row of `logits` [B, vocab] (fp32) for the matching request state."""
    if logits.dim() == 1:
        logits = logits.unsqueeze(0)
    out = [0] * len(states)
    greedy = [i for i, s in enumerate(states) if s.greedy]
    drawn = [i for i, s in enumerate(states) if not s.greedy]
    if greedy:
        picks = logits[greedy].argmax(dim=-1).tolist()
        for i, t in zip(greedy, picks):
            out[i] = t
    if drawn:
        picks = _draw(logits[drawn], [states[i] for i in drawn])
        for i, t in zip(drawn, picks):
            out[i] = t
    return out


def _draw(logits: torch.Tensor, states: list[SamplerState]) -> list[int]:
    device = logits.device
    x = logits.float().clone()  # [B, vocab]
    for row, s in enumerate(states):
        if s.has_penalties and s.counts:
            ids = torch.tensor(list(s.counts), device=device)
            counts = torch.tensor(list(s.counts.values()), device=device, dtype=x.dtype)
            x[row, ids] -= s.params.presence_penalty + s.params.frequency_penalty * counts
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
    cum = probs.cumsum(-1)
    u = torch.stack([torch.rand((), generator=s.generator(device), device=device) for s in states])
    target = u.to(cum.dtype).unsqueeze(1) * cum[:, -1:]
    choice = (cum < target).sum(-1).clamp_(max=k - 1)  # first candidate whose cumulative mass reaches u
    return ids.gather(1, choice.unsqueeze(1)).squeeze(1).tolist()


LOGPROB_FLOOR = -9999.0  # OpenAI's value for a sampled token outside its position's top 20


def token_logprobs(logits: torch.Tensor, states: list[SamplerState], tokens: list[int],
                   ks: list[int]) -> list:
    """TokenLogprob per row for the tokens just sampled (call before `observe`).

    Values: the logits after the presence/frequency penalties, divided by the temperature (1 for
    greedy), log-softmaxed over the whole vocabulary; top_k/top_p/min_p do not change them. A token
    outside the position's 20 most likely reports LOGPROB_FLOOR."""
    from ninfer_core.engine.api import TokenLogprob

    if logits.dim() == 1:
        logits = logits.unsqueeze(0)
    out = []
    for row, (s, token, k) in enumerate(zip(states, tokens, ks)):
        x = logits[row].float().clone()  # [vocab]
        if s.has_penalties and s.counts:
            ids = torch.tensor(list(s.counts), device=x.device)
            counts = torch.tensor(list(s.counts.values()), device=x.device, dtype=x.dtype)
            x[ids] -= s.params.presence_penalty + s.params.frequency_penalty * counts
        if not s.greedy and s.params.temperature > 0:
            x = x / s.params.temperature
        lp = torch.log_softmax(x, dim=-1)
        n = min(CANDIDATES, lp.shape[-1])
        vals, ids = lp.topk(n)
        vals, ids = vals.tolist(), ids.tolist()
        chosen = float(lp[token]) if token in ids else LOGPROB_FLOOR
        top = list(zip(ids[: max(0, min(k, n))], vals[: max(0, min(k, n))]))
        out.append(TokenLogprob(int(token), chosen, top))
    return out
