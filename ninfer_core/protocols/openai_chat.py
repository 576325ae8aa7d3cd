"""Built-in protocol plugin: OpenAI Chat Completions (POST /v1/chat/completions).

The adapter validates the request (openai_models + openai_chat_request), renders the prompt on a
worker thread, submits a GenerationRequest through the engine-client interface and turns engine
events into a chat.completion object or an SSE stream. Generated text goes through the shared
OutputDecoder (reasoning_content, content, tool_calls); log probabilities through LogprobChannel.
A forced tool call (tool_choice naming a tool) ends the prompt with that call's opener.
"""

from __future__ import annotations

import json
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
from ninfer_core.protocols.llamacpp_objects import VerboseRecord
from ninfer_core.protocols.openai_chat_request import ChatPlan, validate_body
from ninfer_core.protocols.raw_prompt import generation_settings
from ninfer_core.protocols.tokenize_routes import chat_input_tokens
from ninfer_core.server.context import Ingress, ServerContext
from ninfer_core.server.errors import engine_error_body, internal_error, parse_off_loop
from ninfer_core.tokenizer.chat_format import chat_format_of
from ninfer_core.server.output import LogprobChannel, OutputDecoder, OutputEvent, ToolCall, logprob_json
from ninfer_core.server.progress import StreamTimings
from ninfer_core.server.prepare import (
    PreparedPrompt,
    ReasoningTokenCounter,
    derived_output_limit,
    forced_call_ids,
    forced_call_opener,
    prompt_hints,
    render_prompt_ids,
    resolve_sampling,
    thinking_fields,
)
from ninfer_core.server.sse import (
    DONE,
    KEEPALIVE,
    ClientDisconnected,
    EventStreamResponse,
    event_batches,
    json_text,
    sse_data,
    unless_disconnected,
)
from ninfer_core.structured.request import compile_request, make_constraint

log = logging.getLogger("ninfer.server")


def usage_dict(event: EngineEvent, reasoning_tokens: int) -> dict:
    u = event.usage
    prompt = u.prompt_tokens if u else 0
    completion = u.completion_tokens if u else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens if u else 0},
            "completion_tokens_details": {"reasoning_tokens": min(reasoning_tokens, completion)}}


def retained_session(event: EngineEvent) -> dict:
    """id_slot and session_digest of the context-cache slot a finished session was retained under."""
    ctx = getattr(event, "context", None) or {}
    if ctx.get("id_slot") is None:
        return {}
    return {"id_slot": ctx["id_slot"], "session_digest": ctx["session_digest"]}


def _cancelled_error() -> EngineError:
    return EngineError(503, "request_cancelled", "The request was cancelled before it completed.")


class ChatCompletions:
    """The protocol object the host mounts: `mount(router, ctx)` adds POST /v1/chat/completions (also
    /chat/completions) and the prompt-token count /v1/chat/completions/input_tokens."""

    name = "openai_chat"

    def mount(self, router: APIRouter, ctx: ServerContext) -> None:
        eng = ctx.options.engine
        counts = Ingress(eng.max_concurrency + eng.max_pending_requests)  # token counts: a capacity of their own

        async def chat_completions(request: Request) -> Response:
            return await self.handle(request, ctx)

        async def input_tokens(request: Request) -> Response:
            raw = await request.body()
            release = counts.acquire()
            try:
                return JSONResponse(await anyio.to_thread.run_sync(chat_input_tokens, ctx, raw))
            finally:
                release()

        # llama-server serves each route with and without the /v1 prefix
        for prefix in ("/v1", ""):
            router.add_api_route(f"{prefix}/chat/completions", chat_completions, methods=["POST"])
            router.add_api_route(f"{prefix}/chat/completions/input_tokens", input_tokens, methods=["POST"])

    async def handle(self, request: Request, ctx: ServerContext) -> Response:
        deadline = time.monotonic() + ctx.options.engine.pending_timeout_ms / 1000.0
        raw = await request.body()
        plan = await parse_off_loop(raw, validate_body, ctx)

        log.debug("chat request: reasoning_effort asked %s, tools %d, forced %s, logprobs %s, thinking_budget %s",
                  plan.effort_requested, len(plan.tools or ()), plan.forced_tool is not None, plan.logprobs,
                  plan.thinking_budget)
        compiled = await anyio.to_thread.run_sync(_compile, ctx, plan)  # structured output: 400s here
        release = ctx.ingress.acquire()

        try:
            prompt: PreparedPrompt = await anyio.to_thread.run_sync(
                render_prompt_ids, ctx, plan.messages, plan.tools, plan.thinking, plan.template_kwargs)
            opener = None
            if plan.forced_tool is not None:
                opener = forced_call_opener(plan.forced_tool, ctx.tokenizer)
                prompt = PreparedPrompt(ids=prompt.ids + forced_call_ids(ctx.tokenizer, plan.forced_tool),
                                        opens_reasoning=False)
            sampling = resolve_sampling(ctx, plan.thinking, plan.sampling_request, plan.seed)
            max_tokens = plan.max_tokens
            if plan.derived_limit:
                max_tokens = derived_output_limit(ctx, len(prompt.ids))
            gen = GenerationRequest(prompt_ids=prompt.ids, sampling=sampling, max_tokens=max_tokens, media=prompt.media,
                                    stop=plan.stop, ignore_eos=plan.ignore_eos,
                                    request_id=request.scope.get("state", {}).get("request_id", ""),
                                    deadline=deadline, logprobs=plan.logprobs,
                                    checkpoint_hints=prompt_hints(ctx, prompt.ids, plan.template_kwargs),
                                    constraint=make_constraint(ctx, compiled, prompt.opens_reasoning),
                                    progress=plan.stream and plan.return_progress,
                                    **thinking_fields(ctx, prompt, plan.thinking_budget, plan.post_thinking,
                                                      sampling, plan.reasoning_control))
            handle = ctx.engine.submit(gen)
        except BaseException:
            release()
            raise
        cid = "chatcmpl-" + uuid.uuid4().hex
        created = int(time.time())
        model_id = ctx.model.id
        out = _Output(ctx, plan, prompt, opener)
        if plan.verbose:
            out.verbose = VerboseRecord(ctx, prompt.ids, generation_settings(
                ctx, sampling, int(getattr(handle, "max_tokens", None) or 0), stop=plan.stop,
                ignore_eos=plan.ignore_eos, stream=plan.stream, n_probs=plan.logprobs or 0))
        live = ctx.live_completions
        if live is not None and plan.stream:  # the target of POST /v1/chat/completions/control
            live[cid] = (handle, plan.reasoning_control and prompt.opens_reasoning)
            release = _also(release, lambda: live.pop(cid, None))
        if plan.stream:
            body = self._stream(ctx, handle, plan, out, cid, created, model_id)
            conversation = request.headers.get("x-conversation-id")
            if conversation and ctx.stream_sessions is not None:
                # A resumable stream (llama-server's WebUI sessions): it outlives this connection.
                session = ctx.stream_sessions.start(conversation, body, handle.cancel, release)
                return EventStreamResponse(session.read(0), on_disconnect=lambda: None)
            return EventStreamResponse(body, on_disconnect=handle.cancel, on_close=release)
        try:
            result = await unless_disconnected(
                request, self._aggregate(handle, plan, out, cid, created, model_id), handle.cancel)
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            release()
        return JSONResponse(result)

    async def _aggregate(self, handle, plan: ChatPlan, out: "_Output", cid: str, created: int,
                         model_id: str) -> dict:
        records: list[dict] = []
        async for ev in handle.events():
            if ev.kind == "delta":
                out.counter.feed(ev.token_ids)
                records += out.records(ev)
                out.decoder.feed(ev.text)
                if out.verbose is not None:
                    out.verbose.feed(ev)
            elif ev.kind == "error":
                raise ev.error
            elif ev.kind == "finish":
                if ev.finish_reason == "cancelled":
                    raise _cancelled_error()
                out.decoder.finish()
                out.log_parse()
                dec = out.decoder
                calls = [out.call_json(c) for c in dec.tool_calls]
                reasoning = dec.reasoning
                message = {"role": "assistant", "content": dec.content if (dec.content or not calls) else None,
                           "reasoning_content": reasoning if (reasoning or out.prompt.opens_reasoning) else None,
                           "refusal": None}
                if calls:
                    message["tool_calls"] = calls
                logprobs = {"content": records, "refusal": None} if plan.logprobs is not None else None
                finish = "tool_calls" if calls else ev.finish_reason
                result = {"id": cid, "object": "chat.completion", "created": created, "model": model_id,
                          "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                                       "finish_reason": finish}],
                          "usage": usage_dict(ev, out.counter.count)}
                result["timings"] = ev.timings or {}
                result.update(retained_session(ev))
                if out.verbose is not None:
                    result["__verbose"] = out.verbose.final(ev)
                return result
        raise EngineError(500, "internal_error", "The engine ended the request without finishing it.",
                          type_="server_error")

    async def _stream(self, ctx: ServerContext, handle, plan: ChatPlan, out: "_Output", cid: str,
                      created: int, model_id: str) -> AsyncIterator[str]:
        include_usage = plan.include_usage
        want_logprobs = plan.logprobs is not None
        pending: list[dict] = []  # records whose text is not yet published (held back by the decoder)
        n_calls = 0
        enc = ChunkEncoder(cid, created, model_id, include_usage)
        # llama.cpp's observations (server/progress.py): timings on every visible chunk, prompt_progress chunks
        observed = StreamTimings(len(out.prompt.ids)) if (plan.timings_per_token or plan.return_progress) else None
        per_token = plan.timings_per_token
        progress_final = False

        def timings() -> dict | None:
            return observed.snapshot() if per_token else None

        def chunk(delta: dict, finish: str | None = None, records: list | None = None, **extra) -> str:
            lp = {"content": records, "refusal": None} if (want_logprobs and records is not None) else None
            return enc.chunk(delta, finish, lp, **extra)

        def progress_chunk(final: bool = False) -> str:
            extra = {"prompt_progress": observed.progress(final)}  # before the snapshot: final moves it
            if per_token:
                extra["timings"] = observed.snapshot()
            return chunk({"role": "assistant", "content": None}, **extra)

        def chunks(events: list[OutputEvent], result: list[str]) -> None:
            nonlocal pending, n_calls
            for e in events:
                if e.kind == "reasoning":
                    result.append(enc.text_delta("reasoning_content", e.text, None, timings()))
                elif e.kind == "content":
                    records, pending = pending, []
                    lp = {"content": records, "refusal": None} if want_logprobs else None
                    result.append(enc.text_delta("content", e.text, lp, timings()))
                else:
                    records, pending = pending, []
                    entry = {"index": n_calls, **out.call_json(e.tool_call)}
                    n_calls += 1
                    extra = {"timings": observed.snapshot()} if per_token else {}
                    result.append(chunk({"tool_calls": [entry]}, records=records if records else None, **extra))

        # the role chunk's content is null, as OpenAI's and llama-server's
        yield chunk({"role": "assistant", "content": None})
        # Every event already delivered is turned into its chunks and written as one body part.
        parts: list[str] = []
        try:
            async with aclosing(event_batches(handle.events(), ctx.keepalive_s)) as batches:
                async for batch in batches:
                    if batch is None:
                        yield KEEPALIVE
                        continue
                    for ev in batch:
                        if observed is not None and ev.kind in ("admitted", "progress"):
                            if ev.kind == "admitted":
                                observed.admitted(ev.usage.cached_tokens if ev.usage else 0)
                            else:
                                observed.progressed((ev.progress or {}).get("processed", 0))
                            if plan.return_progress:
                                parts.append(progress_chunk())
                            continue
                        if observed is not None and ev.kind in ("delta", "finish") and not progress_final:
                            progress_final = True  # the prompt is done: its last event precedes any output
                            if plan.return_progress:
                                parts.append(progress_chunk(final=True))
                        if observed is not None and ev.kind == "delta":
                            observed.tokens(len(ev.token_ids))
                        if ev.kind == "delta":
                            out.counter.feed(ev.token_ids)
                            if out.verbose is not None:
                                out.verbose.feed(ev)
                            if want_logprobs:
                                pending += out.records(ev)
                            chunks(out.decoder.feed(ev.text), parts)
                        elif ev.kind == "error":
                            parts.append(sse_data(engine_error_body(ev.error)))
                            yield "".join(parts)
                            return
                        elif ev.kind == "finish":
                            if ev.finish_reason == "cancelled":
                                parts.append(sse_data(engine_error_body(_cancelled_error())))
                                yield "".join(parts)
                                return
                            chunks(out.decoder.finish(), parts)
                            out.log_parse()
                            finish = "tool_calls" if out.decoder.tool_calls else ev.finish_reason
                            records = pending if pending else None
                            final_timings = ev.timings or {}
                            # llama-server puts __verbose on the first chunk of the final group
                            verbose = {"__verbose": out.verbose.final(ev, streamed=True)} if out.verbose else {}
                            if include_usage:
                                parts.append(chunk({}, finish, records=records, **verbose))
                                choices = []
                                if ctx.options.usage_chunk_choice:
                                    choices = [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}]
                                parts.append(sse_data({"id": cid, "object": "chat.completion.chunk",
                                                       "created": created, "model": model_id, "choices": choices,
                                                       "usage": usage_dict(ev, out.counter.count),
                                                       "timings": final_timings, **retained_session(ev)}))
                            else:
                                parts.append(chunk({}, finish, records=records, timings=final_timings,
                                                   **retained_session(ev), **verbose))
                            parts.append(DONE)
                            yield "".join(parts)
                            return
                    if parts:
                        text, parts = "".join(parts), []
                        yield text
        except Exception as e:  # noqa: BLE001 - headers are sent: the failure travels as an error event
            log.exception("chat stream failed")
            yield "".join(parts) + sse_data(engine_error_body(internal_error(e)))
            return
        yield sse_data(engine_error_body(EngineError(
            500, "internal_error", "The engine ended the request without finishing it.", type_="server_error")))


def _also(first, then):
    """A callable running `first` then `then` (both once-safe callbacks)."""
    def both() -> None:
        try:
            first()
        finally:
            then()

    return both


class ChunkEncoder:
    """SSE text of one stream's chat.completion.chunk events, byte for byte what `sse_data` makes of
    the chunk object; a text delta (the per-token event) is the prebuilt head and tail around the
    JSON string of its text instead of a whole object through the encoder."""

    def __init__(self, cid: str, created: int, model_id: str, include_usage: bool):
        self.cid, self.created, self.model_id, self.include_usage = cid, created, model_id, include_usage
        self._head = (f'data: {{"id":{json_text(cid)},"object":"chat.completion.chunk","created":'
                      f'{json_text(created)},"model":{json_text(model_id)},"choices":[{{"index":0,"delta":{{')
        self._tail = ',"finish_reason":null}]' + (',"usage":null' if include_usage else "") + "}\n\n"

    def chunk(self, delta: dict, finish: str | None, lp: dict | None, **extra) -> str:
        obj = {"id": self.cid, "object": "chat.completion.chunk", "created": self.created, "model": self.model_id,
               "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}
        if self.include_usage:
            obj["usage"] = None
        obj.update(extra)
        return sse_data(obj)

    def text_delta(self, key: str, text: str, lp: dict | None, timings: dict | None = None) -> str:
        """== chunk({key: text}, None, lp, timings=timings) (no timings key when None); `key` is a
        plain identifier."""
        tail = self._tail if timings is None else f'{self._tail[:-3]},"timings":{json_text(timings)}}}\n\n'
        return (f'{self._head}"{key}":{json_text(text)}}},"logprobs":'
                f'{"null" if lp is None else json_text(lp)}{tail}')


class _Output:
    """One choice's output state: decoder, reasoning-token counter and log-probability channel."""

    def __init__(self, ctx: ServerContext, plan: ChatPlan, prompt: PreparedPrompt, opener: str | None):
        self.ctx, self.plan, self.prompt = ctx, plan, prompt
        self.decoder = OutputDecoder(in_reasoning=prompt.opens_reasoning, tools=plan.tools,
                                     parallel_tool_calls=plan.parallel_tool_calls, forced_call=opener,
                                     chat_format=chat_format_of(ctx.tokenizer))
        self.counter = ReasoningTokenCounter(ctx.tokenizer, prompt.opens_reasoning)
        self.channel = LogprobChannel(ctx.tokenizer, prompt.opens_reasoning) if plan.logprobs is not None else None
        self.verbose: VerboseRecord | None = None  # `verbose: true`

    def records(self, ev: EngineEvent) -> list[dict]:
        if self.channel is None:
            return []
        tok = self.ctx.tokenizer
        return [logprob_json(tok, r) for r in self.channel.take(ev.token_ids, ev.logprobs)]

    def call_json(self, call: ToolCall) -> dict:
        if call.name in self.plan.custom_tools:
            try:
                args = json.loads(call.arguments)
            except ValueError:
                args = None
            text = args.get("input") if isinstance(args, dict) else None
            return {"id": call.id, "type": "custom",
                    "custom": {"name": call.name, "input": text if isinstance(text, str) else call.arguments}}
        return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}

    def log_parse(self) -> None:
        """One warning with the failure classification only (never the generated markup)."""
        parse = self.decoder.parse
        if parse is not None and parse.fallback != "none":
            log.warning("tool call parse: fallback %s (recovered=%s, malformed_call=%s, trailing_dropped=%s)",
                        parse.fallback, parse.recovered, parse.malformed, parse.trailing_dropped)


def _compile(ctx: ServerContext, plan: ChatPlan):
    """The request's compiled format: the response format, or a forced call's parameter schema."""
    param = None
    if plan.forced_tool is not None:
        idx = next((i for i, t in enumerate(plan.tools or []) if t["function"]["name"] == plan.forced_tool), 0)
        kind = "custom" if plan.forced_tool in plan.custom_tools else "function"
        param = f"tools.{idx}.{kind}.parameters"
    return compile_request(ctx, plan.response_format, tools=plan.tools, parallel=plan.parallel_tool_calls,
                           forced_tool=plan.forced_tool, tool_param=param)


PROTOCOL = ChatCompletions()


@hookimpl
def ninfer_register_protocols(register):
    register("openai_chat", "ninfer_core.protocols.openai_chat:PROTOCOL")
