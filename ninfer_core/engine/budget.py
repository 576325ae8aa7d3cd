"""Output budgets and admission entitlements (spec "Default output limit").

Pure arithmetic over the options and the pool size, shared by `submit` validation and
`Engine.default_output_limit`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_core.engine.api import EngineError
from ninfer_core.engine.pages import pages_for


@dataclass(frozen=True)
class Budget:
    """What a request is admitted with."""

    max_tokens: int  # effective output limit
    at_context: bool  # the limit is the remaining context (finish reports stop_reason "context")
    entitlement_pages: int  # pages reserved at admission through completion


class BudgetPolicy:
    """Output limits for one engine: `max_context`, `lanes` over a pool of `pool_pages` pages."""

    def __init__(self, max_context: int, lanes: int, pool_pages: int, page_size: int,
                 default_max_tokens: int | None = None, lease_window: int | None = None):
        self.max_context = max_context
        self.lanes = lanes
        self.pool_pages = pool_pages
        self.page_size = page_size
        self.default_max_tokens = default_max_tokens
        # --kv-lease-growth: admission reserves the prompt plus this much output (cache_lease grows it)
        self.lease_window = lease_window

    @property
    def pool_tokens(self) -> int:
        return self.pool_pages * self.page_size

    def default_output_limit(self, prompt_tokens: int) -> int:
        """The largest output whose entitlement fits one lane's share of the pool, clamped to the
        remaining context; a prompt that alone overruns the share keeps the remaining context.

        Every answer is also kept inside the whole pool so a limitless request stays admissible.
        """
        remaining = self.max_context - prompt_tokens
        if self.default_max_tokens is not None:
            limit = self.default_max_tokens
        else:
            share_tokens = (self.pool_pages // self.lanes) * self.page_size
            limit = share_tokens - prompt_tokens
            if limit < 1:
                limit = remaining
        return max(0, min(limit, remaining, self.pool_tokens - prompt_tokens))

    def resolve(self, prompt_tokens: int, max_tokens: int | None) -> Budget:
        """Validate a prompt and its requested limit; raises EngineError (400) when it can never run."""
        if prompt_tokens <= 0:
            raise EngineError(400, "invalid_prompt", "the prompt is empty: at least one token is required",
                              "messages")
        if prompt_tokens >= self.max_context:
            raise EngineError(
                400, "context_length_exceeded",
                f"the prompt has {prompt_tokens} tokens, which leaves no room for output in the "
                f"context ceiling of {self.max_context} tokens: start the server with a larger --max-context",
                "messages")
        if max_tokens is not None and max_tokens < 0:
            raise EngineError(400, "invalid_request", f"max_tokens must be >= 0, got {max_tokens}",
                              "max_tokens")
        remaining = self.max_context - prompt_tokens
        if max_tokens is None:
            limit = self.default_output_limit(prompt_tokens)
        else:
            limit = min(max_tokens, remaining)
        pages = pages_for(prompt_tokens + limit, self.page_size)
        if self.lease_window is not None:
            pages = pages_for(prompt_tokens + min(limit, self.lease_window), self.page_size)
        if pages > self.pool_pages:
            alone = pages_for(prompt_tokens, self.page_size) > self.pool_pages
            what = (f"the prompt has {prompt_tokens} tokens" if alone else
                    f"the prompt has {prompt_tokens} tokens and asks for up to {limit} output tokens")
            raise EngineError(
                400, "context_length_exceeded",
                f"{what}, but the KV pool holds {self.pool_tokens} tokens: start the server with a larger "
                "--kv-capacity",
                "messages" if alone else "max_tokens")
        return Budget(limit, limit == remaining, pages)
