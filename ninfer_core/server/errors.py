"""The one error mapper: every failure leaves the server in the OpenAI error envelope.

{"error": {"message", "type", "param", "code"}}. EngineError carries its own status/code/param;
pydantic validation errors become 400 invalid_request_error with `param` the field path
(`messages[0].role`, OpenAI's notation; code builds paths with dots and `wire_param` converts them) and `code` invalid_type / invalid_value / missing_required_parameter (or the
code a validator raised through `request_error`); malformed JSON is 400 invalid_json.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ninfer_core.engine.api import EngineError
from ninfer_core.server.json_body import parse_json_body  # noqa: F401 - the protocols import it from here

log = logging.getLogger("ninfer.server")

# Codes a validator may raise with `request_error`; they pass through the mapper unchanged.
_MISSING = {"missing", "missing_argument", "missing_keyword_argument"}
_TYPE_ERRORS = {
    "string_type", "int_type", "float_type", "bool_type", "list_type", "dict_type", "model_type",
    "model_attributes_type", "int_from_float", "int_parsing", "float_parsing", "bool_parsing",
    "is_instance_of", "union_tag_invalid", "tuple_type", "set_type", "none_required", "dataclass_type",
    "arguments_type", "string_unicode", "bytes_type", "json_type",
}


_INDEX = re.compile(r"\.(\d+)(?=\.|\[|$)")


_QUOTED_PATH = re.compile(r"'([A-Za-z_]\w*(?:\.\w+)+)'")


def wire_param(param: str | None) -> str | None:
    """A field path as clients see it: `messages.2.tool_calls.0` -> `messages[2].tool_calls[0]`."""
    return _INDEX.sub(r"[\1]", param) if param else param


def wire_message(message: str) -> str:
    """The same notation for the field paths a message quotes ('tools.0.name')."""
    return _QUOTED_PATH.sub(lambda m: f"'{wire_param(m.group(1))}'", message)


def error_body(message: str, type_: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": wire_message(message), "type": type_, "param": wire_param(param), "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code, param), status_code=status, headers=headers)


# -- the Anthropic Messages envelope -------------------------------------------------------------
# /v1/messages and /v1/messages/count_tokens answer every error as
# {"type": "error", "error": {"type", "message"[, "code", "param"]}, "request_id": "req_..."}
# with a `request-id` header (spec: Anthropic Messages, Startup readiness). `code` and `param`
# are NInfer additions that Anthropic clients ignore; they name the failure and the field.
ANTHROPIC_ROUTE = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error"}
# Failures that are a deadline passing (queue wait, media acquisition): HTTP 504 on Messages.
TIMEOUT_CODES = frozenset({"request_queue_timeout", "media_timeout", "media_fetch_timeout"})


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_ROUTE or path.startswith(ANTHROPIC_ROUTE + "/")


def anthropic_status(status: int, code: str | None) -> int:
    """The HTTP status on a Messages route: local overload is 529, deadlines are 504."""
    if code == "server_overloaded":
        return 529
    if code in TIMEOUT_CODES:
        return 504
    return status


def anthropic_error_body(status: int, message: str, request_id: str, code: str | None = None,
                         param: str | None = None) -> dict:
    """The Anthropic error object for an already-mapped `status` (see anthropic_status)."""
    type_ = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    err: dict[str, Any] = {"type": type_, "message": wire_message(message)}
    if code:
        err["code"] = code
    if param:
        err["param"] = wire_param(param)
    return {"type": "error", "error": err, "request_id": request_id}


def anthropic_error_response(status: int, message: str, request_id: str, code: str | None = None,
                             param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    status = anthropic_status(status, code)
    return JSONResponse(anthropic_error_body(status, message, request_id, code, param), status_code=status,
                        headers=headers)


def shaped_error_response(scope: Any, status: int, message: str, type_: str = "invalid_request_error",
                          code: str | None = None, param: str | None = None,
                          headers: dict[str, str] | None = None) -> JSONResponse:
    """The error in the envelope of the route that failed: Anthropic on /v1/messages*, else OpenAI."""
    if is_anthropic_path(scope.get("path", "")):
        request_id = scope.get("state", {}).get("request_id", "")
        return anthropic_error_response(status, message, request_id, code, param, headers)
    return error_response(status, message, type_, code, param, headers)


def engine_error_body(err: EngineError) -> dict:
    return error_body(err.message, err.type, err.code, err.param)


def engine_error_response(err: EngineError) -> JSONResponse:
    return JSONResponse(engine_error_body(err), status_code=err.status)


def internal_error(exc: BaseException) -> EngineError:
    """A failure after a stream's headers went out: named by its exception type only (no text)."""
    return EngineError(500, "internal_error", f"Internal server error: {type(exc).__name__}", type_="server_error")


def bad_request(code: str, message: str, param: str | None = None, status: int = 400) -> EngineError:
    """A client-input failure raised from a protocol adapter (400 unless told)."""
    return EngineError(status, code, message, param=param)


_CUSTOM_CODES: set[str] = {"missing_required_parameter", "invalid_type", "invalid_value"}


def request_error(code: str, message: str) -> PydanticCustomError:
    """Raise from a pydantic validator: the mapper keeps `code` and the field path as param."""
    _CUSTOM_CODES.add(code)
    return PydanticCustomError(code, message)


class RequestTooLarge(Exception):
    """The body passed --max-request-mib (raised while reading it, before JSON parsing)."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        super().__init__(f"The request body exceeds the {limit_bytes // (1 << 20)} MiB limit.")


def too_large_response(limit_bytes: int) -> JSONResponse:
    return error_response(413, RequestTooLarge(limit_bytes).args[0], code="request_too_large")


def _param(loc: Iterable[Any]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
    return wire_param(".".join(parts)) or None


def _code(err_type: str) -> str:
    if err_type in _MISSING:
        return "missing_required_parameter"
    if err_type in _CUSTOM_CODES:
        return err_type
    if err_type in _TYPE_ERRORS or err_type.endswith("_type"):
        return "invalid_type"
    return "invalid_value"


def _message(err: dict) -> str:
    param = _param(err.get("loc", ()))
    msg = err.get("msg", "invalid value")
    if err.get("type") in _MISSING:
        return f"Missing required parameter: '{param}'."
    return f"Invalid value for '{param}': {msg}." if param else f"{msg}."


def validation_error_response(errors: list[dict]) -> JSONResponse:
    """The first pydantic error, as one OpenAI error (clients show a single message)."""
    if not errors:
        return error_response(400, "Invalid request.", code="invalid_value")
    err = errors[0]
    return error_response(400, _message(err), code=_code(err.get("type", "")),
                          param=_param(err.get("loc", ())))


LARGE_BODY = 256 * 1024  # request bodies above this are parsed on a worker thread


async def parse_off_loop(raw: bytes, parse, *args):
    """`parse(raw, *args)`; on a worker thread when the body is large, since parsing and
    validating a big request is host work that must not hold the event loop."""
    if len(raw) > LARGE_BODY:
        import anyio

        return await anyio.to_thread.run_sync(parse, raw, *args)
    return parse(raw, *args)


_STATUS_CODES = {404: "not_found", 405: "method_not_allowed", 401: "invalid_api_key",
                 413: "request_too_large", 503: "service_unavailable"}


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception kind a handler can raise through the one envelope."""

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError):
        from ninfer_core.server.metrics import count_rejection

        count_rejection(request.scope, exc.code, exc.status, exc)
        if is_anthropic_path(request.scope.get("path", "")):
            return shaped_error_response(request.scope, exc.status, exc.message, exc.type, exc.code,
                                         exc.param)
        return engine_error_response(exc)

    @app.exception_handler(ValidationError)
    async def _pydantic_error(request: Request, exc: ValidationError):
        return _reshape(request, validation_error_response(exc.errors(include_url=False)))

    @app.exception_handler(RequestValidationError)
    async def _fastapi_validation(request: Request, exc: RequestValidationError):
        errs = list(exc.errors())
        if errs and errs[0].get("type") == "json_invalid":
            return shaped_error_response(request.scope, 400, "The request body is not valid JSON.",
                                         code="invalid_json")
        return _reshape(request, validation_error_response(errs))

    @app.exception_handler(RequestTooLarge)
    async def _too_large(request: Request, exc: RequestTooLarge):
        return _reshape(request, too_large_response(exc.limit_bytes))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg = f"No route for {request.method} {request.url.path}."
        else:
            msg = str(exc.detail)
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return shaped_error_response(request.scope, exc.status_code, msg, type_,
                                     _STATUS_CODES.get(exc.status_code),
                                     headers=getattr(exc, "headers", None))


def _reshape(request: Request, resp: JSONResponse) -> JSONResponse:
    """An OpenAI-envelope response re-expressed in the envelope of the failing route."""
    if not is_anthropic_path(request.scope.get("path", "")):
        return resp
    err = json.loads(resp.body)["error"]
    return shaped_error_response(request.scope, resp.status_code, err["message"], err["type"], err["code"],
                                 err["param"])
