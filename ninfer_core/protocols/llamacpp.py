"""Built-in protocol plugin: llama.cpp's native completion, POST /completion (also /completions).

A raw prompt continues without a chat template (raw_prompt.py holds the checks both raw routes
share). The response is llama.cpp's object (content, tokens, stop, stop_type, stopping_word,
tokens_predicted, tokens_evaluated, tokens_cached, prompt, generation_settings, has_new_line,
truncated, id_slot, model, timings), cut to `response_fields` when the request names them. A stream
sends one event per piece of content with the running tokens_predicted, then the full object with
an empty content, and no [DONE].
"""

from __future__ import annotations

import logging
from contextlib import aclosing
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ninfer_core import hookimpl
from ninfer_core.engine.api import EngineEvent
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
from ninfer_core.server.progress import StreamTimings
from ninfer_core.server.errors import bad_request, engine_error_body, parse_json_body, parse_off_loop, internal_error
from ninfer_core.server.sse import (
    KEEPALIVE,
    ClientDisconnected,
    EventStreamResponse,
    sse_data,
    unless_disconnected,
    with_keepalive,
)

log = logging.getLogger("ninfer.server")

# A request the context cache did not retain (cache_prompt false, --no-prefix-reuse) is in no slot:
# -1 is llama.cpp's "any slot", which a client echoing it back as id_slot leaves without effect.
NO_SLOT = -1
STOP_TYPES = {"eos": "eos", "stop_string": "word", "max_tokens": "limit", "context": "limit"}


class LlamaCompletionRequest(RawCompletionFields):
    n_predict: int | None = None  # first; then max_tokens. Any negative value: no limit
    json_schema: Any = None
    return_tokens: bool | None = None
    return_progress: bool | None = None
    response_fields: list[str] | None = None


class LlamaPlan:
    def __init__(self, raw: RawPlan, req: LlamaCompletionRequest):
        self.raw = raw
        self.return_tokens = bool(req.return_tokens)
        self.return_progress = bool(req.return_progress)
        self.response_fields = req.response_fields


def validate_body(raw: bytes, ctx: ServerContext) -> LlamaPlan:
    data = parse_json_body(raw)
    if not isinstance(data, dict):
        raise bad_request("invalid_type", "The request body must be a JSON object.", None)
    req = LlamaCompletionRequest.model_validate(data)
    if req.json_schema is not None:
        raise bad_request("json_schema_not_supported", "json_schema needs a server started with "
                          "--structured-output, which this build does not offer yet.", "json_schema")
    if req.n_predict is not None:
        limit, param = req.n_predict, "n_predict"
    else:
        limit, param = req.max_tokens, "max_tokens"
    for i, name in enumerate(req.response_fields or ()):
        if not name:
            raise bad_request("invalid_value", "response_fields names must be non-empty.",
                              f"response_fields.{i}")
    return LlamaPlan(check_fields(req, ctx, limit, negative_is_unlimited=True, limit_param=param), req)


def _slot(ev: EngineEvent) -> int:
    """The /slots cell the finished session was retained under (the context cache's report)."""
    slot = (getattr(ev, "context", None) or {}).get("id_slot")
    return slot if isinstance(slot, int) else NO_SLOT


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
        sub = await submit_raw(request, ctx, plan.raw, progress=plan.return_progress and plan.raw.stream)
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

    def _final(self, ctx: ServerContext, plan: LlamaPlan, sub: RawSubmission, ev: EngineEvent, content: str,
               ids: list[int], prompt_text: str) -> dict:
        u = ev.usage
        stop_type = STOP_TYPES.get(ev.stop_reason or "", "none")
        return {
            "index": 0, "content": content, "tokens": list(ids) if plan.return_tokens else [],
            "id_slot": _slot(ev), "stop": True, "model": ctx.model.id,
            "tokens_predicted": u.completion_tokens if u else len(ids),
            "tokens_evaluated": u.prompt_tokens if u else len(sub.prompt_ids),
            "generation_settings": settings_dict(ctx, plan.raw, sub.sampling, sub.n_predict),
            "prompt": prompt_text, "has_new_line": "\n" in content, "truncated": False,
            "stop_type": stop_type, "stopping_word": (ev.matched_stop or "") if stop_type == "word" else "",
            "tokens_cached": u.cached_tokens if u else 0, "timings": ev.timings or {},
        }

    def _prompt_text(self, ctx: ServerContext, sub: RawSubmission) -> str:
        return ctx.tokenizer.decode(sub.prompt_ids, skip_special=False)

    async def _aggregate(self, ctx: ServerContext, plan: LlamaPlan, sub: RawSubmission) -> dict:
        texts: list[str] = []
        ids: list[int] = []
        async for ev in sub.handle.events():
            if ev.kind == "delta":
                texts.append(ev.text)
                ids.extend(ev.token_ids)
            elif ev.kind == "error":
                raise ev.error
            elif ev.kind == "finish":
                if ev.finish_reason == "cancelled":
                    raise cancelled_error()
                return self._final(ctx, plan, sub, ev, "".join(texts), ids, self._prompt_text(ctx, sub))
        raise unfinished_error()

    async def _stream(self, ctx: ServerContext, plan: LlamaPlan, sub: RawSubmission) -> AsyncIterator[str]:
        live = StreamTimings(len(sub.prompt_ids))
        ids: list[int] = []
        total = len(sub.prompt_ids)
        progress_done = False

        def chunk(content: str, **extra: Any) -> str:
            obj = {"index": 0, "content": content, "tokens": [], "stop": False, "id_slot": NO_SLOT,
                   "tokens_predicted": len(ids), "tokens_evaluated": total}
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
                        if ev.text:
                            yield chunk(ev.text)
                    elif ev.kind == "error":
                        yield sse_data(engine_error_body(ev.error))
                        return
                    elif ev.kind == "finish":
                        if ev.finish_reason == "cancelled":
                            yield sse_data(engine_error_body(cancelled_error()))
                            return
                        if plan.return_progress and not progress_done:
                            yield progress(final=True)
                        final = self._final(ctx, plan, sub, ev, "", ids, self._prompt_text(ctx, sub))
                        yield sse_data(select_fields(final, plan.response_fields))
                        return
        except Exception as e:  # noqa: BLE001 - headers are sent: the failure travels as an error event
            log.exception("completion stream failed")
            yield sse_data(engine_error_body(internal_error(e)))
            return
        yield sse_data(engine_error_body(unfinished_error()))


PROTOCOL = LlamaCompletion()


@hookimpl
def ninfer_register_protocols(register):
    register("llamacpp", "ninfer_core.protocols.llamacpp:PROTOCOL")
