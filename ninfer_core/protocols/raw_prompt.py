"""Raw-prompt completion shared by llama.cpp's /completion and OpenAI's legacy /v1/completions.

Spec "Raw-prompt completion and the tokenizer": no chat template, no reasoning block, no tool
parsing. This module validates the fields both routes accept (the sampler, stop strings, the
llama.cpp sampler controls NInfer does not have, logit_bias, the prompt or batch of prompts in
the shapes of raw_prompt_input.py) and turns a request into a RawPlan; the two protocol modules
add their own fields and response shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ninfer_core.engine.api import EngineError, SamplingParams
from ninfer_core.engine.sampler import random_seed
from ninfer_core.protocols import wire_schemas
from ninfer_core.protocols.logit_bias import parse_logit_bias
from ninfer_core.protocols.openai_chat_request import check_response_format
from ninfer_core.protocols.raw_prompt_input import RawPrompt, parse_prompts, vocab_limit, with_copies
from ninfer_core.protocols.wire_schemas import described
from ninfer_core.server.context import ServerContext
from ninfer_core.server.errors import bad_request
from ninfer_core.server.prepare import TOP_K_CAP, derived_output_limit, resolve_sampling
from ninfer_core.structured.formats import admit, llamacpp_grammar, llamacpp_json_schema, refuse_conflicts

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 32
MAX_PROBS = 20  # n_probs: the sampler's candidate domain

# llama.cpp sampler controls NInfer does not have: accepted at their neutral value, refused otherwise
# with `<field>_not_supported`. Each entry: (field, is-neutral test, what neutral means).
NEUTRAL_ONLY: tuple[tuple[str, Any, str], ...] = (
    ("repeat_penalty", lambda v: v == 1, "1"),
    ("typical_p", lambda v: v == 1, "1"),
    ("tfs_z", lambda v: v == 1, "1"),
    ("dynatemp_range", lambda v: v == 0, "0"),
    ("mirostat", lambda v: v == 0, "0"),
    ("xtc_probability", lambda v: v == 0, "0"),
    ("dry_multiplier", lambda v: v == 0, "0"),
    ("top_n_sigma", lambda v: v <= 0, "0 or below"),
    ("n_indent", lambda v: v == 0, "0"),
    ("t_max_predict_ms", lambda v: v <= 0, "0 or below"),
)


class WireModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class RawCompletionFields(WireModel):
    """The fields /completion and /v1/completions share. Unknown fields are ignored, among them
    the parameters of the controls below (repeat_last_n, mirostat_tau, dry_base, ...)."""

    prompt: described(wire_schemas.PROMPT) = None
    model: described(wire_schemas.OPTIONAL_STRING) = None
    max_tokens: int | None = None
    temperature: float | None = None  # below zero samples greedily
    top_k: int | None = None  # zero or below: the widest candidate set (20)
    top_p: float | None = Field(None, ge=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # negative: a random one
    stop: described(wire_schemas.STOP) = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    timings_per_token: bool | None = None
    response_format: Any = None
    cache_prompt: bool | None = None  # false keeps the request out of the context cache (no reuse, no capture)
    # llama.cpp controls, neutral values only
    repeat_penalty: float | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    dynatemp_range: float | None = None
    mirostat: int | None = None
    xtc_probability: float | None = None
    dry_multiplier: float | None = None
    top_n_sigma: float | None = None
    n_probs: int | None = None  # /completion: completion_probabilities; /v1/completions: logprobs
    post_sampling_probs: bool | None = None
    verbose: bool | None = None  # /v1/completions: the llama.cpp object as __verbose
    n_indent: int | None = None
    t_max_predict_ms: int | None = None
    grammar: Any = None  # GBNF (needs --structured-output; raw_prompt.structured_format)
    json_schema: Any = None  # llama.cpp's bare schema (needs --structured-output)
    lora: Any = None
    logit_bias: Any = None
    # accepted without effect
    samplers: Any = None
    n_keep: int | None = None
    min_keep: int | None = None
    id_slot: int | None = None


@dataclass
class RawPlan:
    """A validated raw-prompt request, ready to tokenize and submit."""

    prompts: list[RawPrompt]  # one, or a batch: each is its own engine request and result
    max_tokens: int | None  # None: the default output limit
    derived_limit: bool  # "no limit" (negative): the derived budget even under --default-max-tokens
    stop: list[str]
    stream: bool
    ignore_eos: bool
    timings_per_token: bool
    cache_prompt: bool
    limit_param: str = "max_tokens"  # the field the output limit came from (n_predict or max_tokens)
    sampling_request: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    n_probs: int = 0  # llama.cpp's n_probs (0: no probabilities)
    post_sampling_probs: bool = False
    response_format: Any = None  # ninfer_core.structured ResponseFormat to enforce (--structured-output)

    @property
    def batch(self) -> bool:
        return len(self.prompts) > 1


def structured_format(req: RawCompletionFields, ctx: ServerContext) -> Any:
    """The constrained format of a raw request (ninfer_core.structured): response_format, llama.cpp's
    json_schema (/completion) or grammar (GBNF); each needs --structured-output, at most one is sent."""
    found = []
    rf = check_response_format(req.response_format, ctx.options)
    if rf is not None:
        found.append(rf)
    schema = llamacpp_json_schema(getattr(req, "json_schema", None))
    grammar = llamacpp_grammar(req.grammar)
    for fmt in (schema, grammar):
        admitted = admit(fmt, ctx.options)
        if admitted is not None:
            found.append(admitted)
    if len(found) > 1:
        raise bad_request("invalid_value", f"{found[0].param} and {found[1].param} both constrain the output; "
                          "send one of them.", found[1].param)
    return found[0] if found else None


def check_model(model: Any, ctx: ServerContext) -> None:
    if model is None or model == "":
        return
    if not isinstance(model, str):
        raise bad_request("invalid_type", "model must be a string.", "model")
    if not ctx.serves_model(model):
        raise EngineError(404, "model_not_found", f"The model '{model}' does not exist; this server "
                          f"serves '{ctx.model.id}'.", param="model")


def check_neutral_controls(req: RawCompletionFields) -> None:
    """Refuse the llama.cpp sampler controls NInfer cannot apply, unless at their neutral value."""
    for name, neutral, meaning in NEUTRAL_ONLY:
        value = getattr(req, name)
        if value is not None and not neutral(value):
            raise bad_request(f"{name}_not_supported", f"{name} is accepted only at its neutral value "
                              f"({meaning}): NInfer's sampler has no such control.", name)
    if req.lora is not None:
        if not isinstance(req.lora, list):
            raise bad_request("invalid_type", "lora must be a list.", "lora")
        if req.lora:
            raise bad_request("lora_not_supported", "LoRA adapters are not supported.", "lora")


def stop_list(stop: Any) -> list[str]:
    """A string or up to 32 non-empty strings."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list):
        raise bad_request("invalid_type", "stop must be a string or a list of strings.", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request("invalid_value", f"stop accepts at most {MAX_STOP_STRINGS} strings.", "stop")
    for i, s in enumerate(items):
        param = "stop" if isinstance(stop, str) else f"stop.{i}"
        if not isinstance(s, str):
            raise bad_request("invalid_type", "stop strings must be strings.", param)
        if s == "":
            raise bad_request("invalid_value", "stop strings must be non-empty.", param)
    return list(items)


def check_fields(req: RawCompletionFields, ctx: ServerContext, limit: int | None,
                 negative_is_unlimited: bool, limit_param: str, copies: int = 1, copies_param: str = "n_cmpl"
                 ) -> RawPlan:
    """The checks both routes share; `limit` is the route's output-limit field value, `copies` its
    completions per prompt (n_cmpl, n)."""
    check_model(req.model, ctx)
    check_neutral_controls(req)
    fmt = structured_format(req, ctx)
    if limit is not None and limit < 0 and not negative_is_unlimited and limit != -1:
        raise bad_request("invalid_value", f"{limit_param} must be -1 (no limit) or a non-negative integer.",
                          limit_param)
    logit_bias = parse_logit_bias(req.logit_bias, ctx.tokenizer, vocab_limit(ctx))
    n_probs = req.n_probs or 0
    if not 0 <= n_probs <= MAX_PROBS:
        raise bad_request("invalid_value", f"n_probs must be between 0 and {MAX_PROBS}: the sampler's candidate "
                          "domain.", "n_probs")
    sampling_request = {
        "logit_bias": logit_bias,
        "temperature": None if req.temperature is None else max(0.0, req.temperature),
        "top_k": None if req.top_k is None else (TOP_K_CAP if req.top_k <= 0 else req.top_k),
        "top_p": req.top_p, "min_p": req.min_p,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
    }
    stop = stop_list(req.stop)
    refuse_conflicts(fmt, stop=stop, ignore_eos=bool(req.ignore_eos))
    return RawPlan(
        prompts=with_copies(parse_prompts(req.prompt, ctx), copies, copies_param),
        response_format=fmt,
        max_tokens=None if limit is None or limit < 0 else limit,
        derived_limit=limit is not None and limit < 0,
        stop=stop,
        stream=bool(req.stream),
        ignore_eos=bool(req.ignore_eos),
        timings_per_token=bool(req.timings_per_token),
        cache_prompt=req.cache_prompt is not False,
        limit_param=limit_param,
        sampling_request=sampling_request,
        seed=None if req.seed is None or req.seed < 0 else req.seed,
        logit_bias=logit_bias,
        n_probs=n_probs,
        post_sampling_probs=bool(req.post_sampling_probs),
    )


def raw_sampling(ctx: ServerContext, plan: RawPlan) -> SamplingParams:
    """The default-thinking-mode preset (what /props reports), the process flags, then the request.

    A request without a seed gets the process --seed or a fresh one drawn here, so the response's
    generation_settings can report the seed it ran with.
    """
    sampling = resolve_sampling(ctx, not ctx.options.no_thinking, plan.sampling_request, plan.seed)
    if sampling.seed is None:
        sampling.seed = random_seed()
    return sampling


def output_limit(ctx: ServerContext, plan: RawPlan, prompt_tokens: int) -> int | None:
    if plan.derived_limit:
        return derived_output_limit(ctx, prompt_tokens)
    return plan.max_tokens


def settings_dict(ctx: ServerContext, plan: RawPlan, sampling: SamplingParams, n_predict: int) -> dict:
    """llama.cpp's generation_settings: the settings this raw request resolved to."""
    return generation_settings(ctx, sampling, n_predict, stop=plan.stop, ignore_eos=plan.ignore_eos,
                               stream=plan.stream, cache_prompt=plan.cache_prompt,
                               timings_per_token=plan.timings_per_token, n_probs=plan.n_probs,
                               post_sampling_probs=plan.post_sampling_probs)


def generation_settings(ctx: ServerContext, sampling: SamplingParams, n_predict: int, *, stop: list[str],
                        ignore_eos: bool, stream: bool, cache_prompt: bool = True, timings_per_token: bool = False,
                        n_probs: int = 0, post_sampling_probs: bool = False) -> dict:
    """llama.cpp's generation_settings object for a request that resolved to `sampling`."""
    return {
        "n_predict": n_predict, "max_tokens": n_predict, "seed": sampling.seed,
        "temperature": 0.0 if sampling.greedy else sampling.temperature,
        "top_k": sampling.top_k if sampling.top_k > 0 else TOP_K_CAP, "top_p": sampling.top_p,
        "min_p": sampling.min_p, "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty, "repeat_penalty": 1.0, "typical_p": 1.0,
        "mirostat": 0, "n_probs": n_probs, "post_sampling_probs": post_sampling_probs,
        # llama.cpp's [{bias, token}]; a ban's minus infinity is null in its JSON
        "logit_bias": [{"bias": b if b != float("-inf") else None, "token": t}
                       for t, b in sampling.logit_bias.items()],
        "stop": list(stop), "ignore_eos": ignore_eos, "stream": stream, "cache_prompt": cache_prompt,
        "timings_per_token": timings_per_token,
        "samplers": ["logit_bias", "penalties", "top_k", "temperature", "top_p", "min_p"],
        "model": ctx.model.id,
    }
