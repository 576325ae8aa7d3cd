"""X-NInfer-Draft-Session: the header that binds a request to a draft session (spec
`--ngram-archive-mib`): its finished requests' prompt and output text become n-gram copy sources
for the session's later requests.

The middleware reads the header into a context variable for the duration of the request; the
engine wrapper copies it into each GenerationRequest the protocols submit, so no protocol needs to
know about it. Installed only when the server has an n-gram archive.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
from typing import Any

HEADER = b"x-ninfer-draft-session"
MAX_LEN = 256

log = logging.getLogger("ninfer.server")
_session: contextvars.ContextVar[str | None] = contextvars.ContextVar("ninfer_draft_session", default=None)


class DraftSessionMiddleware:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        value = None
        for name, raw in scope.get("headers") or ():
            if name.lower() == HEADER:
                text = raw.decode("latin-1").strip()
                if 0 < len(text) <= MAX_LEN and text.isprintable():
                    value = text
                else:  # (the value itself is a client string: never logged)
                    log.warning("ignored an X-NInfer-Draft-Session header of %d characters", len(text))
        token = _session.set(value)
        try:
            await self.app(scope, receive, send)
        finally:
            _session.reset(token)


class DraftSessionEngine:
    """The Engine as protocols see it: every attribute is the Engine's; `submit` carries the
    request's draft session into the GenerationRequest."""

    def __init__(self, engine: Any):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def submit(self, request: Any) -> Any:
        session = _session.get()
        if session is not None and getattr(request, "draft_session", None) is None:
            request = dataclasses.replace(request, draft_session=session)
        return self._engine.submit(request)
