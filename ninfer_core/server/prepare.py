"""Request preparation shared by the generation protocols: thinking mode, sampling, prompt ids.

Rendering and tokenisation are host work: callers run `render_prompt_ids` on a worker thread
(anyio.to_thread), never on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ninfer_core.engine.api import EngineError, SamplingParams
from ninfer_core.server.context import ServerContext
from ninfer_core.tokenizer.chat_format import chat_format_of, token_id

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")
TOP_K_CAP = 20

# The sampler with nothing stated (no family preset, no generation config): the model's own
# distribution over the widest candidate set (top_k 0 is the sampler's 20).
NEUTRAL_PRESET = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                  "presence_penalty": 0.0, "frequency_penalty": 0.0}
# generation_config.json keys a preset takes (Hugging Face names; repetition_penalty has no equivalent)
_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")


def default_sampling_presets(architecture: str, family: Any = None, generation: dict | None = None,
                             chat_format: Any = None) -> dict[str, dict]:
    """{"thinking": {...}, "non_thinking": {...}} for the loaded model (spec: the sampling defaults
    follow the loaded architecture).

    In order: the family's `ModelFamily.sampling_presets(architecture)`, the presets of its chat
    format, the artifact's generation config (the checkpoint's generation_config.json values, one
    preset for both modes), then the neutral sampler.
    """
    presets = family.sampling_presets(architecture) if family is not None else None
    if not presets and chat_format is not None:
        presets = getattr(chat_format, "sampling", None)
    if presets:
        return {k: dict(v) for k, v in presets.items()}
    preset = dict(NEUTRAL_PRESET)
    for key in _GENERATION_KEYS:
        value = (generation or {}).get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            preset[key] = value
    return {"thinking": dict(preset), "non_thinking": dict(preset)}


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
        logit_bias=dict(request.get("logit_bias") or {}),  # {token id: bias}, parsed by the protocol
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
    opens_reasoning: bool  # the generation prompt left a reasoning block open
    media: Any = None  # ninfer_core.media.api.MediaPrompt when the messages carry media


def render_prompt_ids(ctx: ServerContext, messages: list[dict], tools: list[dict] | None,
                      enable_thinking: bool, template_kwargs: dict[str, Any]) -> PreparedPrompt:
    """Render the chat template to token ids (content as text, markup as control tokens)."""
    tpl = ctx.chat_template
    if tpl is None:
        # vLLM's answer too: the request cannot be rendered here (a raw-prompt route still can)
        raise EngineError(400, "no_chat_template", "This server has no chat template for its model, so chat "
                          "requests cannot be rendered: send a raw prompt to /v1/completions, or restart the "
                          "server with --chat-template NAME|FILE.")
    from ninfer_core.media.prompt import has_media, strip_media

    refs = []
    if has_media(messages):
        if ctx.media is None:
            raise EngineError(400, "vision_disabled", "This server was started without --vision; image and video "
                              "input is not accepted.", param="messages")
        messages, refs = strip_media(messages)
    tok = ctx.tokenizer
    kwargs = dict(template_kwargs)
    # the tokenizer's own markers, as transformers passes them (some templates open with bos_token)
    kwargs.setdefault("bos_token", getattr(tok, "bos_token", None) or "")
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
    media = None
    if refs:  # acquisition and preprocessing are host work on this thread (and the media pool)
        ids, media = ctx.media.expand_prompt(ids, refs)
    return PreparedPrompt(ids=ids, opens_reasoning=opens_reasoning(tok, ids), media=media)


def prompt_hints(ctx: ServerContext, ids: list[int], template_kwargs: dict[str, Any]) -> Any:
    """CheckpointHints for a rendered chat prompt under the request's resolved preserve_thinking
    (spec "Execution behavior": it selects the turn-closure frontier of new checkpoints). Message
    boundaries come from the chat template's learned opener and role heads; a
    template they cannot be learned from gives no turn-closure or boundary hints."""
    from ninfer_core.engine.checkpoints import CheckpointHints
    from ninfer_core.engine.turn_markers import hints_from_markers, template_turn_markers

    markers = template_turn_markers(ctx.chat_template, ctx.tokenizer)
    if markers is None:
        return CheckpointHints()
    return hints_from_markers(markers, ctx.tokenizer, ids, bool(template_kwargs.get("preserve_thinking")))


def _is_template_error(e: Exception) -> bool:
    try:
        import jinja2

        if isinstance(e, jinja2.TemplateError):
            return True
    except ImportError:  # pragma: no cover
        pass
    return isinstance(e, (ValueError, TypeError, KeyError))


def think_ids(tokenizer: Any) -> tuple[int | None, int | None]:
    """The control tokens that open and close reasoning in the model's chat format."""
    fmt = chat_format_of(tokenizer)
    return token_id(tokenizer, fmt.reasoning_open_token), token_id(tokenizer, fmt.reasoning_close)


def opens_reasoning(tokenizer: Any, ids: list[int]) -> bool:
    """True when the prompt's last reasoning-open control token is not followed by a close.

    Content is encoded as text, so a quoted open marker in a message cannot open a block.
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
    """Counts completion tokens spent inside a reasoning block (usage reasoning_tokens)."""

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


# -- reasoning effort (spec: values the template accepts, probed once) --------------------------

EFFORT_ORDER = ("minimal", "low", "medium", "high", "xhigh", "max")


def accepted_efforts(template: Any) -> tuple[str, ...] | None:
    """The reasoning_effort values `template` renders a one-message chat with; None when it accepts
    none of them or cannot render that chat at all. Probed once per template object."""
    cached = getattr(template, "_ninfer_accepted_efforts", False)
    if cached is not False:
        return cached
    probe = [{"role": "user", "content": "Hi"}]
    result: tuple[str, ...] | None
    try:
        template.render(probe, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that cannot render the probe keeps request values
        result = None
    else:
        ok = []
        for value in EFFORT_ORDER:
            try:
                template.render(probe, add_generation_prompt=True, reasoning_effort=value)
                ok.append(value)
            except Exception:  # noqa: BLE001 - this value is refused by the template
                pass
        result = tuple(ok) or None
    try:
        template._ninfer_accepted_efforts = result
    except AttributeError:  # pragma: no cover - a template object that takes no attributes
        pass
    return result


def collapse_effort(template: Any, effort: str | None) -> str | None:
    """The effort to render: the nearest value the template accepts, a tie rounding up."""
    if effort is None or effort == "none" or effort not in EFFORT_ORDER or template is None:
        return effort
    accepted = accepted_efforts(template)
    if not accepted or effort in accepted:
        return effort
    want = EFFORT_ORDER.index(effort)
    return min(accepted, key=lambda v: (abs(EFFORT_ORDER.index(v) - want), -EFFORT_ORDER.index(v)))


# -- forced tool calls, thinking budgets, post-thinking ------------------------------------------

def _tool_syntax(tokenizer: Any):
    syntax = chat_format_of(tokenizer).tools
    if syntax is None:
        raise EngineError(400, "tool_choice_not_supported", "This model's chat format states no tool-call "
                          "syntax, so a call to a named function cannot be forced.", param="tool_choice")
    return syntax


def forced_call_opener(name: str, tokenizer: Any = None) -> str:
    """The text a prompt ends with to force a call to `name` (in the model's chat format)."""
    return _tool_syntax(tokenizer).forced_opener(name)


def forced_call_ids(tokenizer: Any, name: str) -> list[int]:
    """The opener's ids: its control token as such, the rest (with the caller's name) as text."""
    return _tool_syntax(tokenizer).forced_ids(tokenizer, name)


BUDGET_MESSAGE = ("\n\nConsidering the limited time by the user, I have to give the solution based on the "
                  "thinking directly now.\n")


def budget_close_ids(ctx: ServerContext) -> list[int]:
    """Guidance + close marker (+ the format newlines) committed at a thinking budget."""
    message = ctx.options.thinking.thinking_budget_message
    text = BUDGET_MESSAGE if message is None else message
    tok = ctx.tokenizer
    fmt = chat_format_of(tok)
    marker = fmt.reasoning_close
    if marker not in text:
        text = text + ("" if text.endswith("\n") else "\n") + marker
    if text.endswith(marker) and fmt.close_needs_space:
        text += "\n\n"
    close = tok.token_to_id(marker)
    ids: list[int] = []
    for i, piece in enumerate(text.split(marker)):
        if i:
            ids.append(close)
        if piece:
            ids.extend(tok.encode(piece, allow_special=False))
    return ids


def thinking_fields(ctx: ServerContext, prompt: "PreparedPrompt", budget: int | None,
                    post_thinking: dict | None, sampling: SamplingParams,
                    reasoning_control: bool = False) -> dict[str, Any]:
    """GenerationRequest fields for thinking: budget (request, else --default-thinking-budget) and
    the post-thinking sampler (request object, else the --post-thinking flags); `reasoning_control`
    gives the request the budget's close sequence so Engine.end_reasoning can end it early.
    Nothing for a request that does not think."""
    if not prompt.opens_reasoning:
        return {}
    _, close = think_ids(ctx.tokenizer)
    if close is None:
        return {}
    opts = ctx.options.thinking
    fields: dict[str, Any] = {"in_reasoning": True, "think_end_ids": [close]}
    budget = budget if budget is not None else opts.default_thinking_budget
    if budget is not None:
        fields["thinking_budget"] = budget
    if budget is not None or reasoning_control:
        fields["budget_close_ids"] = budget_close_ids(ctx)
    if post_thinking is not None or opts.post_thinking:
        fields["post_thinking"] = post_thinking_sampling(ctx, post_thinking or {}, sampling)
    return fields


def post_thinking_sampling(ctx: ServerContext, request: dict[str, Any], base: SamplingParams) -> SamplingParams:
    """The thinking preset with temperature 0.2, then --post-thinking-* flags, then the request
    object; an omitted seed continues the request's stream (seed None); --greedy forces 0."""
    presets = ctx.sampling_presets or default_sampling_presets(ctx.model.architecture if ctx.model else "")
    values = dict(presets["thinking"])
    values["temperature"] = 0.2
    values.update(ctx.options.thinking.post_thinking_overrides)
    for name in SAMPLING_FIELDS:
        if request.get(name) is not None:
            values[name] = request[name]
    eng = ctx.options.engine
    if eng.greedy:
        values["temperature"] = 0.0
    return SamplingParams(
        temperature=float(values["temperature"]), top_p=float(values["top_p"]),
        top_k=min(int(values["top_k"]), TOP_K_CAP), min_p=float(values["min_p"]),
        presence_penalty=float(values["presence_penalty"]), frequency_penalty=float(values["frequency_penalty"]),
        seed=request.get("seed"), greedy=bool(eng.greedy or float(values["temperature"]) == 0.0))
