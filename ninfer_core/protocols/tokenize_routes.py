"""Built-in protocol plugin: the model's tokenizer and chat template in llama.cpp's shape.

POST /tokenize, POST /detokenize and POST /apply-template answer from the host (a worker thread):
they never submit to the engine, take no ingress unit and do not wake a sleeping model.
`chat_input_tokens` is the handler of (/v1)/chat/completions/input_tokens, which openai_chat mounts.
"""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter, Request

from ninfer_core import hookimpl
from ninfer_core.protocols import wire_schemas
from ninfer_core.protocols.raw_prompt import WireModel
from ninfer_core.protocols.raw_prompt_input import single_prompt, tokenize_prompt, vocab_limit
from ninfer_core.protocols.wire_schemas import described
from ninfer_core.server.context import ServerContext
from ninfer_core.server.errors import bad_request, parse_json_body
from ninfer_core.server.prepare import forced_call_ids, render_prompt_ids


class TokenizeRequest(WireModel):
    content: described(wire_schemas.TEXT) = None
    add_special: bool | None = None  # accepted: the artifact's tokenizer decides whether a BOS is added
    parse_special: bool | None = None  # default true: special-token text encodes as that token
    with_pieces: bool | None = None


class DetokenizeRequest(WireModel):
    tokens: Any = None


def _object(raw: bytes) -> dict:
    data = parse_json_body(raw)
    if not isinstance(data, dict):
        raise bad_request("invalid_type", "The request body must be a JSON object.", None)
    return data


def piece(tokenizer: Any, token_id: int) -> str | list[int]:
    """A token's text, or its bytes when they are not whole UTF-8 on their own."""
    data = tokenizer.token_bytes(token_id)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def tokenize(ctx: ServerContext, raw: bytes) -> dict:
    req = TokenizeRequest.model_validate(_object(raw))
    content = req.content
    if isinstance(content, str):
        ids = tokenize_prompt(ctx, content, "content", parse_special=req.parse_special is not False)
    else:
        ids = tokenize_prompt(ctx, single_prompt(content, "content"), "content",
                              parse_special=req.parse_special is not False)
    if req.with_pieces:
        return {"tokens": [{"id": i, "piece": piece(ctx.tokenizer, i)} for i in ids]}
    return {"tokens": ids}


def detokenize(ctx: ServerContext, raw: bytes) -> dict:
    req = DetokenizeRequest.model_validate(_object(raw))
    tokens = req.tokens
    if tokens is None:
        raise bad_request("missing_required_parameter", "Missing required parameter: 'tokens'.", "tokens")
    if not isinstance(tokens, list):
        raise bad_request("invalid_type", "tokens must be a list of token ids.", "tokens")
    limit = vocab_limit(ctx)
    for i, t in enumerate(tokens):
        if not isinstance(t, int) or isinstance(t, bool):
            raise bad_request("invalid_type", "tokens must be a list of token ids.", f"tokens.{i}")
        if not 0 <= t < limit:
            raise bad_request("invalid_value", f"token id {t} is outside the vocabulary (0..{limit - 1}).",
                              f"tokens.{i}")
    return {"content": ctx.tokenizer.decode(tokens, skip_special=False)}


def chat_prompt_ids(ctx: ServerContext, raw: bytes) -> list[int]:
    """The prompt ids a Chat Completions body renders to (assistant opener included), checked as
    /v1/chat/completions checks it; a forced call ends with its opener, as the chat route submits it."""
    from ninfer_core.protocols.openai_chat_request import validate_body

    plan = validate_body(raw, ctx)
    ids = render_prompt_ids(ctx, plan.messages, plan.tools, plan.thinking, plan.template_kwargs).ids
    forced = getattr(plan, "forced_tool", None)
    if forced is not None:
        ids = ids + forced_call_ids(ctx.tokenizer, forced)
    return ids


def apply_template(ctx: ServerContext, raw: bytes) -> dict:
    """The prompt a Chat Completions body renders to, as text."""
    return {"prompt": ctx.tokenizer.decode(chat_prompt_ids(ctx, raw), skip_special=False)}


def chat_input_tokens(ctx: ServerContext, raw: bytes) -> dict:
    """llama-server's POST /v1/chat/completions/input_tokens: the prompt tokens of a chat body,
    in the shape of OpenAI's Responses input-token count."""
    return {"object": "response.input_tokens", "input_tokens": len(chat_prompt_ids(ctx, raw))}


class TokenizerRoutes:
    name = "tokenize"

    def mount(self, router: APIRouter, ctx: ServerContext) -> None:
        def route(work):
            async def handler(request: Request) -> dict:
                raw = await request.body()
                return await anyio.to_thread.run_sync(work, ctx, raw)

            return handler

        router.add_api_route("/tokenize", route(tokenize), methods=["POST"])
        router.add_api_route("/detokenize", route(detokenize), methods=["POST"])
        router.add_api_route("/apply-template", route(apply_template), methods=["POST"])


PROTOCOL = TokenizerRoutes()


@hookimpl
def ninfer_register_protocols(register):
    register("tokenize", "ninfer_core.protocols.tokenize_routes:PROTOCOL")
