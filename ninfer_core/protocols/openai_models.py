"""Pydantic models of the OpenAI Chat Completions request (the fields NInfer reads).

Scalar fields are validated here (strict types, spec ranges), so a bad value becomes a 400 whose
`param` is the field path. Fields with several wire shapes (message content, stop, tool_choice,
response_format) are typed `Any` and checked by `openai_chat.check_request`, which names the exact
element that is wrong. Unknown top-level fields are ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ninfer_core.protocols import wire_schemas
from ninfer_core.protocols.wire_schemas import described
from ninfer_core.server.errors import request_error

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _Wire(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: described(wire_schemas.CHAT_CONTENT) = None
    name: Any = None
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    reasoning_content: Any = None
    reasoning: Any = None


class FunctionDef(_Wire):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomToolDef(_Wire):
    name: str = Field(min_length=1)
    description: str | None = None
    format: Any = None


class Tool(_Wire):
    type: Literal["function", "custom"]
    function: FunctionDef | None = None
    custom: CustomToolDef | None = None

    @model_validator(mode="after")
    def _body_matches_type(self) -> "Tool":
        if getattr(self, self.type) is None:
            raise request_error("missing_required_parameter", f"a {self.type} tool needs its '{self.type}' object")
        return self


class StreamOptions(_Wire):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class PostThinking(_Wire):
    """The post_thinking extension: the sampler after the reasoning block closes (omitted: preset)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)


class ChatCompletionRequest(_Wire):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    max_completion_tokens: int | None = Field(None, ge=-1)
    max_tokens: int | None = Field(None, ge=-1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: described(wire_schemas.STOP) = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: Any = None  # OpenAI's map or llama.cpp's pairs: protocols/logit_bias.py
    verbose: bool | None = None  # llama.cpp's __verbose
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: Any = None
    enable_thinking: bool | None = None
    preserve_thinking: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    thinking_budget: int | None = Field(None, ge=1)
    post_thinking: PostThinking | None = None
    ignore_eos: bool | None = None
    modalities: list[str] | None = None
    store: bool | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    mm_processor_kwargs: Any = None
    audio: Any = None
    # vLLM / llama.cpp constrained-decoding extensions: rejected by name, never ignored.
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    grammar: Any = None
    structured_outputs: Any = None

    def output_limit(self) -> int | None:
        """max_completion_tokens, else max_tokens (-1 and None: the default output limit)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


CONSTRAINED_EXTENSIONS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "grammar",
                          "structured_outputs")
