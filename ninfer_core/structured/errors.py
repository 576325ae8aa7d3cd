"""The errors of structured output, in the server's one error type (EngineError)."""

from __future__ import annotations

from ninfer_core.engine.api import EngineError


class SchemaError(ValueError):
    """A schema outside the supported subset; `path` names the keyword inside the schema."""

    def __init__(self, code: str, message: str, path: tuple = ()):
        super().__init__(message)
        self.code, self.message, self.path = code, message, tuple(str(p) for p in path)

    def to_engine_error(self, param: str) -> EngineError:
        """The HTTP 400 naming the field: `param` is where the schema sits in the request."""
        full = ".".join((param,) + self.path) if param else ".".join(self.path)
        where = ".".join(self.path) or "(the schema root)"
        return EngineError(400, self.code, f"{self.message} (at {where})", param=full or None)


def unsupported(keyword: str, path: tuple, why: str = "") -> SchemaError:
    detail = f": {why}" if why else ""
    return SchemaError(
        "json_schema_keyword_not_supported",
        f"JSON Schema keyword '{keyword}' is not supported by structured output{detail}",
        path,
    )


def invalid(message: str, path: tuple) -> SchemaError:
    return SchemaError("invalid_json_schema", message, path)


def mask_timeout(seconds: float) -> EngineError:
    return EngineError(
        500,
        "grammar_mask_timeout",
        f"The structured-output token mask took longer than {seconds:g} s; the request was stopped.",
        type_="server_error",
    )


def grammar_violation() -> EngineError:
    return EngineError(
        500,
        "grammar_violation",
        "The model produced a token the response grammar does not admit; the request was stopped.",
        type_="server_error",
    )
