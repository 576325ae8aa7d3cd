#!/usr/bin/env python3
"""A logging HTTP proxy in front of `ninfer serve`, for capturing what real clients send.

    python scripts/logging_proxy.py --upstream http://127.0.0.1:8080 --port 8081 --out requests.jsonl

Every request is forwarded unchanged (streamed both ways) and written to --out as one JSON line:
method, path, query, the request headers the client chose (credentials removed), the body (parsed
JSON when it is JSON), and the upstream's status. scripts/capture_clients.sh uses it to record the
request sequences of Claude Code and Codex; tests/e2e/test_e2e_client_fixtures.py replays them.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

# Never written to the capture: credentials, and hop-by-hop transport headers.
SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "proxy-authorization", "chatgpt-account-id"}
HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
               "upgrade", "accept-encoding"}


def build_app(upstream: str, out_path: str) -> Starlette:
    lock = threading.Lock()
    counter = {"n": 0}
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None, connect=10))

    def record(entry: dict) -> None:
        with lock:
            counter["n"] += 1
            entry["seq"] = counter["n"]
            with open(out_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry, ensure_ascii=False) + "\n")

    async def forward(request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        upstream_req = client.build_request(request.method, request.url.path, params=request.query_params,
                                            headers=headers, content=body)
        resp = await client.send(upstream_req, stream=True)
        entry = {
            "time": time.time(), "method": request.method, "path": request.url.path,
            "query": dict(request.query_params),
            "headers": {k: v for k, v in request.headers.items()
                        if k.lower() not in SECRET_HEADERS and k.lower() not in HOP_HEADERS},
            "status": resp.status_code,
        }
        try:
            entry["body"] = json.loads(body) if body else None
        except ValueError:
            entry["body_text"] = body.decode("utf-8", "replace")
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
        chunks: list[bytes] = []

        async def relay():
            try:
                async for chunk in resp.aiter_raw():
                    chunks.append(chunk)
                    yield chunk
            finally:
                await resp.aclose()
                if resp.status_code >= 400:  # an error's body says why; successful bodies are not kept
                    entry["error_body"] = b"".join(chunks).decode("utf-8", "replace")[:4000]
                record(entry)

        return StreamingResponse(relay(), status_code=resp.status_code, headers=out_headers)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upstream", required=True, help="base URL of the server behind the proxy")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True, help="JSON lines file the requests are appended to")
    a = p.parse_args()
    uvicorn.run(build_app(a.upstream.rstrip("/"), a.out), host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
