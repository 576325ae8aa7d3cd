"""One console line per HTTP request (spec "console log"): method, path, status, the error code of a
refused request, duration. Never the body, the query string or a header value, so no prompt,
output or API key reaches the log.

Polling routes (health, metrics, load, stats, props, model lists, slots) log at debug, so a load
balancer's probes do not bury the requests; every other request, rejected ones included, logs at info.
"""

from __future__ import annotations

import json
import logging
import time

log = logging.getLogger("ninfer.http")

POLLING = frozenset({"/health", "/v1/health", "/metrics", "/v1/load", "/stats", "/props", "/v1/models", "/models",
                     "/slots", "/v1"})
_CAPTURE = 16 * 1024  # bytes of an error body read for its code


class AccessRecord:
    """Collects what one response says about itself; `done()` writes the line."""

    def __init__(self, method: str, path: str, request_id: str):
        self.method, self.path, self.request_id = method, path, request_id
        self.t0 = time.monotonic()
        self.status = 0
        self.streamed = False
        self._json = False
        self._body = bytearray()

    def on_start(self, status: int, content_type: str) -> None:
        self.status = status
        self.streamed = content_type.startswith("text/event-stream")
        self._json = status >= 400 and content_type.startswith("application/json")

    def on_body(self, chunk: bytes) -> None:
        if self._json and len(self._body) < _CAPTURE:
            self._body += chunk[: _CAPTURE - len(self._body)]

    def error_fields(self) -> str:
        """` code=X param=Y` of an error body (both envelopes), or ""."""
        if not self._body:
            return ""
        try:
            err = json.loads(bytes(self._body)).get("error") or {}
        except (ValueError, AttributeError):
            return ""
        if not isinstance(err, dict):
            return ""
        name = err.get("code") or err.get("type")  # the Anthropic envelope may carry only a type
        parts = [f"code={name}"] if isinstance(name, str) and name else []
        if isinstance(err.get("param"), str) and err["param"]:
            parts.append(f"param={err['param']}")
        return (" " + " ".join(parts)) if parts else ""

    def done(self, disconnected: bool = False) -> None:
        level = logging.DEBUG if self.method in ("GET", "HEAD") and self.path in POLLING and self.status < 400 \
            else logging.INFO
        if not log.isEnabledFor(level):
            return
        ms = (time.monotonic() - self.t0) * 1000.0
        tail = " (stream)" if self.streamed else ""
        if disconnected:
            tail += " (client disconnected)"
        log.log(level, "%s %s %s %d%s in %.0f ms%s", self.request_id, self.method, self.path, self.status,
                self.error_fields(), ms, tail)
