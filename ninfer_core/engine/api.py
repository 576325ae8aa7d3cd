"""The engine-client interface: what the HTTP side sees of an Engine.

Protocols never touch scheduler internals: they build a GenerationRequest, `submit` it, read
EngineEvents from the handle (async), and `cancel` on disconnect.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol


class EngineError(Exception):
    """A request-level failure with its HTTP mapping (status, code, param)."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param
        self.type = type_ or _default_type(status)


def _default_type(status: int) -> str:
    if status == 429:
        return "server_overloaded"
    if status >= 500:
        return "service_unavailable" if status == 503 else "server_error"
    return "invalid_request_error"


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = the 20-candidate cap; values above 20 are clamped to 20
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # signed 64-bit; None draws a fresh one
    greedy: bool = False  # exact argmax (also implied by temperature == 0)
    # token id -> additive bias on its logit (float("-inf") bans it: llama.cpp's `false`); applied
    # before penalties, temperature and the filters, and to greedy rows too (sampler.apply_logit_adjustments)
    logit_bias: dict[int, float] = field(default_factory=dict)


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: the default output limit (spec "Default output limit")
    stop: list[str] = field(default_factory=list)  # up to four non-empty strings
    ignore_eos: bool = False
    request_id: str = ""
    deadline: float | None = None  # time.monotonic() by which admission must happen (pending timeout)
    # Context cache: ninfer_core.engine.checkpoints.CheckpointHints (turn closure, message
    # boundaries, stable prefix, client cache markers); None lets the engine derive them.
    checkpoint_hints: Any = None
    # A conversation identity (a Responses chain) so later turns can reuse the cached prefix; None: anonymous.
    # The session's Responses replay checkpoint serves only requests of the same session.
    session_id: str | None = None
    # False (a store:false Responses child): reads the session's checkpoints but publishes beside the
    # chain instead of replacing its latest endpoint or replay checkpoint.
    session_store: bool = True
    # llama.cpp's cache_prompt: False keeps the request out of the context cache (no reuse, no capture).
    cache_prompt: bool = True
    # Scoring (rerank): the log-softmax of these ids over the whole vocabulary at the first output
    # position, from the raw logits (no penalties, temperature or filters), reported on the finish
    # event as `scores`. Sampling is unaffected; pair it with max_tokens 0 to generate nothing.
    score_token_ids: list[int] | None = None
    # Log probabilities (spec "Token log probabilities"): None gathers nothing; k >= 0 reports, for
    # every sampled token, its logprob and the k (<= 20) most likely alternatives (delta `logprobs`).
    logprobs: int | None = None
    # Thinking (spec "thinking budgets", "Post-thinking sampling"): `in_reasoning` says the prompt
    # left a reasoning block open; `think_end_ids` are the close marker's ids. With `thinking_budget`
    # the engine commits `budget_close_ids` (guidance + close) unsampled once that many reasoning
    # tokens are generated (C/B/R rules); with `post_thinking` it switches the sampler after the close.
    in_reasoning: bool = False
    think_end_ids: list[int] = field(default_factory=list)
    # Media (ninfer_core.media.api.MediaPrompt): spans of media rows in prompt_ids (identity ids),
    # rope positions; the engine encodes an item through its vision residency when a prefill
    # unit first needs its rows. None: a text-only prompt.
    media: Any = None
    thinking_budget: int | None = None
    budget_close_ids: list[int] = field(default_factory=list)
    post_thinking: SamplingParams | None = None
    # N-gram drafting: the X-NInfer-Draft-Session this request belongs to (its earlier requests'
    # text become copy sources with --ngram-archive-mib); None: request-local drafting only.
    draft_session: str | None = None
    # Structured output: a ninfer_core.structured.constraint.Constraint (the request's grammar, built
    # by the server), or None. The engine masks the request's logits with it and advances it on commit.
    constraint: Any = None
    # llama.cpp's return_progress: a "progress" event after every prefill unit but the last.
    progress: bool = False


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class EngineEvent:
    """kind: "admitted" | "progress" | "delta" | "finish" | "error".

    admitted: `usage` with prompt_tokens and cached_tokens (the reused prefix admission chose).
    progress: (requests with `progress`) `progress` {"total", "cache", "processed"} after a prefill
            unit committed; consumers that do not know the kind skip it.
    delta: `token_ids` committed and `text` (their decoded text, stop strings withheld).
    finish: `finish_reason` "stop" | "length" (| "cancelled"), `usage`, `timings`,
            `stop_reason` detail ("eos", "stop_string", "max_tokens", "context"),
            `matched_stop` (the stop string that ended it), `scores` (for score_token_ids),
            `thinking` (budget and post-thinking facts). delta `logprobs`: see GenerationRequest.
    error: `error` is an EngineError.
    """

    kind: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | None = None
    usage: Usage | None = None
    timings: dict | None = None
    error: EngineError | None = None
    matched_stop: str | None = None
    scores: list[float] | None = None
    # delta: one TokenLogprob per sampled token when the request asked (a stop string drops those it cuts)
    logprobs: list["TokenLogprob"] | None = None
    # finish: thinking facts for logs: budget_requested, budget_effective, early_close, post_thinking_sampling
    thinking: dict | None = None
    # finish: context-cache facts: source (the reuse path), cache_n, and id_slot / session_digest of
    # the /slots cell the completed session was retained under (None without a context cache)
    context: dict | None = None
    # finish: speculative-decoding counters (request_done.speculative), None without speculation
    speculative: dict | None = None
    # progress: prompt tokens in all, reused, and processed so far (reused included)
    progress: dict | None = None


@dataclass
class TokenLogprob:
    """A sampled token's log probability and the most likely alternatives at its position
    (log-softmax over the whole vocabulary of the biased, penalised logits / temperature; 1 when
    greedy), and the same after the sampler's top_k / top_p / min_p filters (llama.cpp's
    post_sampling_probs: probabilities renormalised over the surviving candidates)."""

    token_id: int
    logprob: float  # -9999.0 when the token is outside the position's 20 most likely
    top: list[tuple[int, float]] = field(default_factory=list)  # descending
    post_prob: float = 0.0  # the token's probability among the filtered candidates (1 when greedy)
    post_top: list[tuple[int, float]] = field(default_factory=list)  # (id, probability), descending, <= k


class RequestHandle(Protocol):
    request_id: str

    def events(self) -> AsyncIterator[EngineEvent]: ...

    def cancel(self) -> None: ...


class EngineClient(Protocol):
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request. Raises EngineError at once for overload (429 server_overloaded) and
        for prompts that can never fit (400 context_length_exceeded)."""

    def snapshot(self) -> dict[str, Any]:
        """Counters and pool occupancy (lanes, pages, slots, pending)."""

    def default_output_limit(self, prompt_tokens: int) -> int:
        """The output budget a request that names none would receive."""

    # The context cache's /slots routes (an engine without a prefix cache has `cache` None):
    def slots_report(self, max_context: int) -> list[dict]:
        """One row per private continuation cell, read without waiting on a forward."""

    def bind_slot_file(self, slot: int, filename: str, depth: int, compat: dict) -> None:
        """Bind a saved cell's session to its slot file."""

    def run_control(self, fn) -> Any:
        """A concurrent.futures.Future of `fn()` run on the worker at the next boundary."""
