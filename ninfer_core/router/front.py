"""The router's front door: find the model a request names, make it ready, hand the request to it.

A POST names its model in the JSON body's `model`, a GET in the `model` query parameter (GET
/v1/models/{id}... in the path); a request that names none gets the most recently used loaded
model. Which requests may load or wake a model (spec "Several models (router)"):
- generation and session routes (every other POST) load an unloaded model and wake a sleeping one;
- host-side routes (tokenize, detokenize, apply-template) need the model's tokenizer: they load
  an unloaded model but run on a sleeping one without waking it (the spec's list);
- token counts (Anthropic count_tokens, the input_tokens routes) run the generation path's
  preparation and count as generation requests: they wake a sleeping model, as llama.cpp's
  test_server_sleep_token_counting_wake expects and as the spec, which exempts only the three
  routes above, implies;
- reads (GET) never load or wake: they report a sleeping model as it is, and an unloaded model
  is 503 model_not_loaded.
Only routed requests count as use (LRU order, idle timers); reads do not keep a model awake.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ninfer_core.engine.api import EngineError
from ninfer_core.router.manager import ModelManager
from ninfer_core.router.slots import LOADED, SLEEPING, ModelSlot
from ninfer_core.server.errors import RequestTooLarge, shaped_error_response

HOST_ONLY = {"/tokenize", "/detokenize", "/apply-template"}
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def error(scope: Scope, err: EngineError):
    return shaped_error_response(scope, err.status, err.message, err.type, err.code, err.param)


def query(scope: Scope) -> dict[str, list[str]]:
    return parse_qs((scope.get("query_string") or b"").decode("latin-1"), keep_blank_values=True)


def autoload_of(scope: Scope, default: bool) -> bool:
    """?autoload=0|1 overrides --models-autoload for one request."""
    values = query(scope).get("autoload")
    if not values:
        return default
    v = values[-1].strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise EngineError(400, "invalid_value", f"autoload must be 0 or 1, got {values[-1]!r}", param="autoload")


async def read_body(receive: Receive) -> tuple[bytes, list[Message]]:
    chunks, messages = [], []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks), messages


def body_model(body: bytes) -> str | None:
    """The body's `model` when it is a JSON object with a string model; the model's own route
    then reports any malformed body in its own protocol's shape."""
    try:
        data = json.loads(body) if body else None
    except (ValueError, RecursionError):  # the model's route reports it in its own shape
        return None
    m = data.get("model") if isinstance(data, dict) else None
    return m if isinstance(m, str) and m else None


def replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def again() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return again


class RouterFront:
    """ASGI: the router's own routes (`own`), else the named model's app."""

    def __init__(self, own: ASGIApp, manager: ModelManager, own_paths: set[tuple[str, str]], single: bool = False):
        self.own, self.manager, self.own_paths = own, manager, own_paths
        self.single = single

    def _is_own(self, method: str, path: str, named: bool) -> bool:
        if path.startswith("/v1/models/") and path.rsplit("/", 1)[-1] in ("residency", "suspend", "resume"):
            return True
        if (method, path) in self.own_paths:
            # /props and /v1/models with ?model= are the model's own; without it the router's
            return not (named and path in ("/props", "/metrics", "/slots", "/v1/load", "/stats"))
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send, inner: ASGIApp | None = None) -> None:
        if scope["type"] != "http":
            await self.own(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        q = query(scope)
        name = (q.get("model") or [None])[-1]
        if method in ("HEAD", "OPTIONS") and inner is not None:
            await inner(scope, receive, send)
            return
        if method in ("HEAD", "OPTIONS") or self._is_own(method, path, bool(name)):
            await self.own(scope, receive, send)
            return
        messages: list[Message] = []
        if method == "POST" and not self.single:  # the one model of a single server needs no name
            try:
                body, messages = await read_body(receive)
            except RequestTooLarge as e:
                await shaped_error_response(scope, 413, e.args[0], code="request_too_large")(scope, receive, send)
                return
            name = body_model(body) or name
        elif method == "GET" and path.startswith("/v1/models/"):
            name = path[len("/v1/models/"):]
        try:
            slot = self._slot(name) if not self.single else self.manager.slots[0]
            if self.single and method != "POST":  # the one model's reads answer as before, loaded or not
                await inner(scope, replay(messages, receive), send)
                return
            await self._forward(slot, scope, replay(messages, receive), send, method, path, inner)
        except EngineError as e:
            await error(scope, e)(scope, receive, send)

    def _slot(self, name: str | None) -> ModelSlot:
        m = self.manager
        if name:
            slot = m.find(name)
            if slot is None:
                if self.single and m.slots[0].ctx is not None and m.slots[0].ctx.serves_model(name):
                    return m.slots[0]
                known = ", ".join(sorted(s.name for s in m.listed()))
                raise EngineError(404, "model_not_found", f"The model '{name}' does not exist; this server serves: "
                                  f"{known}.", param="model")
            return slot
        slot = m.default_slot()
        if slot is None:
            raise EngineError(400, "model_required", "Name the model in the request's 'model' field (or the model "
                              "query parameter): no model is loaded to default to.", param="model")
        return slot

    async def _forward(self, slot: ModelSlot, scope: Scope, receive: Receive, send: Send, method: str,
                       path: str, inner: ASGIApp | None = None) -> None:
        m = self.manager
        generation = method == "POST" and path not in HOST_ONLY
        reading = method not in ("POST",)
        m.enter(slot)
        try:
            if slot.engine_failed is not None and slot.status == LOADED:
                raise EngineError(503, "engine_failed", f"The model '{slot.name}' failed and is being unloaded: "
                                  f"{slot.engine_failed}. Retry to load it again.")
            if reading:
                if slot.status not in (LOADED, SLEEPING) or slot.ctx is None:
                    raise EngineError(503, "model_not_loaded", f"The model '{slot.name}' is not loaded.",
                                      param="model")
            elif not slot.ready and not (not generation and slot.status == SLEEPING and not slot.moving):
                sleeping = slot.status == SLEEPING
                allowed = autoload_of(scope, m.autoload)
                if sleeping and slot.loaded is not None and not slot.loaded.residency.auto_resume:
                    allowed = False
                if not allowed and not slot.moving:
                    what = "asleep" if sleeping else "not loaded"
                    raise EngineError(503, "model_not_loaded", f"The model '{slot.name}' is {what} and autoload is "
                                      "off: load it with POST /models/load first.", param="model")
                receive = await acquire_watching(m, slot, generation, receive)
                if receive is None:  # the client left while it waited: nothing to answer
                    return
            if m.fake_timing_s and inner is None:
                await asyncio.sleep(m.fake_timing_s)
            if inner is not None:  # a single-model server: its own app, below its middleware
                await inner(scope, receive, send)
            else:
                await slot.loaded.app(_routed(scope), receive, send)
        finally:
            m.leave(slot, used=not reading)


async def acquire_watching(m: ModelManager, slot: ModelSlot, wake: bool, receive: Receive) -> Receive | None:
    """m.acquire, given up when the client disconnects meanwhile (None then): a request that leaves
    while it waits for room gives its place in the queue up, so it costs no model its place.
    uvicorn reports the disconnect only to a pending receive(), hence the watcher; what it reads
    before (a body not read yet) is replayed to the model's app."""
    seen: list[Message] = []

    async def watch() -> None:
        while True:
            message = await receive()
            seen.append(message)
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.create_task(watch())
    waiting = asyncio.create_task(m.acquire(slot, wake=wake))
    try:
        await asyncio.wait({watcher, waiting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (watcher, waiting):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    if waiting.cancelled():
        return None
    waiting.result()  # EngineError: the load failed, no room in time
    return replay(seen, receive)


def _routed(scope: Scope) -> dict[str, Any]:
    """The model's own middleware then leaves headers, auth and readiness to the router's."""
    scope = dict(scope)
    scope["state"] = dict(scope.get("state") or {}, routed=True)
    return scope
