"""Submitting a raw-prompt request and observing it: shared by /completion and /v1/completions.

`submit_raw` holds an ingress unit, tokenizes on a worker thread and submits; `LiveTimings`
measures llama.cpp's cumulative timings on the HTTP side for timings_per_token chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import anyio

from ninfer_core.engine.api import EngineError, GenerationRequest, SamplingParams
from ninfer_core.engine.checkpoints import CheckpointHints
from ninfer_core.protocols.raw_prompt import RawPlan, output_limit, raw_sampling, tokenize_prompt
from ninfer_core.server.context import ServerContext
from ninfer_core.server.errors import bad_request

# Spec "Raw-prompt completion": below this a regenerated prompt is cheaper to prefill than the extra
# capture pass its checkpoint costs.
RAW_CHECKPOINT_MIN = 512


@dataclass
class RawSubmission:
    """A submitted raw request: its handle, prompt and what it resolved to."""

    handle: Any
    prompt_ids: list[int]
    sampling: SamplingParams
    n_predict: int  # the effective output limit the engine runs with
    release: Any  # idempotent: gives the ingress unit back


async def submit_raw(request: Any, ctx: ServerContext, plan: RawPlan, logprobs: int | None = None,
                     progress: bool = False) -> RawSubmission:
    """Hold an ingress unit, tokenize on a worker thread, submit; the caller must `release()`.

    `logprobs` (k) asks the engine for each generated token's log probability and k alternatives;
    `progress` for its prefill progress events (return_progress)."""
    deadline = time.monotonic() + ctx.options.engine.pending_timeout_ms / 1000.0
    release = ctx.ingress.acquire()

    try:
        ids = await anyio.to_thread.run_sync(tokenize_prompt, ctx, plan.prompt)
        if not ids:
            raise bad_request("invalid_value", "The prompt encodes to no tokens.", "prompt")
        sampling = raw_sampling(ctx, plan)
        max_tokens = output_limit(ctx, plan, len(ids))
        gen = GenerationRequest(prompt_ids=ids, sampling=sampling, max_tokens=max_tokens, stop=plan.stop,
                                ignore_eos=plan.ignore_eos,
                                request_id=request.scope.get("state", {}).get("request_id", ""),
                                deadline=deadline, checkpoint_hints=raw_hints(len(ids)), logprobs=logprobs,
                                cache_prompt=plan.cache_prompt, progress=progress)
        handle = ctx.engine.submit(gen)
    except EngineError as e:
        release()
        # the engine names chat fields; a raw request's are the prompt and its own limit field
        if e.param == "messages":
            e.param = "prompt"
        elif e.param == "max_tokens":
            e.param = plan.limit_param
        raise
    except BaseException:
        release()
        raise
    n_predict = getattr(handle, "max_tokens", None)
    if n_predict is None:
        n_predict = max_tokens if max_tokens is not None else ctx.engine.default_output_limit(len(ids))
    return RawSubmission(handle, ids, sampling, int(n_predict), release)


def raw_hints(prompt_tokens: int) -> CheckpointHints:
    """A raw prompt has no message structure to checkpoint inside it; one of at least
    RAW_CHECKPOINT_MIN tokens keeps a private checkpoint one token short of its end, so the same
    prompt sent again (a regenerated completion) resumes there."""
    if prompt_tokens >= RAW_CHECKPOINT_MIN:
        return CheckpointHints(turn_closure=prompt_tokens - 1)
    return CheckpointHints()


class LiveTimings:
    """Cumulative llama.cpp timings observed on the HTTP side, for timings_per_token chunks.

    The engine publishes exact timings only on the finish event; between events this snapshot is
    measured from their arrival: prompt time from admission to the first output delta, generation
    time from there to the latest delta.
    """

    def __init__(self, prompt_tokens: int):
        self._now = time.monotonic
        self.prompt_n = prompt_tokens
        self.cache_n = 0
        self.t_admit: float | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.predicted_n = 0

    def admitted(self, cached: int = 0) -> None:
        self.t_admit = self._now()
        self.cache_n = cached

    def tokens(self, n: int) -> None:
        now = self._now()
        if self.t_admit is None:
            self.t_admit = now
        if self.t_first is None and n:
            self.t_first = now
        self.t_last = now
        self.predicted_n += n

    def prompt_ms(self) -> float:
        if self.t_admit is None:
            return 0.0
        return ((self.t_first or self._now()) - self.t_admit) * 1000.0

    def snapshot(self) -> dict:
        prompt_n = max(self.prompt_n - self.cache_n, 0)
        prompt_ms = self.prompt_ms()
        predicted_ms = ((self.t_last - self.t_first) * 1000.0) if self.t_first is not None else 0.0
        intervals = max(self.predicted_n - 1, 0)

        def rate(n: int, ms: float) -> float:
            return n * 1000.0 / ms if n and ms > 0 else 0.0

        def per_token(ms: float, n: int) -> float:
            return ms / n if n and ms > 0 else 0.0

        return {"cache_n": self.cache_n, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": per_token(prompt_ms, prompt_n),
                "prompt_per_second": rate(prompt_n, prompt_ms),
                "predicted_n": self.predicted_n, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": per_token(predicted_ms, intervals),
                "predicted_per_second": rate(intervals, predicted_ms)}


def cancelled_error() -> EngineError:
    return EngineError(503, "request_cancelled", "The request was cancelled before it completed.")


def unfinished_error() -> EngineError:
    return EngineError(500, "internal_error", "The engine ended the request without finishing it.",
                       type_="server_error")
