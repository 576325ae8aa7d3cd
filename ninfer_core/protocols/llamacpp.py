"""Built-in protocol plugin: llama.cpp's native completion, POST /completion (also /completions).

A raw prompt continues without a chat template (raw_prompt.py holds the checks both raw routes
share). The response is llama.cpp's object (content, tokens, stop, stop_type, stopping_word,
tokens_predicted, tokens_evaluated, tokens_cached, prompt, generation_settings, has_new_line,
truncated, id_slot, model, timings; completion_probabilities with n_probs), cut to
`response_fields` when the request names them. A stream sends one event per piece of content with
the running tokens_predicted (and that piece's completion_probabilities), then the full object with
an empty content, and no [DONE]. A batch of prompts answers an array of those objects, each with
its `index`, or streams their events interleaved (raw_batch.py).
"""

from __future__ import annotations

import logging
from contextlib import aclosing
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ninfer_core import hookimpl
from ninfer_core.engine.api import EngineEvent, TokenLogprob
from ninfer_core.protocols.llamacpp_objects import final_object, partial_object
from ninfer_core.protocols.raw_batch import ErrorFrame, RawBatch
from ninfer_core.protocols.raw_prompt import (
    RawCompletionFields,
    RawPlan,
    check_fields,
    settings_dict,
)
from ninfer_core.protocols.raw_submit import (
    RawSubmission,
    cancelled_error,
    submit_raw,
    unfinished_error,
)
from ninfer_core.server.context import ServerContext
from ninfer_core.server.errors import (
    bad_request,
    engine_error_body,
    internal_error,
    parse_json_body,
    parse_off_loop,
)
from ninfer_core.server.progress import StreamTimings
from ninfer_core.server.sse import (
    KEEPALIVE,
    ClientDisconnected,
    EventStreamResponse,
    sse_data,
    unless_disconnected,
    with_keepalive,
)

log = logging.getLogger("ninfer.server")


class LlamaCompletionRequest(RawCompletionFields):
    n_predict: int | None = None  # first; then max_tokens. Any negative value: no limit
    n_cmpl: int | None = None  # completions per prompt (llama.cpp also reads OpenAI's n)
    n: int | None = None
    return_tokens: bool | None = None
    return_progress: bool | None = None
    response_fields: list[str] | None = None


class LlamaPlan:
    def __init__(self, raw: RawPlan, req: LlamaCompletionRequest):
        self.raw = raw
        self.return_tokens = bool(req.return_tokens)
        self.return_progress = bool(req.return_progress)
        self.response_fields = req.response_fields
        self.n_probs = raw.n_probs
        self.post_sampling = raw.post_sampling_probs


def _piece(tokenizer: Any, token_id: int) -> dict:
    """llama.cpp's token entry: id, its text and bytes; special tokens write no text (the server's
    --special off), and bytes that end inside a UTF-8 sequence are left out of `token`."""
    raw = b"" if tokenizer.is_special(token_id) else tokenizer.token_bytes(token_id)
    return {"id": token_id, "token": raw.decode("utf-8", errors="ignore"), "bytes": list(raw)}


def probabilities_json(tokenizer: Any, records: list[TokenLogprob] | None, post_sampling: bool) -> list[dict]:
    """llama.cpp's completion_probabilities: per generated token its id, token, bytes, logprob and
    top_logprobs, or with post_sampling_probs its prob and top_probs (after top_k / top_p / min_p,
    possibly fewer than n_probs)."""
    out = []
    for r in records or ():
        if post_sampling:
            out.append({**_piece(tokenizer, r.token_id), "prob": r.post_prob,
                        "top_probs": [{**_piece(tokenizer, i), "prob": p} for i, p in r.post_top]})
        else:
            out.append({**_piece(tokenizer, r.token_id), "logprob": r.logprob,
                        "top_logprobs": [{**_piece(tokenizer, i), "logprob": lp} for i, lp in r.top]})
    return out


def validate_body(raw: bytes, ctx: ServerContext) -> LlamaPlan:
    data = parse_json_body(raw)
    if not isinstance(data, dict):
        raise bad_request("invalid_type", "The request body must be a JSON object.", None)
    req = LlamaCompletionRequest.model_validate(data)  # json_schema: raw_prompt.structured_format
    if req.n_predict is not None:
        limit, param = req.n_predict, "n_predict"
    else:
        limit, param = req.max_tokens, "max_tokens"
    for i, name in enumerate(req.response_fields or ()):
        if not name:
            raise bad_request("invalid_value", "response_fields names must be non-empty.",
                              f"response_fields.{i}")
    copies, copies_param = (req.n_cmpl, "n_cmpl") if req.n_cmpl is not None else (req.n, "n")
    if copies is not None and copies < 1:
        raise bad_request("invalid_value", f"{copies_param} must be at least 1.", copies_param)
    return LlamaPlan(check_fields(req, ctx, limit, negative_is_unlimited=True, limit_param=param,
                                  copies=copies or 1, copies_param=copies_param), req)


def select_fields(obj: dict, names: list[str] | None) -> dict:
    """llama.cpp's response_fields: keep the named fields; "a/b" names a nested field and is
    reported under that path. Names the response does not have are left out."""
    if not names:
        return obj
    out: dict = {}
    for name in names:
        node: Any = obj
        for part in name.split("/"):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            out[name] = node
    return out


class LlamaCompletion:
    """The protocol object: POST /completion and POST /completions."""

    name = "llamacpp"

    def mount(self, router: APIRouter, ctx: ServerContext) -> None:
        async def completion(request: Request) -> Response:
            return await self.handle(request, ctx)

        router.add_api_route("/completion", completion, methods=["POST"])
        router.add_api_route("/completions", completion, methods=["POST"])

    async def handle(self, request: Request, ctx: ServerContext) -> Response:
        raw = await request.body()
        plan = await parse_off_loop(raw, validate_body, ctx)
        logprobs = plan.n_probs or None
        if plan.raw.batch:
            return await self._batch(request, ctx, plan, logprobs)
        sub = await submit_raw(request, ctx, plan.raw, logprobs, progress=plan.return_progress and plan.raw.stream)
        if plan.raw.stream:
            return EventStreamResponse(self._stream(ctx, plan, sub), on_disconnect=sub.handle.cancel,
                                       on_close=sub.release)
        try:
            obj = await unless_disconnected(request, self._aggregate(ctx, plan, sub), sub.handle.cancel)
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            sub.release()
        return JSONResponse(select_fields(obj, plan.response_fields))

    async def _batch(self, request: Request, ctx: ServerContext, plan: LlamaPlan, logprobs: int | None) -> Response:
        """Several prompts: an array of result objects (each with its index), or one stream of them."""
        batch = RawBatch(request, ctx, plan.raw, logprobs)
        await batch.open()
        if plan.raw.stream:
            return EventStreamResponse(batch.merged(lambda sub: self._stream(ctx, plan, sub), ctx.keepalive_s),
                                       on_disconnect=batch.cancel, on_close=batch.release)
        try:
            objs = await unless_disconnected(
                request, batch.gather(lambda sub: self._aggregate(ctx, plan, sub)), batch.cancel)
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            batch.release()
        return JSONResponse([select_fields(obj, plan.response_fields) for obj in objs])

    def _final(self, ctx: ServerContext, plan: LlamaPlan, sub: RawSubmission, ev: EngineEvent, content: str,
               ids: list[int], probs: list | None = None) -> dict:
        obj = final_object(ctx, ev, index=sub.index, content=content, ids=ids, return_tokens=plan.return_tokens,
                           prompt_ids=sub.prompt_ids,
                           settings=settings_dict(ctx, plan.raw, sub.sampling, sub.n_predict))
        if probs is not None:  # aggregate only: a stream's chunks carried them
            obj["completion_probabilities"] = probabilities_json(ctx.tokenizer, probs, plan.post_sampling)
        return obj

    async def _aggregate(self, ctx: ServerContext, plan: LlamaPlan, sub: RawSubmission) -> dict:
        texts: list[str] = []
        ids: list[int] = []
        probs: list[TokenLogprob] | None = [] if plan.n_probs else None
        async for ev in sub.handle.events():
            if ev.kind == "delta":
                texts.append(ev.text)
                ids.extend(ev.token_ids)
                if probs is not None:
                    probs.extend(ev.logprobs or ())
            elif ev.kind == "error":
                raise ev.error
            elif ev.kind == "finish":
                if ev.finish_reason == "cancelled":
                    raise cancelled_error()
                return self._final(ctx, plan, sub, ev, "".join(texts), ids, probs)
        raise unfinished_error()

    async def _stream(self, ctx: ServerContext, plan: LlamaPlan, sub: RawSubmission) -> AsyncIterator[str]:
        live = StreamTimings(len(sub.prompt_ids))
        ids: list[int] = []
        total = len(sub.prompt_ids)
        progress_done = False

        def chunk(content: str, **extra: Any) -> str:
            obj = partial_object(index=sub.index, content=content, tokens_predicted=len(ids), tokens_evaluated=total)
            obj.update(extra)
            if plan.raw.timings_per_token:
                obj["timings"] = live.snapshot()
            return sse_data(select_fields(obj, plan.response_fields))

        def progress(final: bool = False) -> str:
            return chunk("", prompt_progress=live.progress(final))

        try:
            async with aclosing(with_keepalive(sub.handle.events(), ctx.keepalive_s)) as events:
                async for ev in events:
                    if ev is None:
                        yield KEEPALIVE
                    elif ev.kind == "admitted":
                        live.admitted(ev.usage.cached_tokens if ev.usage else 0)
                        if plan.return_progress:
                            yield progress()
                    elif ev.kind == "progress":  # a prefill unit committed (server/progress.py)
                        live.progressed((ev.progress or {}).get("processed", 0))
                        if plan.return_progress:
                            yield progress()
                    elif ev.kind == "delta":
                        if plan.return_progress and not progress_done:
                            progress_done = True
                            yield progress(final=True)
                        ids.extend(ev.token_ids)
                        live.tokens(len(ev.token_ids))
                        if plan.n_probs and ev.logprobs:
                            probs = probabilities_json(ctx.tokenizer, ev.logprobs, plan.post_sampling)
                            yield chunk(ev.text, completion_probabilities=probs)
                        elif ev.text:
                            yield chunk(ev.text)
                    elif ev.kind == "error":
                        yield ErrorFrame(sse_data(engine_error_body(ev.error)))
                        return
                    elif ev.kind == "finish":
                        if ev.finish_reason == "cancelled":
                            yield ErrorFrame(sse_data(engine_error_body(cancelled_error())))
                            return
                        if plan.return_progress and not progress_done:
                            yield progress(final=True)
                        final = self._final(ctx, plan, sub, ev, "", ids)
                        yield sse_data(select_fields(final, plan.response_fields))
                        return
        except Exception as e:  # noqa: BLE001 - headers are sent: the failure travels as an error event
            log.exception("completion stream failed")
            yield ErrorFrame(sse_data(engine_error_body(internal_error(e))))
            return
        yield ErrorFrame(sse_data(engine_error_body(unfinished_error())))


PROTOCOL = LlamaCompletion()


@hookimpl
def ninfer_register_protocols(register):
    register("llamacpp", "ninfer_core.protocols.llamacpp:PROTOCOL")
