"""Pydantic models of the Anthropic Messages request (POST /v1/messages, /v1/messages/count_tokens).

They validate the top-level scalar fields (model, max_tokens, the sampling fields, stream,
stop_sequences, thinking) with the codes the hand checks used before (invalid_type,
invalid_value, missing_required_parameter, the field path as `param`, server/errors.py maps them)
and give /openapi.json its request schemas. Fields whose rules depend on the role, the position
in the conversation or the thinking mode (messages and their content blocks, system, tools,
tool_choice, output_config) are described here for the schema but checked by anthropic_request
and anthropic_history, which name the exact element that is wrong. Unknown fields are allowed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

_BLOCK = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "description": "text, image, thinking, redacted_thinking, tool_use, tool_result"},
    "text": {"type": "string"}, "cache_control": {"type": ["object", "null"]}}}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]}
_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"type": "string", "enum": ["user", "assistant"]}, "content": _CONTENT}}
_TOOL = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,128}$"}, "description": {"type": "string"},
    "input_schema": {"type": "object"}, "type": {"type": "string"}, "cache_control": {"type": ["object", "null"]}}}
_TOOL_CHOICE = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
    "disable_parallel_tool_use": {"type": "boolean"}}}

Messages = Annotated[Any, WithJsonSchema({"type": "array", "items": _MESSAGE})]
System = Annotated[Any, WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK},
                                                  {"type": "null"}]})]
Tools = Annotated[Any, WithJsonSchema({"anyOf": [{"type": "array", "items": _TOOL}, {"type": "null"}]})]
ToolChoice = Annotated[Any, WithJsonSchema({"anyOf": [_TOOL_CHOICE, {"type": "null"}]})]
AnyObject = Annotated[Any, WithJsonSchema({"type": ["object", "null"]})]
StopSequence = Annotated[str, Field(min_length=1)]


class _Wire(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class CountThinkingConfig(_Wire):
    type: Literal["enabled", "disabled", "adaptive"]
    # checked by anthropic_request: at least 1024, and required with enabled
    budget_tokens: Annotated[Any, WithJsonSchema({"type": ["integer", "null"], "minimum": 1024})] = None
    display: Annotated[Any, WithJsonSchema({"type": ["string", "null"], "enum": ["summarized", "omitted", None]})] \
        = None  # output-only: not read by a token count


class ThinkingConfig(CountThinkingConfig):
    display: Literal["summarized", "omitted"] | None = None


class CountTokensRequest(_Wire):
    """The fields a token count reads (output-only fields are not read, so they cannot fail it).

    `model` is optional here, as llama.cpp's server has it: a count names no model to generate
    with, and a body without one counts for the model the server (or the router's default)
    serves. Given, it must still be a non-empty string."""

    model: str | None = Field(None, min_length=1)
    messages: Messages
    system: System = None
    tools: Tools = None
    tool_choice: ToolChoice = None
    thinking: CountThinkingConfig | None = None
    chat_template_kwargs: AnyObject = None
    preserve_thinking: bool | None = None


class MessagesRequest(CountTokensRequest):
    model: str = Field(min_length=1)
    thinking: ThinkingConfig | None = None
    max_tokens: int | None = Field(None, ge=1, description="omit it for the default output limit")
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[StopSequence] | None = None
    stream: bool | None = None
    metadata: AnyObject = None
    output_config: AnyObject = None
    post_thinking: AnyObject = None


def validate(data: Any, count_only: bool) -> None:
    """Raise pydantic's ValidationError (mapped to the Anthropic 400) for a bad top-level field."""
    if isinstance(data, dict):  # a null field is an omitted one (a null model is a missing model)
        data = {k: v for k, v in data.items() if v is not None}
    (CountTokensRequest if count_only else MessagesRequest).model_validate(data)
