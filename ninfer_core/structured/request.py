"""What a protocol calls: compile a request's format at validation, make its constraint at submit.

    compiled = compile_request(ctx, fmt, tools=plan.tools, parallel=..., forced_tool=name)  # 400s here
    ...render the prompt...
    GenerationRequest(..., constraint=make_constraint(ctx, compiled, prompt.opens_reasoning))

With --structured-output a forced tool call (tool_choice naming a function, or required over one
tool) is compiled under that tool's parameter schema even without a response format.
"""

from __future__ import annotations

from typing import Any

from ninfer_core.engine.api import EngineError
from ninfer_core.structured.formats import ResponseFormat


def forced_parameters(tools: list[dict] | None, name: str) -> tuple[Any, str]:
    """(the forced tool's parameter schema, its param path) from OpenAI-form rendered tools."""
    for i, t in enumerate(tools or []):
        fn = t.get("function", t)
        if fn.get("name") == name:
            return fn.get("parameters") or {
                "type": "object",
                "properties": {},
            }, f"tools.{i}.function.parameters"
    raise EngineError(
        400,
        "invalid_value",
        f"tool_choice names {name[:64]!r}, which is not among the tools.",
        param="tool_choice",
    )


def compile_request(
    ctx,
    fmt: ResponseFormat | None,
    *,
    tools: list[dict] | None = None,
    parallel: bool = True,
    forced_tool: str | None = None,
    tool_param: str | None = None,
):
    """The CompiledFormat a request runs under, or None (no constraint). Host work."""
    service = getattr(ctx, "structured", None)
    if service is None:
        return None
    if forced_tool is not None:
        params, param = forced_parameters(tools, forced_tool)
        return service.compile(None, forced_parameters=params, forced_param=tool_param or param)
    if fmt is None:
        return None
    return service.compile(fmt, tools=tools or None, parallel=parallel)


def make_constraint(ctx, compiled, opens_reasoning: bool = False):
    """The per-request Constraint for GenerationRequest.constraint (None without a compiled format)."""
    if compiled is None:
        return None
    from ninfer_core.server.prepare import think_ids

    close = think_ids(ctx.tokenizer)[1] if opens_reasoning else None
    return ctx.structured.constraint(
        compiled,
        in_reasoning=opens_reasoning and close is not None,
        think_end_ids=[close] if close is not None else [],
    )
