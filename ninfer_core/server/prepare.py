"""Request preparation shared by the generation protocols: thinking mode, sampling, prompt ids.

Rendering and tokenisation are host work: callers run `render_prompt_ids` on a worker thread
(anyio.to_thread), never on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ninfer_core.engine.api import EngineError, SamplingParams
from ninfer_core.server.context import ServerContext

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")
TOP_K_CAP = 20

# Spec "Server options": the registered presets (temperature/top-p/top-k/min-p/presence/frequency).
QWEN_THINKING = {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                 "presence_penalty": 0.0, "frequency_penalty": 0.0}
QWEN_NON_THINKING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0,
                     "presence_penalty": 1.5, "frequency_penalty": 0.0}


def default_sampling_presets(architecture: str, family: Any = None) -> dict[str, dict]:
    """{"thinking": {...}, "non_thinking": {...}} for the loaded model.

    A model family may state its own through a `sampling_presets(architecture)` method; every
    family registered today uses the Qwen presets.
    """
    own = getattr(family, "sampling_presets", None)
    if callable(own):
        presets = own(architecture)
        if presets:
            return presets
    return {"thinking": dict(QWEN_THINKING), "non_thinking": dict(QWEN_NON_THINKING)}


def resolve_sampling(ctx: ServerContext, thinking: bool, request: dict[str, Any],
                     seed: int | None) -> SamplingParams:
    """Preset for the thinking mode, then the process flags, then the request; --greedy last."""
    presets = ctx.sampling_presets or default_sampling_presets(ctx.model.architecture if ctx.model else "")
    values = dict(presets["thinking" if thinking else "non_thinking"])
    eng = ctx.options.engine
    for name in SAMPLING_FIELDS:
        flag = getattr(eng, name)
        if flag is not None:
            values[name] = flag
        if request.get(name) is not None:
            values[name] = request[name]
    if eng.greedy:
        values["temperature"] = 0.0
    values["top_k"] = min(int(values["top_k"]), TOP_K_CAP)
    return SamplingParams(
        temperature=float(values["temperature"]), top_p=float(values["top_p"]), top_k=values["top_k"],
        min_p=float(values["min_p"]), presence_penalty=float(values["presence_penalty"]),
        frequency_penalty=float(values["frequency_penalty"]),
        seed=seed if seed is not None else eng.seed,
        greedy=bool(eng.greedy or float(values["temperature"]) == 0.0),
    )


def default_settings(ctx: ServerContext) -> dict[str, Any]:
    """The default-thinking-mode sampler under the process flags (what /props reports)."""
    s = resolve_sampling(ctx, not ctx.options.no_thinking, {}, None)
    return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
            "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
            "seed": ctx.options.engine.seed if ctx.options.engine.seed is not None else -1}


def derived_output_limit(ctx: ServerContext, prompt_tokens: int) -> int | None:
    """The derived default budget ignoring --default-max-tokens (Chat Completions max_tokens: -1).

    None when no fixed cap is configured (the engine derives the same budget itself) or the prompt
    cannot run at all (the engine reports why).
    """
    eng = ctx.options.engine
    if eng.default_max_tokens is None or prompt_tokens >= eng.max_context:
        return None
    from ninfer_core.engine.budget import BudgetPolicy

    snap = ctx.engine.snapshot()
    policy = BudgetPolicy(eng.max_context, eng.max_concurrency, int(snap["pages_total"]),
                          int(snap["page_size"]), None)
    return policy.default_output_limit(prompt_tokens)


@dataclass
class PreparedPrompt:
    ids: list[int]
    opens_reasoning: bool  # the generation prompt left a <think> block open


def render_prompt_ids(ctx: ServerContext, messages: list[dict], tools: list[dict] | None,
                      enable_thinking: bool, template_kwargs: dict[str, Any]) -> PreparedPrompt:
    """Render the chat template to token ids (content as text, markup as control tokens)."""
    tpl = ctx.chat_template
    if tpl is None:
        raise EngineError(500, "no_chat_template", "The artifact has no chat template; start the server "
                          "with --chat-template FILE.", type_="server_error")
    tok = ctx.tokenizer
    kwargs = dict(template_kwargs)
    try:
        if hasattr(tpl, "render_ids"):
            ids = list(tpl.render_ids(tok, messages, tools=tools, add_generation_prompt=True,
                                      enable_thinking=enable_thinking, **kwargs))
        else:
            text = tpl.render(messages, tools=tools, add_generation_prompt=True,
                              enable_thinking=enable_thinking, **kwargs)
            ids = tok.encode(text)
    except EngineError:
        raise
    except Exception as e:  # noqa: BLE001 - template errors (raise_exception, bad history) are client input
        if _is_template_error(e):
            raise EngineError(400, "invalid_prompt", f"The chat template rejected the conversation: {e}",
                              param="messages") from None
        raise
    return PreparedPrompt(ids=ids, opens_reasoning=opens_reasoning(tok, ids))


def _is_template_error(e: Exception) -> bool:
    try:
        import jinja2

        if isinstance(e, jinja2.TemplateError):
            return True
    except ImportError:  # pragma: no cover
        pass
    return isinstance(e, (ValueError, TypeError, KeyError))


def think_ids(tokenizer: Any) -> tuple[int | None, int | None]:
    return tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")


def opens_reasoning(tokenizer: Any, ids: list[int]) -> bool:
    """True when the prompt's last <think> control token is not followed by a </think>.

    Content is encoded as text, so a quoted "<think>" in a message cannot open a block.
    """
    open_id, close_id = think_ids(tokenizer)
    if open_id is None:
        return False
    last_open = last_close = -1
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == open_id and last_open < 0:
            last_open = i
            break
        if ids[i] == close_id and last_close < 0:
            return False
    return last_open >= 0


class ReasoningTokenCounter:
    """Counts completion tokens spent inside a <think> block (usage reasoning_tokens)."""

    def __init__(self, tokenizer: Any, in_reasoning: bool):
        self.open_id, self.close_id = think_ids(tokenizer)
        self.inside = in_reasoning
        self.count = 0

    def feed(self, token_ids: list[int]) -> None:
        for t in token_ids:
            if self.inside:
                self.count += 1
                if t == self.close_id:
                    self.inside = False
            elif t == self.open_id and t is not None:
                self.inside = True
                self.count += 1
