"""Built-in protocol plugin: the routes llama.cpp's WebUI calls beside Chat Completions.

* GET/POST /tools: 403 feature_disabled, what llama-server without tools answers (the WebUI then
  hides its server-tools panel).
* POST /v1/streams/lookup, GET /v1/stream, DELETE /v1/stream: resumable streams
  (ninfer_core.server.stream_sessions) of streamed Chat Completions sent with X-Conversation-Id.
* POST /v1/chat/completions/control {"id": "chatcmpl-...", "action": "reasoning_end"}: end a
  running completion's thinking now (its "Skip reasoning" button); the completion must have been
  sent with reasoning_control: true. Answers {"success": bool, "message"?} as llama-server does.
* GET/POST /cors-proxy: with --webui-mcp-proxy, relays the WebUI's MCP traffic to the http:// URL in
  `url`, forwarding the headers prefixed x-llama-server-proxy-header- (https is refused: there is no
  TLS client); without it, 403 feature_disabled. The relay takes no API key (server/middleware.py):
  the WebUI prefixes its own Authorization for the target along with every other header.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ninfer_core import hookimpl
from ninfer_core.engine.api import EngineError
from ninfer_core.server.context import ServerContext
from ninfer_core.server.errors import bad_request, error_response, parse_json_body
from ninfer_core.server.sse import EventStreamResponse
from ninfer_core.server.stream_sessions import StreamSessions

log = logging.getLogger("ninfer.server")

PROXY_HEADER_PREFIX = "x-llama-server-proxy-header-"
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "content-length",
                "content-encoding", "host"}


def feature_disabled() -> Response:
    return error_response(403, "this feature is disabled", "feature_disabled", "feature_disabled")


class WebUIRoutes:
    name = "webui"

    def mount(self, router: APIRouter, ctx: ServerContext) -> None:
        if ctx.live_completions is None:
            ctx.live_completions = {}
        if ctx.stream_sessions is None:
            ctx.stream_sessions = StreamSessions()

        async def tools(request: Request) -> Response:
            return feature_disabled()

        async def streams_lookup(request: Request) -> Response:
            data = parse_json_body(await request.body())
            ids = data.get("conversation_ids") if isinstance(data, dict) else None
            wanted = [i for i in ids if isinstance(i, str) and i] if isinstance(ids, list) else []
            return JSONResponse(ctx.stream_sessions.lookup(wanted))

        async def stream_get(request: Request) -> Response:
            conv = request.query_params.get("conv_id", "")
            if not conv:
                raise bad_request("missing_required_parameter", "Missing conversation id (conv_id).", "conv_id")
            session = ctx.stream_sessions.get(conv)
            if session is None:
                raise EngineError(404, "stream_not_found", "Stream not found or expired.", "conv_id")
            raw = request.query_params.get("from", "0")
            if not raw.isdigit():
                raise bad_request("invalid_value", "Invalid 'from' offset.", "from")
            offset = int(raw)
            if offset < session.dropped:
                raise bad_request("stream_offset_lost", "Stream offset lost, please restart.", "from")
            return EventStreamResponse(session.read(offset), on_disconnect=lambda: None)

        async def stream_delete(request: Request) -> Response:
            conv = request.query_params.get("conv_id", "")
            if not conv:
                raise bad_request("missing_required_parameter", "Missing conversation id (conv_id).", "conv_id")
            if not ctx.stream_sessions.stop(conv):
                log.info("stop on an unknown stream session (%d live)", len(ctx.stream_sessions.sessions))
            return Response(status_code=204)

        async def control(request: Request) -> Response:
            data = parse_json_body(await request.body())
            if not isinstance(data, dict):
                raise bad_request("invalid_type", "The request body must be a JSON object.", None)
            cid, action = data.get("id"), data.get("action")
            if not isinstance(cid, str) or not cid:
                raise bad_request("missing_required_parameter", "Missing completion id.", "id")
            if action != "reasoning_end":
                raise bad_request("invalid_value", "Unknown control action: the one action is reasoning_end.",
                                  "action")
            live = ctx.live_completions.get(cid)
            if live is None:
                return JSONResponse({"success": False, "message": "no active completion for this id"})
            handle, armed = live
            if not armed:
                return JSONResponse({"success": False,
                                     "message": "reasoning control not enabled for this completion"})
            end = getattr(ctx.engine, "end_reasoning", None)
            result = await asyncio.wrap_future(end(handle.request_id)) if end is not None else None
            if result is None:
                return JSONResponse({"success": False, "message": "no active completion for this id"})
            if result is False:
                return JSONResponse({"success": False,
                                     "message": "reasoning control not enabled for this completion"})
            return JSONResponse({"success": True})

        async def cors_proxy(request: Request) -> Response:
            if not ctx.options.webui_mcp_proxy:
                return feature_disabled()
            return await relay(request)

        router.add_api_route("/tools", tools, methods=["GET", "POST"])
        router.add_api_route("/v1/streams/lookup", streams_lookup, methods=["POST"])
        router.add_api_route("/v1/stream", stream_get, methods=["GET"])
        router.add_api_route("/v1/stream", stream_delete, methods=["DELETE"])
        router.add_api_route("/v1/chat/completions/control", control, methods=["POST"])
        router.add_api_route("/cors-proxy", cors_proxy, methods=["GET", "POST"])


async def relay(request: Request) -> Response:
    """Forward one WebUI MCP request to its http:// target and stream the answer back."""
    import httpx

    target = request.query_params.get("url", "")
    parts = urlsplit(target)
    if parts.scheme == "https":
        raise bad_request("unsupported_url_scheme", "https:// targets are not supported by the relay (it has no "
                          "TLS client); give an http:// URL.", "url")
    if parts.scheme != "http" or not parts.hostname:
        raise bad_request("invalid_value", "The 'url' query parameter must be an http:// URL with a host.", "url")
    if parts.password or parts.username:
        raise bad_request("invalid_value", "Credentials in the target URL are not supported.", "url")
    headers = {}
    for key, value in request.headers.items():
        k = key.lower()
        if k.startswith(PROXY_HEADER_PREFIX) and len(k) > len(PROXY_HEADER_PREFIX):
            headers[key[len(PROXY_HEADER_PREFIX):]] = value
    body = await request.body()
    log.info("cors-proxy: %s to %s:%s", request.method, parts.hostname, parts.port or 80)
    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0))
    try:
        upstream = await client.send(client.build_request(request.method, target, headers=headers, content=body),
                                     stream=True)
    except httpx.HTTPError as e:
        await client.aclose()
        return error_response(502, f"The relay could not reach its target: {type(e).__name__}.", "server_error",
                              "upstream_unreachable")

    out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}

    async def chunks():
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()
            await client.aclose()

    from starlette.responses import StreamingResponse

    return StreamingResponse(chunks(), status_code=upstream.status_code, headers=out_headers)


def is_relay_path(path: str) -> bool:
    return path == "/cors-proxy"


PROTOCOL = WebUIRoutes()


@hookimpl
def ninfer_register_protocols(register):
    register("webui", "ninfer_core.protocols.webui:PROTOCOL")

