"""The server's one ASGI middleware: headers, readiness, the doubled /v1 prefix, CORS, auth, body size.

Written as plain ASGI (not BaseHTTPMiddleware) so streamed responses and client disconnects pass
through untouched. Order of the checks, outermost first:
  1. every response gets X-NInfer-Version and a fresh x-request-id (req_<hex>);
  2. /v1/v1/... is served as /v1/... (OpenAI SDKs given the /v1 base URL double the prefix);
  3. until the model is warm every route answers 503 model_loading with Retry-After: 2;
  4. --cors / --cors-origins answer preflights and decorate responses as llama-server does (the
     Origin reflected, credentials allowed); an Origin --cors-origins does not list is 403;
  5. --api-key: Bearer or x-api-key, compared in constant time (GET /health, /v1/health and
     preflights exempt);
  6. --max-request-mib: 413 before JSON parsing (Content-Length, or counted while streaming in).
"""

from __future__ import annotations

import hmac
import logging
import secrets
from urllib.parse import urlsplit

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ninfer_core.server.access_log import AccessRecord
from ninfer_core.server.context import ServerContext
from ninfer_core.server.errors import (
    RequestTooLarge,
    anthropic_error_response,
    error_response,
    is_anthropic_path,
    shaped_error_response,
    too_large_response,
)
from ninfer_core.version import build_string

log = logging.getLogger("ninfer.server")

LOADING_MESSAGE = "The model is still loading. Retry shortly."
# Seconds a client should wait before retrying a refusal that passes (overload, loading, a queue
# timeout or a stop), unless the response set its own.
RETRY_AFTER = {429: "1", 503: "2", 529: "1"}
# llama-server's --cors-methods default; NInfer's routes use no other method
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
CORS_HEADERS = ["authorization", "content-type", "x-api-key", "x-request-id", "accept",
                "openai-organization", "openai-project", "x-stainless-lang", "anthropic-version"]


def new_request_id() -> str:
    return "req_" + secrets.token_hex(12)


class ServerMiddleware:
    def __init__(self, app: ASGIApp, ctx: ServerContext):
        self.app = app
        self.ctx = ctx
        key = ctx.options.api_key
        self._key = key.encode("utf-8") if key else None
        self._limit = ctx.options.max_request_mib * (1 << 20)
        self._version = build_string()
        self._origins = ctx.options.cors_origins  # None: any origin (--cors)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("state", {}).get("routed"):
            # routed: a router's front already applied these checks (ninfer_core.router.front)
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        _undouble_v1(scope)
        headers = Headers(scope=scope)
        method = scope["method"]
        origin = headers.get("origin")
        cors = self.ctx.options.cors and origin is not None
        refused_origin = cors and not self._origin_allowed(origin, headers.get("host"))
        cors = cors and not refused_origin
        started = False
        # Anthropic routes carry their request id as `request-id` (their own header contract).
        anthropic = is_anthropic_path(scope["path"])
        id_header = "request-id" if anthropic else "x-request-id"

        record = AccessRecord(method, scope["path"], request_id)

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                hs = MutableHeaders(scope=message)
                hs["X-NInfer-Version"] = self._version
                if id_header not in hs:
                    hs[id_header] = request_id
                status = message["status"]
                if status in RETRY_AFTER and "retry-after" not in hs:
                    hs["Retry-After"] = RETRY_AFTER[status]
                record.on_start(status, hs.get("content-type", ""))
                if cors:
                    # llama-server reflects the Origin and allows credentials (cookies, Authorization)
                    hs["Access-Control-Allow-Origin"] = origin
                    hs["Access-Control-Allow-Credentials"] = "true"
                    hs.add_vary_header("Origin")
                    hs["Access-Control-Expose-Headers"] = f"{id_header}, X-NInfer-Version, Retry-After"
            elif message["type"] == "http.response.body":
                record.on_body(message.get("body", b""))
            await send(message)

        try:
            await self._serve(scope, receive, send_wrapper, request_id, anthropic, headers, origin, refused_origin)
        except Exception:
            log.exception("internal error on %s %s", method, scope.get("path"))
            if not started:
                resp = shaped_error_response(scope, 500, "Internal server error.", "server_error",
                                             "internal_error")
                await resp(scope, receive, send_wrapper)
        finally:
            record.done()

    async def _serve(self, scope: Scope, receive: Receive, send_wrapper: Send, request_id: str, anthropic: bool,
                     headers: Headers, origin: str | None, refused_origin: bool) -> None:
        method = scope["method"]
        failed = self.ctx.engine_failure
        if failed is not None:  # the engine latched unavailable: every route says so until the exit
            resp = shaped_error_response(scope, 503, f"The engine failed and the server is stopping: {failed}",
                                         "service_unavailable", "engine_failed")
            await resp(scope, receive, send_wrapper)
            return
        if not self.ctx.ready:
            if anthropic:  # the spec's exact Anthropic loading envelope (no code field)
                resp = anthropic_error_response(503, LOADING_MESSAGE, request_id,
                                                headers={"Retry-After": "2"})
            else:
                resp = error_response(503, LOADING_MESSAGE, "service_unavailable", "model_loading",
                                      headers={"Retry-After": "2"})
            await resp(scope, receive, send_wrapper)
            return
        preflight = method == "OPTIONS" and "access-control-request-method" in headers
        if refused_origin:
            resp = shaped_error_response(
                scope, 403, f"The origin {origin!r} is not allowed (--cors-origins).", "permission_error",
                "cors_origin_not_allowed")
            await resp(scope, receive, send_wrapper)
            return
        if preflight and self.ctx.options.cors:
            await _preflight(headers)(scope, receive, send_wrapper)
            return
        exempt = preflight or (method in ("GET", "HEAD") and scope["path"] in ("/health", "/v1/health")) or \
            self._keyless(scope)
        if self._key is not None and not exempt and not self._authorized(headers):
            resp = shaped_error_response(
                scope, 401, "Invalid or missing API key. Send it as 'Authorization: Bearer <key>' or "
                "'x-api-key: <key>'.", "authentication_error", "invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"})
            await resp(scope, receive, send_wrapper)
            return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._limit:
            resp = too_large_response(self._limit)
            if anthropic:
                resp = shaped_error_response(scope, 413, RequestTooLarge(self._limit).args[0],
                                             code="request_too_large")
            await resp(scope, receive, send_wrapper)
            return
        gate = self.ctx.gate  # the lifecycle API and model suspend (ninfer_core.router.single)
        if gate is not None:
            await gate(scope, self._limited(receive), send_wrapper, self.app)
            return
        await self.app(scope, self._limited(receive), send_wrapper)

    def _origin_allowed(self, origin: str, host: str | None) -> bool:
        """--cors allows every origin; --cors-origins the listed ones ("*" any, "localhost" a page
        served from this machine), and always this server's own pages (Origin = Host), so a WebUI
        it serves keeps working. A request from any other origin is refused: a cross-site form
        POST needs no preflight, so leaving out the CORS headers alone would not stop it."""
        allowed = self._origins
        if allowed is None or "*" in allowed or origin in allowed:
            return True
        parts = urlsplit(origin)
        if host is not None and parts.netloc == host:
            return True
        return "localhost" in allowed and (parts.hostname or "") in LOCAL_HOSTS
    def _keyless(self, scope: Scope) -> bool:
        """The WebUI's static files, and the --webui-mcp-proxy relay (which carries the WebUI's own
        Authorization for its target), need no API key (spec "WebUI")."""
        if scope["path"] == "/cors-proxy":
            return self.ctx.options.webui_mcp_proxy
        webui = self.ctx.webui
        return webui is not None and webui.is_static(scope)

    def _authorized(self, headers: Headers) -> bool:
        candidates = []
        auth = headers.get("authorization")
        if auth:
            scheme, _, token = auth.partition(" ")
            if scheme.lower() == "bearer":
                candidates.append(token.strip())
        if headers.get("x-api-key") is not None:
            candidates.append(headers["x-api-key"].strip())
        ok = False
        for c in candidates:
            # Every candidate is compared, so timing does not reveal which header matched.
            ok |= hmac.compare_digest(c.encode("utf-8"), self._key)
        return ok

    def _limited(self, receive: Receive) -> Receive:
        limit = self._limit
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise RequestTooLarge(limit)
            return message

        return limited_receive


def _undouble_v1(scope: Scope) -> None:
    path = scope["path"]
    if path == "/v1/v1" or path.startswith("/v1/v1/"):
        scope["path"] = path[3:]
        raw = scope.get("raw_path")
        if isinstance(raw, bytes) and raw.startswith(b"/v1/v1"):
            scope["raw_path"] = raw[3:]


def _preflight(headers: Headers) -> Response:
    allowed = list(CORS_HEADERS)
    for h in headers.get("access-control-request-headers", "").split(","):
        h = h.strip().lower()
        if h and h not in allowed:
            allowed.append(h)
    # 200 with an empty body, as llama-server answers a preflight. Its Allow-Headers is "*", which a
    # browser does not read as a wildcard on a credentialed request: the asked headers are named.
    return Response(status_code=200, headers={
        "Access-Control-Allow-Methods": CORS_METHODS,
        "Access-Control-Allow-Headers": ", ".join(allowed),
        "Access-Control-Max-Age": "600",
    })
