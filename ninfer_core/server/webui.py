"""Serving a built llama.cpp WebUI at GET / (spec "WebUI").

`ninfer serve` serves the files of a built WebUI directory: --webui-dir DIR, or by default the one
scripts/fetch-webui.sh builds (`default_webui_dir()`), when it exists; --no-webui serves none. The
static files need no API key (server/middleware.py asks `is_static`); the API routes the UI calls
still do. Any other GET outside the API (no API route matches it and it is not under /v1) returns
the entry page, for the UI's client-side router. Files are read from disk per request with
Starlette's FileResponse (ranges, ETag, Last-Modified); paths cannot leave the directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Match

ENTRY = "index.html"
WEBUI_RELEASE = "llama-cpp-python-0.3.36"  # the sdist scripts/fetch-webui.sh builds the WebUI from


class WebUIError(Exception):
    pass


def default_webui_dir() -> Path:
    """Where scripts/fetch-webui.sh puts its build: $NINFER_WEBUI_DIR, else the NInfer cache."""
    env = os.environ.get("NINFER_WEBUI_DIR")
    if env:
        return Path(env)
    cache = Path(os.environ.get("NINFER_CACHE_DIR") or Path.home() / ".cache" / "ninfer")
    return cache / "webui" / WEBUI_RELEASE


def resolve_webui_dir(webui_dir: str | None, no_webui: bool) -> Path | None:
    """The directory to serve, or None. An explicit --webui-dir without an entry page is an error."""
    if no_webui:
        return None
    if webui_dir:
        root = Path(webui_dir).resolve()
        if not (root / ENTRY).is_file():
            raise WebUIError(f"--webui-dir {webui_dir}: no {ENTRY} there (build one with scripts/fetch-webui.sh)")
        return root
    root = default_webui_dir()
    return root.resolve() if (root / ENTRY).is_file() else None


class WebUI:
    """The static files of one built WebUI."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self.api_routes: list = []  # the app's API routes (set by install): anything they match is API

    def file_for(self, path: str) -> Path:
        rel = path.lstrip("/")
        if rel:
            candidate = (self.root / rel).resolve()
            if candidate.is_relative_to(self.root) and candidate.is_file():
                return candidate
        return self.root / ENTRY

    def is_static(self, scope) -> bool:
        """A GET/HEAD the WebUI answers: outside /v1 and matching no API route (any method)."""
        if scope.get("method") not in ("GET", "HEAD"):
            return False
        path = scope.get("path", "")
        if path == "/v1" or path.startswith("/v1/"):
            return False
        for route in self.api_routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return False
        return True

    def response(self, path: str) -> Response:
        f = self.file_for(path)
        # The entry page names the current build's assets: it must not be cached past a rebuild.
        headers = {"Cache-Control": "no-cache"} if f.name == ENTRY else None
        return FileResponse(f, headers=headers)


def install(app, ctx) -> None:
    """Serve ctx.webui (when set) for every GET/HEAD no API route takes; call after the protocols
    are mounted (the catch-all route must come last). Other requests the API routes do not take get
    what the router would have answered without it: 405 where a route has the path, else 404."""
    webui = ctx.webui
    if webui is None:
        return
    webui.api_routes = list(app.router.routes)

    async def static(request: Request) -> Response:
        if webui.is_static(request.scope):
            return webui.response(request.url.path)
        partial = any(route.matches(request.scope)[0] is Match.PARTIAL for route in webui.api_routes)
        raise StarletteHTTPException(405 if partial else 404)

    app.add_api_route("/{path:path}", static, methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"],
                      include_in_schema=False)
