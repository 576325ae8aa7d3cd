"""The `prompt` of a raw-prompt request in every shape llama.cpp's server accepts, and its tokens.

One prompt is a string, a list of token ids, ids and strings mixed (`[12, "text", 34]`), or an
object `{"prompt_string": ..., "multimodal_data": [base64, ...]}`. A list holding no token id at
its top level is a batch: each element is one prompt of those shapes, and the response has one
result per prompt (llama.cpp's `tokenize_input_prompts`: a top-level list that contains numbers is
one prompt, any other list is several). A one-element batch answers like a single prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ninfer_core.server.context import ServerContext
from ninfer_core.server.errors import bad_request

# Prompts in one batch: each is an engine request of its own, run a lane's worth at a time.
MAX_PROMPTS = 128


@dataclass
class RawPrompt:
    """One prompt of a request: its wire value (a string, or ids and strings) and field path."""

    parts: Any
    param: str
    copy: int = 0  # the j-th of n_cmpl completions of the same prompt (its seed is offset by j)


def with_copies(prompts: list[RawPrompt], n: int, param: str) -> list[RawPrompt]:
    """llama.cpp's n_cmpl (OpenAI's n): every prompt n times, result i * n + j the j-th completion of
    prompt i; the request stays within MAX_PROMPTS results."""
    if n == 1:
        return prompts
    if len(prompts) * n > MAX_PROMPTS:
        raise bad_request("invalid_value", f"{len(prompts)} prompts x {param} {n} is {len(prompts) * n} "
                          f"completions; at most {MAX_PROMPTS} are made per request.", param)
    return [RawPrompt(p.parts, p.param, j) for p in prompts for j in range(n)]


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_prompts(prompt: Any, ctx: ServerContext | None, param: str = "prompt") -> list[RawPrompt]:
    """Every prompt of the wire value, in order (400 with the element's path for a bad one)."""
    if prompt is None:
        raise bad_request("missing_required_parameter", f"Missing required parameter: '{param}'.", param)
    if isinstance(prompt, list) and not any(_is_token(x) for x in prompt):
        if not prompt:
            raise bad_request("invalid_value", f"{param} is empty.", param)
        if len(prompt) > MAX_PROMPTS:
            raise bad_request("invalid_value", f"{param} holds {len(prompt)} prompts; at most {MAX_PROMPTS} are "
                              "completed per request.", param)
        return [_one(p, ctx, f"{param}.{i}") for i, p in enumerate(prompt)]
    return [_one(prompt, ctx, param)]


def _one(prompt: Any, ctx: ServerContext | None, param: str) -> RawPrompt:
    if isinstance(prompt, str):
        return RawPrompt(prompt, param)
    if isinstance(prompt, dict):
        return _object_prompt(prompt, ctx, param)
    if not isinstance(prompt, list):
        raise bad_request("invalid_type", "A prompt must be a string, a list of token ids, token ids and strings "
                          "mixed, or an object with prompt_string.", param)
    if not prompt:
        raise bad_request("invalid_value", f"{param} is empty.", param)
    for i, p in enumerate(prompt):
        if not (_is_token(p) or isinstance(p, str)):
            raise bad_request("invalid_type", "A prompt's elements must be token ids or strings.", f"{param}.{i}")
    return RawPrompt(prompt, param)


def _object_prompt(obj: dict, ctx: ServerContext | None, param: str) -> RawPrompt:
    """llama.cpp's `{"prompt_string": ..., "multimodal_data": [...]}`; other keys are ignored."""
    if "prompt_string" not in obj:
        raise bad_request("missing_required_parameter", "A prompt object needs 'prompt_string'.",
                          f"{param}.prompt_string")
    text = obj["prompt_string"]
    inner = _one(text, ctx, f"{param}.prompt_string") if isinstance(text, (str, list)) else None
    if inner is None:
        raise bad_request("invalid_type", "prompt_string must be a string, or token ids and strings mixed.",
                          f"{param}.prompt_string")
    media = obj.get("multimodal_data")
    if media is not None:
        if not isinstance(media, list) or not all(isinstance(m, str) for m in media):
            raise bad_request("invalid_type", "multimodal_data must be a list of base64 strings.",
                              f"{param}.multimodal_data")
        if media:
            if not (ctx is not None and ctx.model is not None and ctx.model.vision):
                raise bad_request("vision_disabled", "This server was started without --vision: multimodal_data "
                                  "cannot be read.", f"{param}.multimodal_data")
            raise bad_request("multimodal_not_supported", "Media in a raw prompt are not supported: send images "
                              "through /v1/chat/completions.", f"{param}.multimodal_data")
    return RawPrompt(inner.parts, inner.param)


def single_prompt(prompt: Any, param: str = "prompt") -> Any:
    """The one prompt of a field that takes no batch (/tokenize `content`): a string, token ids,
    or ids and strings mixed; a one-element list of prompts is that prompt."""
    prompts = parse_prompts(prompt, None, param)
    if len(prompts) > 1:
        raise bad_request("multiple_prompts_not_supported", f"{param} holds {len(prompts)} prompts; send one.",
                          param)
    return prompts[0].parts


def vocab_limit(ctx: ServerContext) -> int:
    """Token ids a prompt may name: the tokenizer's domain, within the model's vocabulary."""
    n = int(getattr(ctx.tokenizer, "vocab_size", 0) or 0)
    model_n = int(getattr(ctx.model, "n_vocab", 0) or 0) if ctx.model else 0
    return min(n, model_n) if n and model_n else (n or model_n)


def tokenize_prompt(ctx: ServerContext, prompt: Any, param: str = "prompt",
                    parse_special: bool = True) -> list[int]:
    """Token ids of one prompt (`RawPrompt.parts`); special-token text in a string encodes as that
    token unless `parse_special` is false. Host work: call on a worker thread for long prompts."""
    tok = ctx.tokenizer
    parts = [prompt] if isinstance(prompt, str) else prompt
    limit = vocab_limit(ctx)
    ids: list[int] = []
    for i, part in enumerate(parts):
        if isinstance(part, str):
            ids.extend(tok.encode(part, allow_special=parse_special))
        else:
            p = param if isinstance(prompt, str) else f"{param}.{i}"
            if not 0 <= part < limit:
                raise bad_request("invalid_value",
                                  f"token id {part} is outside the vocabulary (0..{limit - 1}).", p)
            ids.append(part)
    return ids


def tokenize_prompts(ctx: ServerContext, prompts: list[RawPrompt]) -> list[list[int]]:
    """Token ids of every prompt; an empty one is refused with its path (host work)."""
    out = []
    for p in prompts:
        ids = tokenize_prompt(ctx, p.parts, p.param)
        if not ids:
            raise bad_request("invalid_value", "The prompt encodes to no tokens.", p.param)
        out.append(ids)
    return out
