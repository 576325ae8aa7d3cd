"""Built-in protocol plugin: OpenAI's legacy Completions, POST /v1/completions.

A raw prompt continues without a chat template (raw_prompt.py holds the checks shared with
llama.cpp's /completion). The response is a text_completion object with usage and llama.cpp's
timings; echo puts the prompt text before the completion (and opens a stream with it). n makes n
completions of each prompt (llama.cpp's n_cmpl), best_of is served only at 1; a non-empty suffix
(fill-in-the-middle) is refused. logprobs k > 0 returns the legacy logprobs object for the
generated tokens (an extension of the spec, which accepts only 0: the engine now computes them);
the prompt's own log probabilities (echo with logprobs) are not available and refused.
A stream ends with the finish chunk, the usage chunk when stream_options.include_usage asks, and
[DONE]. llama.cpp's n_probs stands for logprobs when logprobs is absent; `verbose: true` adds the
llama.cpp object as `__verbose` (llamacpp_objects.py). A batch of prompts answers one choice per
prompt (their `index`), usage summed; streamed, their chunks interleave before one usage chunk and
[DONE].
"""

from __future__ import annotations

import codecs
import logging
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from ninfer_core import hookimpl
from ninfer_core.engine.api import EngineEvent
from ninfer_core.protocols.llamacpp_objects import final_object, partial_object
from ninfer_core.protocols.raw_batch import ErrorFrame, RawBatch
from ninfer_core.protocols.raw_prompt import (
    RawCompletionFields,
    RawPlan,
    WireModel,
    check_fields,
    settings_dict,
)
from ninfer_core.protocols.raw_submit import (
    RawSubmission,
    cancelled_error,
    submit_raw,
    unfinished_error,
)
from ninfer_core.server.progress import StreamTimings
from ninfer_core.server.context import ServerContext
from ninfer_core.server.errors import (
    bad_request,
    engine_error_body,
    internal_error,
    parse_json_body,
    parse_off_loop,
)
from ninfer_core.server.sse import (
    DONE,
    KEEPALIVE,
    ClientDisconnected,
    EventStreamResponse,
    sse_data,
    unless_disconnected,
    with_keepalive,
)

log = logging.getLogger("ninfer.server")

MAX_LOGPROBS = 20  # the sampler's candidate domain (OpenAI's own API stops at 5)


class StreamOptions(WireModel):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class CompletionRequest(RawCompletionFields):
    max_tokens: int | None = Field(None, ge=-1)  # -1: no limit
    echo: bool | None = None
    n: int | None = None
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionPlan:
    def __init__(self, raw: RawPlan, req: CompletionRequest):
        self.raw = raw
        self.echo = bool(req.echo)
        # 0 (or null) gathers nothing; k > 0: each generated token's logprob and its k alternatives.
        # llama.cpp reads n_probs first and logprobs only when n_probs is absent; OpenAI clients send
        # logprobs, so here logprobs wins and n_probs fills in for it.
        k = req.logprobs if req.logprobs is not None else raw.n_probs
        self.logprobs = k if k else None
        self.include_usage = bool(raw.stream and req.stream_options and req.stream_options.include_usage)
        self.verbose = req.verbose is True


def _only_one(value: int | None, name: str, what: str) -> None:
    if value is None or value == 1:
        return
    if value > 1:
        raise bad_request(f"{name}_not_supported", f"Only {name}=1 is supported: {what}.", name)
    raise bad_request("invalid_value", f"{name} must be 1.", name)


def validate_body(raw: bytes, ctx: ServerContext) -> CompletionPlan:
    data = parse_json_body(raw)
    if not isinstance(data, dict):
        raise bad_request("invalid_type", "The request body must be a JSON object.", None)
    req = CompletionRequest.model_validate(data)
    if req.n is not None and req.n < 1:
        raise bad_request("invalid_value", "n must be at least 1.", "n")
    _only_one(req.best_of, "best_of", "one candidate is generated per request")
    if req.logprobs is not None:
        if not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise bad_request("invalid_value", f"logprobs must be between 0 and {MAX_LOGPROBS}.", "logprobs")
    if req.suffix:
        raise bad_request("suffix_not_supported", "A suffix (fill-in-the-middle) is not supported: the "
                          "prompt is continued at its end only.", "suffix")
    plan = CompletionPlan(check_fields(req, ctx, req.max_tokens, negative_is_unlimited=False,
                                       limit_param="max_tokens", copies=req.n or 1, copies_param="n"), req)
    if plan.logprobs and req.echo:
        raise bad_request("logprobs_not_supported", "Log probabilities of the prompt (echo with "
                          "logprobs) are not available: only generated tokens have them.", "echo")
    return plan


def sum_usage(usages: list[dict]) -> dict:
    """One request's usage over the choices of a batch."""
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    out = {k: sum(u[k] for u in usages) for k in keys}
    out["prompt_tokens_details"] = {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)}
    return out


def usage_dict(ev: EngineEvent) -> dict:
    u = ev.usage
    prompt = u.prompt_tokens if u else 0
    completion = u.completion_tokens if u else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens if u else 0}}


class LegacyLogprobs:
    """OpenAI's legacy logprobs object over the engine's records of generated tokens:
    {"tokens", "token_logprobs", "top_logprobs" ({token: logprob}), "text_offset"}.

    text_offset counts characters of the returned text (a token whose bytes end inside a UTF-8
    sequence adds none until the character completes; special tokens write no text)."""

    def __init__(self, tokenizer: Any, start: int = 0):
        self._tok = tokenizer
        self._chars = start
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _text(self, token_id: int) -> str:
        return self._tok.token_bytes(token_id).decode("utf-8", errors="replace")

    def take(self, records: list | None) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for r in records or ():
            out["tokens"].append(self._text(r.token_id))
            out["token_logprobs"].append(r.logprob)
            out["top_logprobs"].append({self._text(i): lp for i, lp in r.top})
            out["text_offset"].append(self._chars)
            if not self._tok.is_special(r.token_id):
                self._chars += len(self._utf8.decode(self._tok.token_bytes(r.token_id)))
        return out


def merge_logprobs(parts: list[dict]) -> dict:
    return {key: [v for p in parts for v in p[key]] for key in
            ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


class Completions:
    """The protocol object: POST /v1/completions."""

    name = "openai_completions"

    def mount(self, router: APIRouter, ctx: ServerContext) -> None:
        async def completions(request: Request) -> Response:
            return await self.handle(request, ctx)

        router.add_api_route("/v1/completions", completions, methods=["POST"])

    async def handle(self, request: Request, ctx: ServerContext) -> Response:
        raw = await request.body()
        plan = await parse_off_loop(raw, validate_body, ctx)
        cid = "cmpl-" + uuid.uuid4().hex
        created = int(time.time())
        if plan.raw.batch:
            return await self._batch(request, ctx, plan, cid, created)
        sub = await submit_raw(request, ctx, plan.raw, plan.logprobs)
        if plan.raw.stream:
            return EventStreamResponse(self._stream(ctx, plan, sub, cid, created),
                                       on_disconnect=sub.handle.cancel, on_close=sub.release)
        try:
            obj = await unless_disconnected(request, self._aggregate(ctx, plan, sub, cid, created),
                                            sub.handle.cancel)
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            sub.release()
        return JSONResponse(obj)

    async def _batch(self, request: Request, ctx: ServerContext, plan: CompletionPlan, cid: str,
                     created: int) -> Response:
        """Several prompts: one choice each (`index` = the prompt's place), usage summed; timings are
        per prompt, so only `__verbose` (one object per prompt) carries them."""
        batch = RawBatch(request, ctx, plan.raw, plan.logprobs)
        await batch.open()
        if plan.raw.stream:
            return EventStreamResponse(self._batch_stream(ctx, plan, batch, cid, created),
                                       on_disconnect=batch.cancel, on_close=batch.release)
        try:
            objs = await unless_disconnected(
                request, batch.gather(lambda sub: self._aggregate(ctx, plan, sub, cid, created)), batch.cancel)
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            batch.release()
        out = {"id": cid, "object": "text_completion", "created": created, "model": ctx.model.id,
               "choices": [o["choices"][0] for o in objs], "usage": sum_usage([o["usage"] for o in objs])}
        if plan.verbose:
            out["__verbose"] = [o["__verbose"] for o in objs]
        return JSONResponse(out)

    async def _batch_stream(self, ctx: ServerContext, plan: CompletionPlan, batch: RawBatch, cid: str,
                            created: int) -> AsyncIterator[str]:
        usage: dict[int, dict] = {}
        failed = False
        frames = batch.merged(lambda sub: self._stream(ctx, plan, sub, cid, created, usage), ctx.keepalive_s)
        async with aclosing(frames) as merged:
            async for frame in merged:
                failed = isinstance(frame, ErrorFrame)
                yield frame
        if failed:
            return
        if plan.include_usage:
            yield sse_data({"id": cid, "object": "text_completion", "created": created, "model": ctx.model.id,
                            "choices": [], "usage": sum_usage([usage[i] for i in sorted(usage)])})
        yield DONE

    def _verbose(self, ctx: ServerContext, sub: RawSubmission, ev: EngineEvent, plan: CompletionPlan,
                 content: str, ids: list[int]) -> dict:
        return final_object(ctx, ev, index=sub.index, content=content, ids=ids, return_tokens=False,
                            prompt_ids=sub.prompt_ids, settings=settings_dict(ctx, plan.raw, sub.sampling,
                                                                              sub.n_predict))

    def _echo(self, ctx: ServerContext, plan: CompletionPlan, sub: RawSubmission) -> str:
        return ctx.tokenizer.decode(sub.prompt_ids, skip_special=False) if plan.echo else ""

    async def _aggregate(self, ctx: ServerContext, plan: CompletionPlan, sub: RawSubmission, cid: str,
                         created: int) -> dict:
        texts = [self._echo(ctx, plan, sub)]
        lp = LegacyLogprobs(ctx.tokenizer, len(texts[0])) if plan.logprobs else None
        parts: list[dict] = []
        ids: list[int] = []
        async for ev in sub.handle.events():
            if ev.kind == "delta":
                texts.append(ev.text)
                ids.extend(ev.token_ids)
                if lp is not None:
                    parts.append(lp.take(ev.logprobs))
            elif ev.kind == "error":
                raise ev.error
            elif ev.kind == "finish":
                if ev.finish_reason == "cancelled":
                    raise cancelled_error()
                obj = {"id": cid, "object": "text_completion", "created": created, "model": ctx.model.id,
                       "choices": [{"index": sub.index, "text": "".join(texts),
                                    "logprobs": merge_logprobs(parts) if lp is not None else None,
                                    "finish_reason": ev.finish_reason}],
                       "usage": usage_dict(ev), "timings": ev.timings or {}}
                if plan.verbose:
                    obj["__verbose"] = self._verbose(ctx, sub, ev, plan, "".join(texts[1:]), ids)
                return obj
        raise unfinished_error()

    async def _stream(self, ctx: ServerContext, plan: CompletionPlan, sub: RawSubmission, cid: str,
                      created: int, batch_usage: dict | None = None) -> AsyncIterator[str]:
        """One prompt's chunks; in a batch (`batch_usage` collects each prompt's usage) the usage
        chunk and [DONE] are the batch's, written after every prompt's chunks."""
        model_id = ctx.model.id
        lp = LegacyLogprobs(ctx.tokenizer) if plan.logprobs else None
        live = StreamTimings(len(sub.prompt_ids)) if plan.raw.timings_per_token else None
        n_out = 0

        def chunk(text: str, finish: str | None = None, logprobs: dict | None = None, **extra: Any) -> str:
            obj = {"id": cid, "object": "text_completion", "created": created, "model": model_id,
                   "choices": [{"index": sub.index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
            if plan.include_usage:
                obj["usage"] = None
            obj.update(extra)
            return sse_data(obj)

        if plan.echo:
            yield chunk(self._echo(ctx, plan, sub))
        try:
            async with aclosing(with_keepalive(sub.handle.events(), ctx.keepalive_s)) as events:
                async for ev in events:
                    if ev is None:
                        yield KEEPALIVE
                    elif ev.kind == "admitted":
                        if live is not None:
                            live.admitted(ev.usage.cached_tokens if ev.usage else 0)
                    elif ev.kind == "delta":
                        records = lp.take(ev.logprobs) if lp is not None else None
                        n_out += len(ev.token_ids)
                        extra = {}
                        if plan.verbose:
                            extra["__verbose"] = partial_object(index=sub.index, content=ev.text, tokens_predicted=n_out,
                                                                tokens_evaluated=len(sub.prompt_ids))
                        if live is not None:
                            live.tokens(len(ev.token_ids))
                            extra["timings"] = live.snapshot()
                        if ev.text or (records and records["tokens"]):
                            yield chunk(ev.text, logprobs=records, **extra)
                    elif ev.kind == "error":
                        yield ErrorFrame(sse_data(engine_error_body(ev.error)))
                        return
                    elif ev.kind == "finish":
                        if ev.finish_reason == "cancelled":
                            yield ErrorFrame(sse_data(engine_error_body(cancelled_error())))
                            return
                        timings = ev.timings or {}
                        verbose = {"__verbose": self._verbose(ctx, sub, ev, plan, "", [])} if plan.verbose else {}
                        if batch_usage is not None:
                            batch_usage[sub.index] = usage_dict(ev)
                            yield chunk("", ev.finish_reason, timings=timings, **verbose)
                            return
                        if plan.include_usage:
                            yield chunk("", ev.finish_reason, **verbose)
                            yield sse_data({"id": cid, "object": "text_completion", "created": created,
                                            "model": model_id, "choices": [], "usage": usage_dict(ev),
                                            "timings": timings})
                        else:
                            yield chunk("", ev.finish_reason, timings=timings, **verbose)
                        yield DONE
                        return
        except Exception as e:  # noqa: BLE001 - headers are sent: the failure travels as an error event
            log.exception("completions stream failed")
            yield ErrorFrame(sse_data(engine_error_body(internal_error(e))))
            return
        yield ErrorFrame(sse_data(engine_error_body(unfinished_error())))


PROTOCOL = Completions()


@hookimpl
def ninfer_register_protocols(register):
    register("openai_completions", "ninfer_core.protocols.openai_completions:PROTOCOL")
