"""JSON Schemas of request fields that accept several wire shapes, for /openapi.json only.

Such fields are typed `Any` in the pydantic models because their checks name the exact element
that is wrong (protocols/*_request.py); `described(SCHEMA)` keeps that validation and gives the
document (and a client generator or fuzzer reading it) the shapes the route accepts.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import WithJsonSchema

_TOKENS = {"type": "array", "items": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string"}]}}
# a raw prompt: text, token ids (mixed with text pieces), or a batch of either
PROMPT = {"anyOf": [{"type": "string"}, _TOKENS, {"type": "array", "items": {"anyOf": [{"type": "string"}, _TOKENS]}},
                    {"type": "null"}]}
TEXT = {"anyOf": [{"type": "string"}, _TOKENS, {"type": "null"}]}
STOP = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                  {"type": "null"}]}
OPTIONAL_STRING = {"type": ["string", "null"]}
STRINGS = {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]}
CHAT_CONTENT = {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
    "type": "object", "required": ["type"], "properties": {"type": {"type": "string"}, "text": {"type": "string"}}}}]}


def described(schema: dict) -> Any:
    """`Any` validated by hand, documented as `schema`."""
    return Annotated[Any, WithJsonSchema(schema)]
