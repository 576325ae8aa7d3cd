"""The one error mapper: every failure leaves the server in the OpenAI error envelope.

{"error": {"message", "type", "param", "code"}}. EngineError carries its own status/code/param;
pydantic validation errors become 400 invalid_request_error with `param` the field path
("messages.0.role") and `code` invalid_type / invalid_value / missing_required_parameter (or the
code a validator raised through `request_error`); malformed JSON is 400 invalid_json.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ninfer_core.engine.api import EngineError

log = logging.getLogger("ninfer.server")

# Codes a validator may raise with `request_error`; they pass through the mapper unchanged.
_MISSING = {"missing", "missing_argument", "missing_keyword_argument"}
_TYPE_ERRORS = {
    "string_type", "int_type", "float_type", "bool_type", "list_type", "dict_type", "model_type",
    "model_attributes_type", "int_from_float", "int_parsing", "float_parsing", "bool_parsing",
    "is_instance_of", "union_tag_invalid", "tuple_type", "set_type", "none_required", "dataclass_type",
    "arguments_type", "string_unicode", "bytes_type", "json_type",
}


def error_body(message: str, type_: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code, param), status_code=status, headers=headers)


def engine_error_body(err: EngineError) -> dict:
    return error_body(err.message, err.type, err.code, err.param)


def engine_error_response(err: EngineError) -> JSONResponse:
    return JSONResponse(engine_error_body(err), status_code=err.status)


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
    return ".".join(parts) or None


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


def parse_json_body(raw: bytes) -> Any:
    """JSON of a request body, or EngineError invalid_json (400)."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EngineError(400, "invalid_json", f"The request body is not valid JSON: {e}") from None


_STATUS_CODES = {404: "not_found", 405: "method_not_allowed", 401: "invalid_api_key",
                 413: "request_too_large", 503: "service_unavailable"}


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception kind a handler can raise through the one envelope."""

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError):
        return engine_error_response(exc)

    @app.exception_handler(ValidationError)
    async def _pydantic_error(request: Request, exc: ValidationError):
        return validation_error_response(exc.errors(include_url=False))

    @app.exception_handler(RequestValidationError)
    async def _fastapi_validation(request: Request, exc: RequestValidationError):
        errs = list(exc.errors())
        if errs and errs[0].get("type") == "json_invalid":
            return error_response(400, "The request body is not valid JSON.", code="invalid_json")
        return validation_error_response(errs)

    @app.exception_handler(RequestTooLarge)
    async def _too_large(request: Request, exc: RequestTooLarge):
        return too_large_response(exc.limit_bytes)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg = f"No route for {request.method} {request.url.path}."
        else:
            msg = str(exc.detail)
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, msg, type_, _STATUS_CODES.get(exc.status_code),
                              headers=getattr(exc, "headers", None))
