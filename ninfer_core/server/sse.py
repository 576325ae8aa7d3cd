"""Server-sent events and client-disconnect helpers shared by the generation protocols."""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

KEEPALIVE = ": keep-alive\n\n"
DONE = "data: [DONE]\n\n"


# One encoder for every event: json.dumps with non-default options builds a new JSONEncoder per
# call; this is the same encoding (compact separators, UTF-8 text kept as is) without that cost.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
json_text = _ENCODER.encode


def sse_data(obj: Any) -> str:
    return f"data: {json_text(obj)}\n\n"


class ClientDisconnected(Exception):
    """The client went away before the response was complete."""


class EventStreamResponse(Response):
    """Streams SSE text from an async iterator; a client disconnect calls `on_disconnect` at once.

    Starlette's StreamingResponse notices a disconnect only on some ASGI spec versions; this one
    always watches `receive` beside the writer, so a dropped client cancels its engine request
    even while the stream is waiting for the next event.
    """

    def __init__(self, body: AsyncIterator[str], on_disconnect: Callable[[], None],
                 on_close: Callable[[], None] | None = None, headers: dict[str, str] | None = None):
        self.status_code = 200
        self.background = None
        self.raw_headers = []
        self.body_iterator = body
        self.on_disconnect = on_disconnect  # the stream ended early: cancel the work behind it
        self.on_close = on_close  # always, once, when the response is over
        self.extra_headers = headers or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
        raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.extra_headers.items()]
        completed = False
        try:
            await send({"type": "http.response.start", "status": 200, "headers": raw})
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            tg.cancel_scope.cancel()
                            return

                tg.start_soon(watch)
                try:
                    async for chunk in self.body_iterator:
                        await send({"type": "http.response.body", "body": chunk.encode("utf-8"),
                                    "more_body": True})
                    completed = True
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:
                    pass
                finally:
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                if not completed:
                    self.on_disconnect()
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                if self.on_close is not None:
                    self.on_close()


async def with_keepalive(events: AsyncIterator[T], interval_s: float) -> AsyncIterator[T | None]:
    """Yield the items of `events`, and None whenever `interval_s` passes without one.

    The pending `__anext__` is never cancelled by a timeout (cancelling it would close the
    engine's iterator); it is awaited again on the next turn. An engine handle's stream
    (`batches`, see `event_batches`) is read without a task and a wait per event.
    """
    if hasattr(events, "batches"):
        async for batch in events.batches(interval_s):
            if batch is None:
                yield None
            else:
                for item in batch:
                    yield item
        return
    it = events.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            fut, pending = pending, None
            try:
                item = fut.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()


async def event_batches(events: AsyncIterator[T], interval_s: float) -> AsyncIterator[list[T] | None]:
    """Like `with_keepalive`, but yields lists: every event already delivered when the reader gets
    to them (an engine handle's stream hands over a decode round's backlog at once), so a stream
    that fell behind writes its pending events as one body chunk. Other iterators: one-item lists."""
    if hasattr(events, "batches"):
        async for batch in events.batches(interval_s):
            yield batch
        return
    async with aclosing(with_keepalive(events, interval_s)) as items:
        async for item in items:
            yield None if item is None else [item]


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T], on_disconnect: Callable[[], None]) -> T:
    """Await `work`; if the client disconnects first, call `on_disconnect` and raise ClientDisconnected.

    The request body must already have been read: afterwards `receive` only reports the disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        on_disconnect()
        task.cancel()
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
