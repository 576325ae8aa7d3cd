"""Submitting a raw-prompt request and observing it: shared by /completion and /v1/completions.

`submit_raw` holds an ingress unit, tokenizes on a worker thread and submits (the live timings of
timings_per_token chunks are ninfer_core.server.progress.StreamTimings).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import anyio

from ninfer_core.engine.api import EngineError, GenerationRequest, SamplingParams
from ninfer_core.engine.checkpoints import CheckpointHints
from ninfer_core.protocols.raw_prompt import RawPlan, output_limit, raw_sampling
from ninfer_core.protocols.raw_prompt_input import tokenize_prompts
from ninfer_core.server.context import ServerContext
from ninfer_core.structured.request import compile_request, make_constraint

# Spec "Raw-prompt completion": below this a regenerated prompt is cheaper to prefill than the extra
# capture pass its checkpoint costs.
RAW_CHECKPOINT_MIN = 512


@dataclass
class RawSubmission:
    """A submitted raw prompt: its handle, prompt and what it resolved to."""

    handle: Any
    prompt_ids: list[int]
    sampling: SamplingParams
    n_predict: int  # the effective output limit the engine runs with
    release: Any  # idempotent: gives the ingress unit back (a batch's prompts share the batch's)
    index: int = 0  # the prompt's place in the request (llama.cpp's result `index`)


async def submit_raw(request: Any, ctx: ServerContext, plan: RawPlan, logprobs: int | None = None,
                     progress: bool = False) -> RawSubmission:
    """The one prompt of `plan`: hold an ingress unit, tokenize on a worker thread, submit; the
    caller must `release()`. A batch goes through raw_batch.RawBatch instead.

    `logprobs` (k) asks the engine for each generated token's log probability and k alternatives;
    `progress` for its prefill progress events (return_progress)."""
    deadline = time.monotonic() + ctx.options.engine.pending_timeout_ms / 1000.0
    release = ctx.ingress.acquire()
    try:
        compiled = await anyio.to_thread.run_sync(compile_request, ctx, plan.response_format)  # structured output
        ids = (await anyio.to_thread.run_sync(tokenize_prompts, ctx, plan.prompts[:1]))[0]
        return submit_prompt(request, ctx, plan, ids, 0, logprobs, deadline, release, compiled, progress)
    except BaseException:
        release()
        raise


def submit_prompt(request: Any, ctx: ServerContext, plan: RawPlan, ids: list[int], index: int,
                  logprobs: int | None, deadline: float, release: Any = None, compiled: Any = None,
                  progress: bool = False) -> RawSubmission:
    """Submit prompt `index` of `plan` (its ids already checked); on the event loop. `compiled`: the
    request's structured-output format (each prompt gets a constraint of its own)."""
    sampling = raw_sampling(ctx, plan)
    copy = plan.prompts[index].copy
    if copy:  # the n_cmpl copies of one prompt draw from seeds of their own (signed 64-bit, wrapped)
        sampling.seed = (sampling.seed + copy + (1 << 63)) % (1 << 64) - (1 << 63)
    max_tokens = output_limit(ctx, plan, len(ids))
    request_id = request.scope.get("state", {}).get("request_id", "")
    if request_id and plan.batch:
        request_id = f"{request_id}-{index}"
    gen = GenerationRequest(prompt_ids=ids, sampling=sampling, max_tokens=max_tokens, stop=plan.stop,
                            ignore_eos=plan.ignore_eos, request_id=request_id, deadline=deadline,
                            checkpoint_hints=raw_hints(len(ids)), logprobs=logprobs,
                            cache_prompt=plan.cache_prompt, constraint=make_constraint(ctx, compiled),
                            progress=progress)
    try:
        handle = ctx.engine.submit(gen)
    except EngineError as e:
        # the engine names chat fields; a raw request's are its prompt and its own limit field
        if e.param == "messages":
            e.param = plan.prompts[index].param
        elif e.param == "max_tokens":
            e.param = plan.limit_param
        raise
    n_predict = getattr(handle, "max_tokens", None)
    if n_predict is None:
        n_predict = max_tokens if max_tokens is not None else ctx.engine.default_output_limit(len(ids))
    return RawSubmission(handle, ids, sampling, int(n_predict), release or (lambda: None), index)


def raw_hints(prompt_tokens: int) -> CheckpointHints:
    """A raw prompt has no message structure to checkpoint inside it; one of at least
    RAW_CHECKPOINT_MIN tokens keeps a private checkpoint one token short of its end, so the same
    prompt sent again (a regenerated completion) resumes there."""
    if prompt_tokens >= RAW_CHECKPOINT_MIN:
        return CheckpointHints(turn_closure=prompt_tokens - 1)
    return CheckpointHints()


def cancelled_error() -> EngineError:
    return EngineError(503, "request_cancelled", "The request was cancelled before it completed.")


def unfinished_error() -> EngineError:
    return EngineError(500, "internal_error", "The engine ended the request without finishing it.",
                       type_="server_error")
