"""Built-in protocol plugin: Anthropic Messages (POST /v1/messages, POST /v1/messages/count_tokens).

The adapter validates and lowers the request (anthropic_request), renders the prompt on a worker
thread, submits a GenerationRequest through the engine-client interface, reads the generated
text through the shared OutputDecoder (reasoning, text, tool calls) and writes Anthropic content
blocks, either as one Message or as the SSE block lifecycle. Errors on these routes use the
Anthropic envelope (server/errors.py) with `request_id` and a `request-id` header.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ninfer_core import hookimpl
from ninfer_core.engine.api import EngineError, EngineEvent, GenerationRequest
from ninfer_core.protocols.anthropic_context import apply_edits
from ninfer_core.protocols.anthropic_history import lower_conversation, omitted_signature, visible_signature
from ninfer_core.protocols.anthropic_request import MessagesPlan, parse_request
from ninfer_core.protocols.responses_items import MAX_BREAKPOINTS, breakpoint_markers
from ninfer_core.server.context import Ingress, ServerContext
from ninfer_core.server.errors import (
    anthropic_error_body,
    anthropic_status,
    internal_error,
    parse_json_body,
    parse_off_loop,
)
from ninfer_core.server.output import OutputDecoder, OutputEvent
from ninfer_core.server.prepare import (
    forced_call_ids,
    forced_call_opener,
    opens_reasoning,
    prompt_hints,
    render_prompt_ids,
    resolve_sampling,
    thinking_fields,
)
from ninfer_core.server.sse import (
    KEEPALIVE,
    ClientDisconnected,
    EventStreamResponse,
    unless_disconnected,
    with_keepalive,
)
from ninfer_core.structured.request import compile_request, make_constraint
from ninfer_core.tokenizer.chat_format import chat_format_of, turn_opener_id

PING = 'event: ping\ndata: {"type":"ping"}\n\n'
log = logging.getLogger("ninfer.server")


def sse_event(obj: dict) -> str:
    """One Anthropic SSE event: the `event:` name is the object's type."""
    return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class Prompt:
    ids: list[int]
    opens_reasoning: bool
    hints: Any = None  # CheckpointHints carrying the client's cache_control frontiers, when any
    # With context_management: {"applied_edits": [...]} for the response, and the unedited
    # prompt's token count for count_tokens' original_input_tokens.
    context_management: dict | None = None
    original_tokens: int | None = None
    chat_format: Any = None  # the model's ChatFormat (reasoning and tool-call markup)
    media: Any = None  # ninfer_core.media.api.MediaPrompt of the prompt's images


def prepare_prompt(ctx: ServerContext, plan: MessagesPlan) -> Prompt:
    """Render the lowered conversation to ids, after the request's context edits; a prefill or a
    forced call opener continues it.

    Host work: run it on a worker thread.
    """
    if plan.context_edits is None:
        return _render(ctx, plan)
    source = plan.source or {}

    def lowered(messages: list) -> MessagesPlan:
        msgs, prefill = lower_conversation({**source, "messages": messages}, plan.thinking, plan.thinking_explicit,
                                           vision=ctx.media is not None)
        return replace(plan, messages=msgs, prefill=prefill)

    edited, applied, original = apply_edits(plan.context_edits, source.get("messages") or [],
                                            lambda messages: len(_render(ctx, lowered(messages)).ids))
    prompt = _render(ctx, lowered(edited) if applied else plan)
    prompt.context_management = {"applied_edits": applied}
    prompt.original_tokens = original if original is not None else len(prompt.ids)
    return prompt


def _render(ctx: ServerContext, plan: MessagesPlan) -> Prompt:
    prepared = render_prompt_ids(ctx, plan.messages, plan.tools, plan.thinking, plan.template_kwargs)
    ids = list(prepared.ids)
    tok = ctx.tokenizer
    if plan.prefill:
        ids += tok.encode(plan.prefill, allow_special=False)  # caller text: never control tokens
    if plan.forced_tool:
        ids += forced_call_ids(tok, plan.forced_tool)
    return Prompt(ids, opens_reasoning(tok, ids), cache_hints(ctx, plan, ids), chat_format=chat_format_of(tok),
                  media=prepared.media)


def _compile(ctx: ServerContext, plan: MessagesPlan):
    """The compiled output_config.format, or a forced call's input schema (ninfer_core.structured)."""
    param = None
    if plan.forced_tool is not None:
        idx = next((i for i, t in enumerate(plan.tools or []) if t["function"]["name"] == plan.forced_tool), 0)
        param = f"tools.{idx}.input_schema"
    return compile_request(ctx, plan.response_format, tools=plan.tools, parallel=plan.parallel_tool_calls,
                           forced_tool=plan.forced_tool, tool_param=param)


def cache_hints(ctx: ServerContext, plan: MessagesPlan, ids: list[int]) -> Any:
    """cache_control breakpoints as exact prompt frontiers: the end of each hinted message (and of
    the tools block); the latest four are kept, beside the turn closure the request's
    preserve_thinking selects."""
    opener = turn_opener_id(ctx.tokenizer)
    markers = breakpoint_markers(ids, opener, plan.messages, bool(plan.tools))
    if plan.tools_cached and plan.tools and opener is not None:
        starts = [i for i, t in enumerate(ids) if t == opener]
        if len(starts) >= 2:  # the tools block is the first turn
            markers = sorted({starts[1], *markers})
    hints = prompt_hints(ctx, ids, plan.template_kwargs)
    hints.markers = markers[-MAX_BREAKPOINTS:]
    return hints


def usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    """Anthropic usage: input_tokens excludes the reused prefix, reported as cache reads."""
    return {"input_tokens": max(0, prompt_tokens - cached), "output_tokens": output_tokens,
            "cache_creation_input_tokens": None, "cache_read_input_tokens": cached}


def final_usage(ev: EngineEvent, prompt: Prompt) -> dict:
    """The cumulative usage of a finish event (the same in the aggregate and in message_delta)."""
    u = ev.usage
    if u is None:
        return usage(len(prompt.ids), 0, 0)
    return usage(u.prompt_tokens or len(prompt.ids), u.cached_tokens, u.completion_tokens)


def stop_reason(ev: EngineEvent, tool_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finish event."""
    if ev.finish_reason == "length":
        return ("model_context_window_exceeded" if ev.stop_reason == "context" else "max_tokens"), None
    if ev.stop_reason == "stop_string":
        return "stop_sequence", ev.matched_stop
    return ("tool_use" if tool_calls else "end_turn"), None


class BlockWriter:
    """Decoder events -> Anthropic content blocks, with the SSE events of their lifecycle.

    A text block opens only at non-whitespace text (Anthropic refuses whitespace-only text blocks
    when a client replays them); a Thinking block closes with its signature_delta. With display
    "omitted" a Thinking block has empty text, no thinking_delta, and the reasoning in its signature.
    """

    def __init__(self, omitted: bool):
        self.omitted = omitted
        self.blocks: list[dict] = []
        self._open: dict | None = None
        self._parts: list[str] = []  # the open thinking or text block's text so far
        self._ws = ""  # whitespace held until text that opens a block follows it
        self.tool_calls = 0

    def _start(self, block: dict, events: list[dict]) -> None:
        self.close(events)
        self._open = block
        self.blocks.append(block)
        start = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        events.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": start})

    def _delta(self, delta: dict, events: list[dict]) -> None:
        events.append({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})

    def close(self, events: list[dict]) -> None:
        block, self._open = self._open, None
        if block is None:
            return
        text, self._parts = "".join(self._parts), []
        if block["type"] == "thinking":
            sign = omitted_signature if self.omitted else visible_signature
            block["signature"] = sign(text)
            if not self.omitted:
                block["thinking"] = text
            self._delta({"type": "signature_delta", "signature": block["signature"]}, events)
        elif block["type"] == "text":
            block["text"] = text
        events.append({"type": "content_block_stop", "index": len(self.blocks) - 1})

    def feed(self, items: list[OutputEvent]) -> list[dict]:
        events: list[dict] = []
        for item in items:
            if item.kind == "reasoning" and item.text:
                if self._open is None or self._open["type"] != "thinking":
                    self._start({"type": "thinking", "thinking": "", "signature": ""}, events)
                self._parts.append(item.text)
                if not self.omitted:
                    self._delta({"type": "thinking_delta", "thinking": item.text}, events)
            elif item.kind == "content" and item.text:
                text = item.text
                if self._open is None or self._open["type"] != "text":
                    text, self._ws = self._ws + text, ""
                    if not text.strip():
                        self._ws = text
                        continue
                    self._start({"type": "text", "text": ""}, events)
                self._parts.append(text)
                self._delta({"type": "text_delta", "text": text}, events)
            elif item.kind == "tool_call" and item.tool_call is not None:
                call = item.tool_call
                try:
                    args = json.loads(call.arguments) if call.arguments.strip() else {}
                except json.JSONDecodeError:
                    args = None
                partial = call.arguments  # the decoder's JSON text: member order as generated
                if not isinstance(args, dict):  # not an object: nothing a client could replay
                    args, partial = {}, "{}"
                self._start({"type": "tool_use", "id": call.id, "name": call.name, "input": args}, events)
                self._delta({"type": "input_json_delta", "partial_json": partial}, events)
                self.close(events)
                self.tool_calls += 1
        return events


def _cancelled_error() -> EngineError:
    return EngineError(503, "request_cancelled", "The request was cancelled before it completed.")


def _internal_error(why: str) -> EngineError:
    return EngineError(500, "internal_error", why, type_="server_error")


class AnthropicMessages:
    """The protocol object the host mounts: `mount(router, ctx)` adds the two Messages routes."""

    name = "anthropic"

    def mount(self, router: APIRouter, ctx: ServerContext) -> None:
        eng = ctx.options.engine
        # Token counts have their own capacity of the generation size (spec: Execution behavior).
        counts = Ingress(eng.max_concurrency + eng.max_pending_requests)

        async def messages(request: Request) -> Response:
            return await self.handle(request, ctx)

        async def count_tokens(request: Request) -> Response:
            return await self.count(request, ctx, counts)

        count_tokens.ingress = counts  # reachable from the app's routes (tests, diagnostics)
        router.add_api_route("/v1/messages", messages, methods=["POST"])
        router.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"])

    @staticmethod
    async def _plan(request: Request, ctx: ServerContext, count_only: bool) -> MessagesPlan:
        raw = await request.body()

        def parse(body: bytes) -> MessagesPlan:
            return parse_request(parse_json_body(body), ctx, count_only)

        return await parse_off_loop(raw, parse)

    async def count(self, request: Request, ctx: ServerContext, counts: Ingress) -> Response:
        plan = await self._plan(request, ctx, count_only=True)
        counts.acquire()
        try:
            prompt = await anyio.to_thread.run_sync(prepare_prompt, ctx, plan)
        finally:
            counts.release()
        body: dict[str, Any] = {"input_tokens": len(prompt.ids)}
        if prompt.context_management is not None:
            body["context_management"] = {"original_input_tokens": prompt.original_tokens}
        return JSONResponse(body)

    async def handle(self, request: Request, ctx: ServerContext) -> Response:
        deadline = time.monotonic() + ctx.options.engine.pending_timeout_ms / 1000.0
        request_id = request.scope.get("state", {}).get("request_id", "")
        plan = await self._plan(request, ctx, count_only=False)
        compiled = await anyio.to_thread.run_sync(_compile, ctx, plan)  # structured output: 400s here
        release = ctx.ingress.acquire()

        try:
            prompt = await anyio.to_thread.run_sync(prepare_prompt, ctx, plan)
            sampling = resolve_sampling(ctx, plan.thinking, plan.sampling_request, None)
            gen = GenerationRequest(prompt_ids=prompt.ids, sampling=sampling, max_tokens=plan.max_tokens, media=prompt.media,
                                    stop=plan.stop, request_id=request_id, deadline=deadline,
                                    checkpoint_hints=prompt.hints,
                                    constraint=make_constraint(ctx, compiled, prompt.opens_reasoning),
                                    **thinking_fields(ctx, prompt, plan.thinking_budget, plan.post_thinking,
                                                      sampling))
            handle = ctx.engine.submit(gen)
        except BaseException:
            release()
            raise
        mid = "msg_" + uuid.uuid4().hex[:24]
        if plan.stream:
            try:
                events = await self._first_event(request, ctx, handle)
            except ClientDisconnected:
                release()
                return Response(status_code=499)
            except BaseException:
                release()
                raise
            body = self._stream(ctx, events, plan, prompt, mid, request_id)
            return EventStreamResponse(body, on_disconnect=handle.cancel, on_close=release)
        try:
            result = await unless_disconnected(request, self._aggregate(handle, plan, prompt, mid),
                                               handle.cancel)
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            release()
        return JSONResponse(result)

    @staticmethod
    async def _first_event(request: Request, ctx: ServerContext, handle) -> AsyncIterator[EngineEvent]:
        """The handle's events, once the first arrived or a keep-alive interval passed.

        Holding the response headers back until then lets a failure before admission (a queue
        timeout, an engine error) answer with its own HTTP status; a request still queued after the
        interval starts its stream, whose keep-alive comments and pings then show it is alive.
        """
        events = handle.events().__aiter__()
        pending = asyncio.ensure_future(events.__anext__())
        try:
            await unless_disconnected(request, asyncio.wait({pending}, timeout=ctx.keepalive_s),
                                      handle.cancel)
        except BaseException:
            pending.cancel()
            raise
        if pending.done() and not pending.cancelled() and pending.exception() is None:
            ev = pending.result()
            if ev.kind == "error":
                raise ev.error
            if ev.kind == "finish" and ev.finish_reason == "cancelled":
                raise _cancelled_error()

        async def chained() -> AsyncIterator[EngineEvent]:
            try:
                first = await pending
            except StopAsyncIteration:
                return
            yield first
            async for ev in events:
                yield ev

        return chained()

    @staticmethod
    def _decoder(plan: MessagesPlan, prompt: Prompt) -> OutputDecoder:
        fmt = prompt.chat_format
        opener = None
        if plan.forced_tool:
            opener = (fmt.tools.forced_opener(plan.forced_tool) if fmt is not None and fmt.tools is not None
                      else forced_call_opener(plan.forced_tool))
        return OutputDecoder(in_reasoning=prompt.opens_reasoning, tools=plan.tools,
                             parallel_tool_calls=plan.parallel_tool_calls, id_prefix="toolu_",
                             forced_call=opener, chat_format=fmt)

    async def _aggregate(self, handle, plan: MessagesPlan, prompt: Prompt, mid: str) -> dict:
        decoder = self._decoder(plan, prompt)
        writer = BlockWriter(plan.display_omitted)
        async for ev in handle.events():
            if ev.kind == "delta":
                writer.feed(decoder.feed(ev.text))
            elif ev.kind == "error":
                raise ev.error
            elif ev.kind == "finish":
                if ev.finish_reason == "cancelled":
                    raise _cancelled_error()
                writer.feed(decoder.finish())
                writer.close([])
                reason, sequence = stop_reason(ev, writer.tool_calls > 0)
                message = {"id": mid, "type": "message", "role": "assistant", "model": plan.model,
                           "content": writer.blocks, "stop_reason": reason, "stop_sequence": sequence,
                           "usage": final_usage(ev, prompt)}
                if prompt.context_management is not None:
                    message["context_management"] = prompt.context_management
                return message
        raise _internal_error("The engine ended the request without finishing it.")

    async def _stream(self, ctx: ServerContext, engine_events: AsyncIterator[EngineEvent], plan: MessagesPlan,
                      prompt: Prompt, mid: str, request_id: str) -> AsyncIterator[str]:
        decoder = self._decoder(plan, prompt)
        writer = BlockWriter(plan.display_omitted)
        started = False

        def error_event(err: EngineError) -> str:
            status = anthropic_status(err.status, err.code)
            return sse_event(anthropic_error_body(status, err.message, request_id, err.code, err.param))

        def message_start(ev: EngineEvent) -> str:
            u = ev.usage
            prompt_tokens = u.prompt_tokens if u and u.prompt_tokens else len(prompt.ids)
            return sse_event({"type": "message_start", "message": {
                "id": mid, "type": "message", "role": "assistant", "model": plan.model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": usage(prompt_tokens, u.cached_tokens if u else 0, 0)}})

        try:
            async with aclosing(with_keepalive(engine_events, ctx.keepalive_s)) as events:
                async for ev in events:
                    if ev is None:
                        yield KEEPALIVE + PING  # clients skip ping; it shows a queued request is alive
                        continue
                    if ev.kind == "error":
                        yield error_event(ev.error)
                        return
                    if ev.kind == "finish" and ev.finish_reason == "cancelled":
                        yield error_event(_cancelled_error())
                        return
                    if not started:  # message_start follows admission (its usage split is then exact)
                        started = True
                        yield message_start(ev)
                    if ev.kind == "delta":
                        for obj in writer.feed(decoder.feed(ev.text)):
                            yield sse_event(obj)
                    elif ev.kind == "finish":
                        tail = writer.feed(decoder.finish())
                        writer.close(tail)
                        for obj in tail:
                            yield sse_event(obj)
                        reason, sequence = stop_reason(ev, writer.tool_calls > 0)
                        delta = {"type": "message_delta",
                                 "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                 "usage": final_usage(ev, prompt)}
                        if prompt.context_management is not None:
                            delta["context_management"] = prompt.context_management
                        yield sse_event(delta)
                        yield sse_event({"type": "message_stop"})
                        return
        except Exception as e:  # noqa: BLE001 - headers are sent: the failure travels as an error event
            log.exception("messages stream failed")
            yield error_event(internal_error(e))
            return
        yield error_event(_internal_error("The engine ended the request without finishing it."))


PROTOCOL = AnthropicMessages()


@hookimpl
def ninfer_register_protocols(register):
    register("anthropic", "ninfer_core.protocols.anthropic:PROTOCOL")
