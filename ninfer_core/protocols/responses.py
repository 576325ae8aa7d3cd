"""Built-in protocol plugin: the OpenAI Responses API core (spec "OpenAI Responses Core").

Routes: POST /v1/responses (aggregate or semantic SSE), POST /v1/responses/input_tokens,
GET/DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items, and the explicit refusals
POST /v1/responses/{id}/cancel and POST /v1/responses/compact. Requests are checked by
responses_request, Items grouped by responses_items, the prompt rendered on the shared
preparation path (server.prepare), output read through the shared OutputDecoder and shaped by
responses_output. Stored Responses live in a per-app LRU (server.response_store).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ninfer_core import hookimpl
from ninfer_core.engine.api import EngineError, GenerationRequest
from ninfer_core.protocols.responses_items import (
    BREAKPOINT_KEY,
    breakpoint_markers,
    normalize_input,
    show,
    to_messages,
)
from ninfer_core.protocols.responses_output import ResponseBuilder, sse_event
from ninfer_core.protocols.responses_request import CreatePlan, load_body, parse_request, resolve_thinking
from ninfer_core.server.context import Ingress, ServerContext
from ninfer_core.server.errors import bad_request, parse_off_loop
from ninfer_core.server.output import LogprobChannel, OutputDecoder, logprob_json
from ninfer_core.server.prepare import (
    ReasoningTokenCounter,
    forced_call_ids,
    forced_call_opener,
    prompt_hints,
    render_prompt_ids,
    resolve_sampling,
    thinking_fields,
)
from ninfer_core.server.response_store import ResponseStore, StoredResponse, record_size
from ninfer_core.server.sse import (
    KEEPALIVE,
    ClientDisconnected,
    EventStreamResponse,
    unless_disconnected,
    with_keepalive,
)
from ninfer_core.structured.formats import with_instruction
from ninfer_core.structured.request import compile_request, make_constraint
from ninfer_core.tokenizer.chat_format import chat_format_of, turn_opener_id

log = logging.getLogger("ninfer.server")
SESSION_KEY_MAX = 64


@dataclass
class Prepared:
    ids: list[int]
    opens_reasoning: bool
    history: list[dict]
    new_items: list[dict]
    parent: StoredResponse | None
    preserve: bool | None
    thinking: bool
    forced_opener: str | None
    session_id: str | None = None
    hints: Any = None  # CheckpointHints with the client's prompt_cache_breakpoint markers, when any
    media: Any = None  # ninfer_core.media.api.MediaPrompt of the prompt's images and videos


DROPPED_TOOLS_HEADER = "x-ninfer-dropped-tools"
# The engine names Chat Completions' fields in its admission errors; a Responses caller sent these.
_RESPONSES_PARAM = {"messages": "input", "max_tokens": "max_output_tokens"}


def responses_param(err: EngineError) -> EngineError:
    """`err` with its param (and the quoted name in its message) in the Responses field names."""
    param = _RESPONSES_PARAM.get(err.param or "")
    if param is None:
        return err
    return EngineError(err.status, err.code, err.message, param, err.type)


def _not_found(response_id: str) -> EngineError:
    return EngineError(404, "response_not_found", f"No stored Response has the id {show(response_id)}; it was never "
                       "stored (store: false), was deleted or evicted, or the server restarted.", param="response_id")


def _has_user(items: list[dict]) -> bool:
    return any(i["type"] == "message" and i.get("role") == "user" for i in items)


def prepare_prompt(plan: CreatePlan, ctx: ServerContext,
                   store: ResponseStore) -> tuple[Prepared, list[dict], dict[str, Any]]:
    """Parent lookup, Item normalization and grouping, thinking mode: everything before rendering.

    Shared by Create and input token count, so both see the same prompt."""
    parent = None
    if plan.previous_response_id is not None:
        parent = store.get(plan.previous_response_id)
        if parent is None:
            raise bad_request("previous_response_not_found", f"previous_response_id {show(plan.previous_response_id)}"
                              " names no stored Response (store: false, deleted, evicted, or the server restarted).",
                              "previous_response_id")
    history = parent.context if parent else []
    vision: bool | str = ctx.media is not None
    if vision and ctx.options.media is not None and ctx.options.media.lenient_image_detail:
        vision = "lenient"
    new_items = normalize_input(plan.input, vision, {i["id"] for i in history})
    if not new_items and not _has_user(history):
        raise bad_request("missing_required_parameter", "Missing required parameter: 'input' (it may be omitted only "
                          "when previous_response_id already supplies a user query).", "input")
    preserve = plan.preserve_thinking if plan.preserve_thinking is not None else (
        parent.preserve_thinking if parent else None)
    thinking, kwargs = resolve_thinking(plan, ctx, preserve)
    context = [(i, "previous_response_id") for i in history] + [(i, f"input.{k}") for k, i in enumerate(new_items)]
    messages = to_messages(context, plan.instructions, ctx.options.lenient_assistant_history)
    messages = with_instruction(messages, plan.response_format, bool(plan.tools.template_tools))
    return Prepared([], False, history, new_items, parent, preserve, thinking, None), messages, kwargs


def render(prep_and_messages: tuple[Prepared, list[dict], dict[str, Any]], plan: CreatePlan,
           ctx: ServerContext, checkpoints: bool = False) -> Prepared:
    """Host work (run on a worker thread): the template and tokenisation, plus a forced call opener.

    With `checkpoints` (Create), also the context-cache hints: the turn closure preserve_thinking
    selects, the client's prompt_cache_breakpoint markers, and the replay frontier."""
    prep, messages, kwargs = prep_and_messages
    tools = plan.tools.template_tools or None
    prompt = render_prompt_ids(ctx, messages, tools, prep.thinking, kwargs)
    prep.ids, prep.opens_reasoning, prep.media = list(prompt.ids), prompt.opens_reasoning, prompt.media
    if checkpoints:
        prep.hints = prompt_hints(ctx, prep.ids, kwargs)
        prep.hints.markers = breakpoint_markers(prep.ids, turn_opener_id(ctx.tokenizer), messages,
                                                bool(plan.tools.template_tools))
        if prep.history:
            prep.hints.replay = replay_frontier(ctx, prep, plan, messages)
    if plan.tools.forced is not None:
        prep.forced_opener = forced_call_opener(plan.tools.forced, ctx.tokenizer)
        prep.ids += forced_call_ids(ctx.tokenizer, plan.tools.forced)
        prep.opens_reasoning = False
    return prep


def _compile(ctx: ServerContext, plan: CreatePlan):
    """The compiled text.format, or a forced call's parameter schema (ninfer_core.structured)."""
    ts = plan.tools
    return compile_request(ctx, plan.response_format, tools=ts.template_tools or None,
                           parallel=ts.parallel_tool_calls, forced_tool=ts.forced, tool_param="tool_choice")


def replay_frontier(ctx: ServerContext, prep: Prepared, plan: CreatePlan, messages: list[dict]) -> int | None:
    """Where the replayed stored history (previous_response_id) ends in this prompt: the start of the
    first message of the new input. Every request that replays the same stored Response (a retry, a
    sibling with other input, a store:false probe) renders the history the same way up to there, so
    the session keeps a checkpoint at it (private_response_replay). None when the new input does not
    start a message of its own or the prompt does not have the layout the template predicts."""
    try:
        hist = to_messages([(i, "previous_response_id") for i in prep.history], plan.instructions,
                           ctx.options.lenient_assistant_history)
    except EngineError:
        return None
    k = len(hist)
    if not 0 < k < len(messages) or messages[:k] != hist:
        return None
    flagged = [{key: v for key, v in m.items() if key != BREAKPOINT_KEY} for m in messages]
    flagged[k - 1][BREAKPOINT_KEY] = True  # "a marker ends the last replayed message"
    marks = breakpoint_markers(prep.ids, turn_opener_id(ctx.tokenizer), flagged,
                               bool(plan.tools.template_tools))
    return marks[0] if marks else None


def _usage(event, reasoning_tokens: int) -> dict:
    u = event.usage
    prompt = u.prompt_tokens if u else 0
    completion = u.completion_tokens if u else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": u.cached_tokens if u else 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, completion)},
            "total_tokens": prompt + completion}


class Responses:
    """The protocol object the host mounts (state lives per mounted app, in `mount`'s closure)."""

    name = "responses"

    def mount(self, router: APIRouter, ctx: ServerContext) -> None:
        opts = ctx.options
        store = ResponseStore(opts.response_store_max_records, opts.response_store_max_mib << 20)
        eng = opts.engine
        counting = Ingress(eng.max_concurrency + eng.max_pending_requests)
        ctx.response_store = store  # type: ignore[attr-defined]  # for tests and ops introspection

        async def create(request: Request) -> Response:
            return await self.create(request, ctx, store)

        async def input_tokens(request: Request) -> Response:
            return await self.count(request, ctx, store, counting)

        async def compact(request: Request) -> Response:
            raise bad_request("compaction_not_supported", "Responses compaction is not supported: NInfer keeps the "
                              "conversation as sent; start a new chain with the history you want.", None)

        async def retrieve(response_id: str, request: Request) -> Response:
            q = request.query_params
            if q.get("stream", "").lower() in ("true", "1") or q.get("starting_after") is not None:
                raise bad_request("stream_recovery_not_supported", "Resuming a Response stream is not supported; "
                                  "retrieve the terminal object without stream.", "stream")
            inc = [v for k, v in q.multi_items() if k in ("include", "include[]") and v]
            if inc:
                raise bad_request("include_not_supported", f"include {show(inc[0])} is not supported when retrieving "
                                  "a stored Response.", "include")
            rec = store.get(response_id)
            if rec is None:
                raise _not_found(response_id)
            return JSONResponse(rec.response)

        async def delete(response_id: str) -> Response:
            if not store.delete(response_id):
                raise _not_found(response_id)
            return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

        async def input_items(response_id: str, request: Request) -> Response:
            return self.list_items(response_id, request, store)

        async def cancel(response_id: str) -> Response:
            if store.get(response_id) is None:
                raise _not_found(response_id)
            raise bad_request("background_not_supported", f"Response {show(response_id)} cannot be cancelled: "
                              "background execution is not supported, so every Response is already terminal.",
                              "response_id")

        router.add_api_route("/v1/responses", create, methods=["POST"])
        router.add_api_route("/v1/responses/input_tokens", input_tokens, methods=["POST"])
        # llama-server's unprefixed forms of the two POST routes
        router.add_api_route("/responses", create, methods=["POST"])
        router.add_api_route("/responses/input_tokens", input_tokens, methods=["POST"])
        router.add_api_route("/v1/responses/compact", compact, methods=["POST"])
        router.add_api_route("/v1/responses/{response_id}", retrieve, methods=["GET"])
        router.add_api_route("/v1/responses/{response_id}", delete, methods=["DELETE"])
        router.add_api_route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"])
        router.add_api_route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"])

    # -- list input items ---------------------------------------------------------------------------
    @staticmethod
    def list_items(response_id: str, request: Request, store: ResponseStore) -> Response:
        q = request.query_params
        limit_raw = q.get("limit", "20")
        try:
            limit = int(limit_raw)
        except ValueError:
            raise bad_request("invalid_type", f"limit {show(limit_raw)} is not an integer.", "limit") from None
        if not 1 <= limit <= 100:
            raise bad_request("invalid_value", f"limit must be in 1..100, got {limit}.", "limit")
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("invalid_value", f"order {show(order)} is not asc or desc.", "order")
        inc = [v for k, v in q.multi_items() if k in ("include", "include[]") and v]
        if inc:
            raise bad_request("include_not_supported", f"include {show(inc[0])} is not supported when listing "
                              "input Items.", "include")
        rec = store.get(response_id)
        if rec is None:
            raise _not_found(response_id)
        items = list(rec.input_items)
        if order == "desc":
            items.reverse()
        after = q.get("after")
        if after is not None:
            ids = [i["id"] for i in items]
            if after not in ids:
                raise bad_request("invalid_value", f"after {show(after)} is not an input Item of this Response.",
                                  "after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})

    # -- input token count --------------------------------------------------------------------------
    async def count(self, request: Request, ctx: ServerContext, store: ResponseStore, counting: Ingress) -> Response:
        raw = await request.body()
        data = load_body(raw)
        plan = parse_request(data, ctx, count_only=True)
        counting.acquire()
        try:
            staged = prepare_prompt(plan, ctx, store)
            prep = await anyio.to_thread.run_sync(render, staged, plan, ctx)
        finally:
            counting.release()
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(prep.ids)})

    # -- create -----------------------------------------------------------------------------------
    async def create(self, request: Request, ctx: ServerContext, store: ResponseStore) -> Response:
        deadline = time.monotonic() + ctx.options.engine.pending_timeout_ms / 1000.0
        raw = await request.body()
        data = await parse_off_loop(raw, load_body)
        plan = parse_request(data, ctx)
        staged = prepare_prompt(plan, ctx, store)
        if plan.store:
            store.check_fits(record_size({}, staged[0].new_items))
        compiled = await anyio.to_thread.run_sync(_compile, ctx, plan)  # structured output: 400s here

        release = ctx.ingress.acquire()

        rid = "resp_" + secrets.token_hex(16)
        try:
            prep: Prepared = await anyio.to_thread.run_sync(render, staged, plan, ctx, True)
            sampling = resolve_sampling(ctx, prep.thinking, {"temperature": plan.temperature, "top_p": plan.top_p},
                                        None)
            # A stored root names the chain's session; children inherit it; a store:false root is anonymous.
            if prep.parent is not None:
                prep.session_id = prep.parent.session_id
            elif plan.store:
                prep.session_id = ("resp:" + rid)[:SESSION_KEY_MAX]
            gen = GenerationRequest(prompt_ids=prep.ids, sampling=sampling, max_tokens=plan.max_output_tokens,
                                    media=prep.media,
                                    request_id=request.scope.get("state", {}).get("request_id", ""),
                                    deadline=deadline, session_id=prep.session_id, session_store=plan.store,
                                    checkpoint_hints=prep.hints,
                                    logprobs=(plan.top_logprobs or 0) if plan.logprobs else None,
                                    constraint=make_constraint(ctx, compiled, prep.opens_reasoning),
                                    **thinking_fields(ctx, prep, plan.thinking_budget, plan.post_thinking, sampling))
            handle = ctx.engine.submit(gen)
        except EngineError as e:
            release()
            raise responses_param(e) from None
        except BaseException:
            release()
            raise
        headers = {}
        if plan.dropped_tools:
            headers[DROPPED_TOOLS_HEADER] = ", ".join(plan.dropped_tools)
            log.info("responses %s: dropped hosted tools %s (--drop-hosted-tools)", rid, headers[DROPPED_TOOLS_HEADER])

        ts = plan.tools
        response = {
            "id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "completed_at": None, "error": None, "incomplete_details": None,
            "instructions": plan.instructions, "max_output_tokens": plan.max_output_tokens,
            "max_tool_calls": plan.max_tool_calls, "model": ctx.model.id, "output": [],
            "parallel_tool_calls": ts.parallel_tool_calls, "previous_response_id": plan.previous_response_id,
            "prompt_cache_key": plan.echo["prompt_cache_key"],
            "prompt_cache_retention": plan.echo["prompt_cache_retention"], "reasoning": plan.echo["reasoning"],
            "safety_identifier": plan.echo["safety_identifier"], "service_tier": "default", "store": plan.store,
            "temperature": sampling.temperature, "text": plan.text, "tool_choice": ts.tool_choice,
            "tools": ts.declared, "top_logprobs": plan.top_logprobs or 0, "top_p": sampling.top_p,
            "truncation": "disabled", "usage": None, "user": plan.echo["user"], "metadata": plan.metadata,
        }
        builder = ResponseBuilder(response, summary=plan.summary, encrypted=plan.encrypted_reasoning,
                                  identity=ts.identity)
        channel = LogprobChannel(ctx.tokenizer, prep.opens_reasoning) if plan.logprobs else None
        decoder = OutputDecoder(in_reasoning=prep.opens_reasoning, tools=ts.template_tools or None,
                                parallel_tool_calls=ts.parallel_tool_calls, id_prefix="call_",
                                forced_call=prep.forced_opener, undeclared_as_text=True,
                                chat_format=chat_format_of(ctx.tokenizer))
        counter = ReasoningTokenCounter(ctx.tokenizer, prep.opens_reasoning)
        run = _Run(ctx, store, plan, prep, builder, decoder, counter, handle, channel)
        if plan.stream:
            return EventStreamResponse(run.stream(), on_disconnect=handle.cancel, on_close=release, headers=headers)
        try:
            result = await unless_disconnected(request, run.aggregate(), handle.cancel)
        except ClientDisconnected:
            run.abandon()
            return Response(status_code=499)
        finally:
            release()
        return JSONResponse(result, headers=headers)


class _Run:
    """One admitted Create: engine events -> builder -> (store) -> JSON or SSE."""

    def __init__(self, ctx, store, plan, prep, builder, decoder, counter, handle, channel):
        self.ctx, self.store, self.plan, self.prep, self.channel = ctx, store, plan, prep, channel
        self.builder, self.decoder, self.counter, self.handle = builder, decoder, counter, handle
        self.terminal = False

    def _on_event(self, ev) -> list[dict]:
        """Apply one engine event; returns the SSE events it produced. Raises EngineError for an engine error."""
        b = self.builder
        if ev.kind == "delta":
            self.counter.feed(ev.token_ids)
            if self.channel is not None:
                tok = self.ctx.tokenizer
                b.add_logprobs([logprob_json(tok, r) for r in self.channel.take(ev.token_ids, ev.logprobs)])
            return b.feed(self.decoder.feed(ev.text))
        if ev.kind == "error":
            raise ev.error
        if ev.kind == "finish":
            evs = b.feed(self.decoder.finish())
            parse = self.decoder.parse
            if parse is not None and parse.fallback != "none":  # the classification only, never the text
                log.warning("responses tool call parse: fallback %s (recovered=%s, malformed_call=%s, "
                            "trailing_dropped=%s)", parse.fallback, parse.recovered, parse.malformed,
                            parse.trailing_dropped)
            usage = _usage(ev, self.counter.count)
            if ev.finish_reason == "cancelled":
                evs += b.finish("cancelled", usage)
            elif ev.finish_reason == "length":
                evs += b.finish("incomplete", usage, "max_output_tokens")
            else:
                evs += b.finish("completed", usage)
            return evs
        return []

    def _store(self) -> None:
        """Keep the terminal Response (store: true); capacity failures become the Response's error."""
        if not self.plan.store:
            return
        r = self.builder.response
        out_items = [json.loads(json.dumps(i)) for i in r["output"]]
        rec = StoredResponse(id=r["id"], response=r, input_items=self.prep.new_items,
                             context=self.prep.history + self.prep.new_items + out_items,
                             preserve_thinking=self.prep.preserve, session_id=self.prep.session_id)
        self.store.put(rec)

    async def aggregate(self) -> dict:
        async for ev in self.handle.events():
            self._on_event(ev)
            if ev.kind == "finish":
                self.terminal = True
                self._store()
                return self.builder.response
        raise EngineError(500, "internal_error", "The engine ended the request without finishing it.",
                          type_="server_error")

    def abandon(self) -> None:
        """The client went away: keep what was generated as a cancelled Response."""
        if self.terminal:
            return
        self.terminal = True
        self.builder.finish("cancelled", None)
        try:
            self._store()
        except EngineError:
            pass

    async def stream(self) -> AsyncIterator[str]:
        b = self.builder
        try:
            for e in b.start():
                yield sse_event(e)
            async with aclosing(with_keepalive(self.handle.events(), self.ctx.keepalive_s)) as events:
                async for ev in events:
                    if ev is None:
                        yield KEEPALIVE
                        continue
                    try:
                        evs = self._on_event(ev)
                    except EngineError as err:
                        evs = b.fail(err.code, err.message)
                        self.terminal = True
                        evs.append(self._stored_terminal())
                        for e in evs:
                            yield sse_event(e)
                        return
                    if ev.kind == "finish":
                        self.terminal = True
                        evs.append(self._stored_terminal())
                    for e in evs:
                        yield sse_event(e)
                    if ev.kind == "finish":
                        return
            b.fail("internal_error", "The engine ended the request without finishing it.")
            self.terminal = True
            yield sse_event(b.terminal_event())
        except Exception as e:
            log.exception("responses stream failed")
            if not self.terminal:
                self.terminal = True
                for ev in b.fail("internal_error", f"Internal server error: {type(e).__name__}"):
                    yield sse_event(ev)
                yield sse_event(b.terminal_event())
        finally:
            if not self.terminal:
                self.abandon()

    def _stored_terminal(self) -> dict:
        try:
            self._store()
        except EngineError as err:
            self.builder.response["status"] = "failed"
            self.builder.response["error"] = {"code": err.code, "message": err.message}
            self.builder.response["completed_at"] = None
        return self.builder.terminal_event()


PROTOCOL = Responses()


@hookimpl
def ninfer_register_protocols(register):
    register("responses", "ninfer_core.protocols.responses:PROTOCOL")
