"""Pydantic models of the OpenAI Responses request (POST /v1/responses, /v1/responses/input_tokens).

They validate the top-level scalar fields (model, instructions, previous_response_id,
max_output_tokens, stream, store, temperature, top_p, thinking_budget, max_tool_calls,
top_logprobs, background, preserve_thinking) with the codes the hand checks used before
(invalid_type, invalid_value, missing_required_parameter, the field as `param`; server/errors.py
maps pydantic's errors) and give /openapi.json its request schemas. Unknown and unsupported
top-level fields are refused by name first (responses_request, unknown_parameter and the
*_not_supported codes); fields with several shapes or cross-field rules (input Items, tools,
tool_choice, text.format, reasoning, include, metadata, chat_template_kwargs) are described
here for the schema and checked by responses_request / responses_items / responses_tools.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

_ITEM = {"type": "object", "description": "an input Item: message (role, content), function_call, "
         "function_call_output, reasoning, ...", "properties": {"type": {"type": "string"}, "role": {"type": "string"},
                                                               "content": {}}}
Input = Annotated[Any, WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": _ITEM},
                                                 {"type": "null"}]})]
AnyObject = Annotated[Any, WithJsonSchema({"type": ["object", "null"]})]
AnyList = Annotated[Any, WithJsonSchema({"anyOf": [{"type": "array", "items": {"type": "object"}},
                                                   {"type": "null"}]})]
StringList = Annotated[Any, WithJsonSchema({"anyOf": [{"type": "array", "items": {"type": "string"}},
                                                      {"type": "null"}]})]
ToolChoice = Annotated[Any, WithJsonSchema({"anyOf": [{"type": "string", "enum": ["auto", "none", "required"]},
                                                      {"type": "object"}, {"type": "null"}]})]
ShortString = Annotated[str, Field(max_length=512)]


class _Wire(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class InputTokensRequest(_Wire):
    """POST /v1/responses/input_tokens: what a prompt-token count reads."""

    model: str | None = Field(None, min_length=1)
    input: Input = None
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1)
    reasoning: AnyObject = None
    tools: AnyList = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = None
    text: AnyObject = None
    truncation: Annotated[Any, WithJsonSchema({"type": ["string", "null"], "enum": ["disabled", None]})] = None
    preserve_thinking: bool | None = None
    chat_template_kwargs: AnyObject = None
    graft: str | None = None


class CreateResponseRequest(InputTokensRequest):
    """POST /v1/responses."""

    model: str = Field(min_length=1)
    max_output_tokens: int | None = Field(None, ge=0)
    stream: bool | None = None
    store: bool | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    metadata: AnyObject = None
    client_metadata: AnyObject = None
    thinking_budget: int | None = Field(None, ge=1)
    post_thinking: AnyObject = None
    max_tool_calls: int | None = Field(None, ge=0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    service_tier: Annotated[Any, WithJsonSchema({"type": ["string", "null"], "enum": ["auto", "default", None]})] \
        = None
    background: bool | None = None
    include: StringList = None
    stream_options: AnyObject = None
    prompt_cache_key: ShortString | None = None
    prompt_cache_options: AnyObject = None
    prompt_cache_retention: Annotated[Any, WithJsonSchema({"type": ["string", "null"],
                                                           "enum": ["in_memory", "24h", None]})] = None
    safety_identifier: ShortString | None = None
    user: ShortString | None = None


def validate(data: Any, count_only: bool) -> None:
    """Raise pydantic's ValidationError (mapped to the 400) for a bad top-level field."""
    if isinstance(data, dict):  # a null field is an omitted one (a null model is a missing model)
        data = {k: v for k, v in data.items() if v is not None}
    (InputTokensRequest if count_only else CreateResponseRequest).model_validate(data)
