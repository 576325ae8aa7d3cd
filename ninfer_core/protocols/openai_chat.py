"""Built-in protocol plugin: OpenAI Chat Completions (POST /v1/chat/completions).

The adapter validates the request (openai_models + openai_chat_request), renders the prompt on a
worker thread, submits a GenerationRequest through the engine-client interface and turns engine
events into a chat.completion object or an SSE stream. Tool definitions are rendered into the
prompt; parsing generated tool calls back into `tool_calls` arrives with a later issue, so until
then a call the model writes is returned as content text.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ninfer_core import hookimpl
from ninfer_core.engine.api import EngineError, EngineEvent, GenerationRequest
from ninfer_core.protocols.openai_chat_request import ChatPlan, validate_body
from ninfer_core.server.context import ServerContext
from ninfer_core.server.errors import engine_error_body
from ninfer_core.server.prepare import (
    PreparedPrompt,
    ReasoningTokenCounter,
    derived_output_limit,
    render_prompt_ids,
    resolve_sampling,
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

_LARGE_BODY = 256 * 1024
log = logging.getLogger("ninfer.server")


def usage_dict(event: EngineEvent, reasoning_tokens: int) -> dict:
    u = event.usage
    prompt = u.prompt_tokens if u else 0
    completion = u.completion_tokens if u else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens if u else 0},
            "completion_tokens_details": {"reasoning_tokens": min(reasoning_tokens, completion)}}


def _cancelled_error() -> EngineError:
    return EngineError(503, "request_cancelled", "The request was cancelled before it completed.")


class ChatCompletions:
    """The protocol object the host mounts: `mount(router, ctx)` adds POST /v1/chat/completions."""

    name = "openai_chat"

    def mount(self, router: APIRouter, ctx: ServerContext) -> None:
        async def chat_completions(request: Request) -> Response:
            return await self.handle(request, ctx)

        router.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])

    async def handle(self, request: Request, ctx: ServerContext) -> Response:
        deadline = time.monotonic() + ctx.options.engine.pending_timeout_ms / 1000.0
        raw = await request.body()
        if len(raw) > _LARGE_BODY:  # parsing a large body is host work: keep it off the event loop
            plan = await anyio.to_thread.run_sync(validate_body, raw, ctx)
        else:
            plan = validate_body(raw, ctx)

        ctx.ingress.acquire()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                ctx.ingress.release()

        try:
            prompt: PreparedPrompt = await anyio.to_thread.run_sync(
                render_prompt_ids, ctx, plan.messages, plan.tools, plan.thinking, plan.template_kwargs)
            sampling = resolve_sampling(ctx, plan.thinking, plan.sampling_request, plan.seed)
            max_tokens = plan.max_tokens
            if plan.derived_limit:
                max_tokens = derived_output_limit(ctx, len(prompt.ids))
            gen = GenerationRequest(prompt_ids=prompt.ids, sampling=sampling, max_tokens=max_tokens,
                                    stop=plan.stop, ignore_eos=plan.ignore_eos,
                                    request_id=request.scope.get("state", {}).get("request_id", ""),
                                    deadline=deadline)
            handle = ctx.engine.submit(gen)
        except BaseException:
            release()
            raise
        cid = "chatcmpl-" + uuid.uuid4().hex
        created = int(time.time())
        model_id = ctx.model.id
        if plan.stream:
            body = self._stream(ctx, handle, plan, prompt, cid, created, model_id)
            return EventStreamResponse(body, on_disconnect=handle.cancel, on_close=release)
        try:
            result = await unless_disconnected(
                request, self._aggregate(ctx, handle, prompt, cid, created, model_id), handle.cancel)
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            release()
        return JSONResponse(result)

    async def _aggregate(self, ctx: ServerContext, handle, prompt: PreparedPrompt, cid: str, created: int,
                         model_id: str) -> dict:
        from ninfer_core.tokenizer.reasoning import ReasoningSplitter

        splitter = ReasoningSplitter(prompt.opens_reasoning)
        counter = ReasoningTokenCounter(ctx.tokenizer, prompt.opens_reasoning)
        parts = {"reasoning": [], "content": []}
        async for ev in handle.events():
            if ev.kind == "delta":
                counter.feed(ev.token_ids)
                for kind, text in splitter.feed(ev.text):
                    parts[kind].append(text)
            elif ev.kind == "error":
                raise ev.error
            elif ev.kind == "finish":
                if ev.finish_reason == "cancelled":
                    raise _cancelled_error()
                for kind, text in splitter.finish():
                    parts[kind].append(text)
                reasoning = "".join(parts["reasoning"])
                message = {"role": "assistant", "content": "".join(parts["content"]),
                           "reasoning_content": reasoning if (reasoning or prompt.opens_reasoning) else None,
                           "refusal": None}
                out = {"id": cid, "object": "chat.completion", "created": created, "model": model_id,
                       "choices": [{"index": 0, "message": message, "logprobs": None,
                                    "finish_reason": ev.finish_reason}],
                       "usage": usage_dict(ev, counter.count)}
                out["timings"] = ev.timings or {}
                return out
        raise EngineError(500, "internal_error", "The engine ended the request without finishing it.",
                          type_="server_error")

    async def _stream(self, ctx: ServerContext, handle, plan: ChatPlan, prompt: PreparedPrompt, cid: str,
                      created: int, model_id: str) -> AsyncIterator[str]:
        from ninfer_core.tokenizer.reasoning import ReasoningSplitter

        splitter = ReasoningSplitter(prompt.opens_reasoning)
        counter = ReasoningTokenCounter(ctx.tokenizer, prompt.opens_reasoning)
        include_usage = plan.include_usage

        def chunk(delta: dict, finish: str | None = None, **extra) -> str:
            obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_id,
                   "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
            if include_usage:
                obj["usage"] = None
            obj.update(extra)
            return sse_data(obj)

        def deltas(pieces: list[tuple[str, str]]) -> list[str]:
            out: list[str] = []
            merged: list[list] = []
            for kind, text in pieces:
                if not text:
                    continue
                if merged and merged[-1][0] == kind:
                    merged[-1][1] += text
                else:
                    merged.append([kind, text])
            for kind, text in merged:
                out.append(chunk({"reasoning_content": text} if kind == "reasoning" else {"content": text}))
            return out

        yield chunk({"role": "assistant", "content": ""})
        try:
            async with aclosing(with_keepalive(handle.events(), ctx.keepalive_s)) as events:
                async for ev in events:
                    if ev is None:
                        yield KEEPALIVE
                    elif ev.kind == "delta":
                        counter.feed(ev.token_ids)
                        for c in deltas(splitter.feed(ev.text)):
                            yield c
                    elif ev.kind == "error":
                        yield sse_data(engine_error_body(ev.error))
                        return
                    elif ev.kind == "finish":
                        if ev.finish_reason == "cancelled":
                            yield sse_data(engine_error_body(_cancelled_error()))
                            return
                        for c in deltas(splitter.finish()):
                            yield c
                        timings = ev.timings or {}
                        if include_usage:
                            yield chunk({}, ev.finish_reason)
                            choices = []
                            if ctx.options.usage_chunk_choice:
                                choices = [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}]
                            yield sse_data({"id": cid, "object": "chat.completion.chunk", "created": created,
                                            "model": model_id, "choices": choices,
                                            "usage": usage_dict(ev, counter.count), "timings": timings})
                        else:
                            yield chunk({}, ev.finish_reason, timings=timings)
                        yield DONE
                        return
        except Exception as e:  # noqa: BLE001 - headers are sent: the failure travels as an error event
            log.exception("chat stream failed")
            yield sse_data(engine_error_body(EngineError(
                500, "internal_error", f"Internal server error: {type(e).__name__}", type_="server_error")))
            return
        yield sse_data(engine_error_body(EngineError(
            500, "internal_error", "The engine ended the request without finishing it.", type_="server_error")))


PROTOCOL = ChatCompletions()


@hookimpl
def ninfer_register_protocols(register):
    register("openai_chat", "ninfer_core.protocols.openai_chat:PROTOCOL")
