"""Resumable streams, as llama-server keeps them for its WebUI (X-Conversation-Id).

A streamed Chat Completion whose request carries `X-Conversation-Id` is produced into a session
buffer instead of straight into its HTTP response, so it survives the client going away (a page
reload, a phone's tab in the background): the generation runs on, and the client reads the bytes
again from any offset with GET /v1/stream?conv_id=ID&from=N. One conversation has at most one live
session: a new request with the same id cancels the previous one. POST /v1/streams/lookup reports
the sessions of the ids the caller names (never others, so ids cannot be enumerated); DELETE
/v1/stream?conv_id=ID is the user's Stop: it cancels the generation and drops the buffer.

A session keeps the newest 4 MiB (older bytes are dropped; a read from a dropped offset is refused)
and is forgotten 300 s after it completed. Everything here runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from typing import AsyncIterator, Callable

log = logging.getLogger("ninfer.server")

SESSION_MAX_BYTES = 4 * 1024 * 1024
SESSION_TTL_S = 300.0


class StreamSession:
    def __init__(self, conversation_id: str, max_bytes: int = SESSION_MAX_BYTES):
        self.conversation_id = conversation_id
        self.started_at = int(time.time())
        self.completed_at = 0
        self.max_bytes = max_bytes
        self.buffer = bytearray()
        self.dropped = 0  # bytes evicted from the front
        self.done = False
        self.cancelled = False
        self._changed = asyncio.Event()
        self._cancel: Callable[[], None] | None = None
        self.task: asyncio.Task | None = None
        self._done_at = 0.0

    @property
    def total_bytes(self) -> int:
        return self.dropped + len(self.buffer)

    def append(self, data: bytes) -> None:
        if self.done or not data:
            return
        self.buffer += data
        over = len(self.buffer) - self.max_bytes
        if over > 0:
            del self.buffer[:over]
            self.dropped += over
        self._wake()

    def finalize(self) -> None:
        if not self.done:
            self.done = True
            self.completed_at = int(time.time())
            self._done_at = time.monotonic()
            self._wake()

    def cancel(self) -> None:
        """The user's Stop: end the generation behind it and let every reader go."""
        if not self.cancelled:
            self.cancelled = True
            if self._cancel is not None:
                self._cancel()
        self.finalize()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def read(self, offset: int) -> AsyncIterator[str]:
        """The session's bytes from `offset`, then live ones until it completes (as SSE text)."""
        while True:
            if offset < self.dropped:
                return  # fell behind the kept window: the reader restarts (checked before serving)
            end = self.total_bytes
            if offset < end:
                chunk = bytes(self.buffer[offset - self.dropped:])
                offset = end
                yield chunk.decode("utf-8", "replace")
                continue
            if self.done:
                return
            await self._changed.wait()

    def expired(self, now: float) -> bool:
        return self.done and now - self._done_at > SESSION_TTL_S

    def info(self) -> dict:
        return {"conversation_id": self.conversation_id, "is_done": self.done, "total_bytes": self.total_bytes,
                "started_at": self.started_at, "completed_at": self.completed_at}


class StreamSessions:
    """Every live session of one server, by conversation id."""

    def __init__(self) -> None:
        self.sessions: dict[str, StreamSession] = {}

    def _gc(self) -> None:
        now = time.monotonic()
        for key in [k for k, s in self.sessions.items() if s.expired(now)]:
            del self.sessions[key]

    def get(self, conversation_id: str) -> StreamSession | None:
        self._gc()
        return self.sessions.get(conversation_id)

    def lookup(self, ids: list[str]) -> list[dict]:
        """The sessions of `ids`: each id matches its own session and its "<id>::<model>" ones."""
        self._gc()
        out = []
        for rid in ids:
            for key, s in self.sessions.items():
                if key == rid or key.startswith(rid + "::"):
                    out.append(s.info())
        return out

    def stop(self, conversation_id: str) -> bool:
        """DELETE /v1/stream: cancel and forget; False when no session had that id."""
        s = self.sessions.pop(conversation_id, None)
        if s is None:
            return False
        s.cancel()
        return True

    def start(self, conversation_id: str, body: AsyncIterator[str], cancel: Callable[[], None],
              on_close: Callable[[], None] | None = None) -> StreamSession:
        """Produce `body` into a new session (replacing and cancelling the id's previous one)."""
        self._gc()
        previous = self.sessions.pop(conversation_id, None)
        if previous is not None:
            previous.cancel()
        session = StreamSession(conversation_id)
        session._cancel = cancel
        self.sessions[conversation_id] = session

        async def produce() -> None:
            try:
                async with aclosing(body) as chunks:
                    async for chunk in chunks:
                        session.append(chunk.encode("utf-8"))
            except Exception:  # noqa: BLE001 - the stream's own error events are already in the bytes
                log.exception("stream session %s: producing failed", conversation_id[:64])
            finally:
                session.finalize()
                if on_close is not None:
                    on_close()

        session.task = asyncio.get_running_loop().create_task(produce())
        return session
