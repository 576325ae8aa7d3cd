"""Per-lane thinking control: the thinking budget's early close and the post-thinking switch.

Spec ("thinking budgets", "Post-thinking sampling"). A request whose prompt leaves a reasoning block
open counts the reasoning tokens it generates. At the effective budget, unless the reasoning
closed naturally or the request ended, the engine commits `budget_close_ids` (guidance and close
marker) one per decode round without sampling; the inserted tokens are ordinary output tokens
(usage, max_tokens). Effective budget, with B the requested budget, C the output the request can
still produce and R = len(budget_close_ids) + 1 (one post-close model token):
- C <= B or C - B >= R: B;
- C > R: C - R (below B, so the close and one model token still fit);
- otherwise: not enforced (thinking runs to the output limit).
Once the close marker is committed (generated or inserted) a request with `post_thinking`
switches its sampler; an omitted post-thinking seed continues the request's generator.
"""

from __future__ import annotations

from dataclasses import replace

from ninfer_core.engine.api import GenerationRequest
from ninfer_core.engine.sampler import SamplerState


def effective_budget(budget: int | None, capacity: int, close_len: int) -> int | None:
    """The enforced budget under the C/B/R rules, or None when it cannot be enforced."""
    if budget is None or budget <= 0:
        return None
    need = close_len + 1
    if capacity <= budget or capacity - budget >= need:
        return budget
    if capacity > need:
        return capacity - need
    return None


class ThinkingControl:
    """Tracks one lane's reasoning block; tells the engine what to force and when to switch."""

    def __init__(self, request: GenerationRequest, capacity: int):
        self.inside = bool(request.in_reasoning and request.think_end_ids)
        self.end_ids = frozenset(request.think_end_ids)
        self.close_ids = list(request.budget_close_ids)
        self.reasoning_tokens = 0
        self.budget_requested = request.thinking_budget if self.inside else None
        self.budget = (effective_budget(self.budget_requested, capacity, len(self.close_ids))
                       if self.close_ids else None)
        self.post_thinking = request.post_thinking if self.inside else None
        self.pending: list[int] = []
        self.early_close = False
        self.switched = False

    def next_forced(self) -> int | None:
        """The next inserted token, if an early close is in progress."""
        return self.pending.pop(0) if self.pending else None

    def on_commit(self, token: int) -> bool:
        """Account a committed output token; True when it closed the reasoning block."""
        if not self.inside:
            return False
        self.reasoning_tokens += 1
        if token in self.end_ids:
            self.inside = False  # an early close still commits what follows its marker
            return True
        return False

    def start_early_close(self) -> bool:
        """Queue the close at the budget (call after the commit did not end the request)."""
        if (self.inside and not self.pending and not self.early_close and self.budget is not None
                and self.reasoning_tokens >= self.budget):
            self.pending = list(self.close_ids)
            self.early_close = True
            return True
        return False

    def end_now(self) -> bool:
        """Queue the close at once, whatever the budget (llama.cpp's reasoning_end control); True
        when it was queued or the block is already closed, False without a close sequence."""
        if not self.inside or self.pending:
            return True
        if not self.close_ids:
            return False
        self.pending = list(self.close_ids)
        self.early_close = True
        return True

    def switch_sampler(self, sampler: SamplerState, force_greedy: bool) -> SamplerState:
        """The post-thinking sampler (counts and logit_bias carried over; an omitted seed continues the stream)."""
        params = self.post_thinking
        if params is None:
            return sampler
        self.switched = True
        if not params.logit_bias and sampler.params.logit_bias:  # the request's bias holds in both phases
            params = replace(params, logit_bias=sampler.params.logit_bias)
        if params.seed is None:
            params = replace(params, seed=sampler.seed)
            new = SamplerState.create(params, force_greedy=force_greedy)
            new.stream = sampler.uniforms()  # the same numbers continue
        else:
            new = SamplerState.create(params, force_greedy=force_greedy)
        new.counts = dict(sampler.counts)
        return new

    def facts(self) -> dict | None:
        """What the finish event reports (no text)."""
        if self.budget_requested is None and self.post_thinking is None:
            return None
        return {"budget_requested": self.budget_requested,
                "budget_effective": self.budget,
                "early_close": self.early_close,
                "reasoning_tokens": self.reasoning_tokens,
                "post_thinking_sampling": self.switched}
