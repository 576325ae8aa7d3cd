"""Gemma4Config: the text-model geometry read from a Hugging Face config.json.

Accepts the multimodal config (model_type gemma4, the text part under text_config) and the text-only
one (gemma4_text). Per layer it resolves what transformers' per_layer_config does: global
(full_attention) layers use `global_head_dim` and, when `attention_k_eq_v`, `num_global_key_value_heads`;
the last `num_kv_shared_layers` layers reuse the K/V of the last earlier layer of their type.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SLIDING, GLOBAL = "sliding_attention", "full_attention"
TEXT_ARCHITECTURES = ("gemma4", "gemma4_text")


class ConfigError(ValueError):
    """The config does not describe a Gemma 4 text model this plugin can run."""


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    partial: float = 1.0  # fraction of head_dim that rotates ("proportional": the rest keeps freq 0)
    factor: float = 1.0
    kind: str = "default"


@dataclass
class Gemma4Config:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    global_head_dim: int
    num_global_key_value_heads: int
    layer_types: tuple[str, ...]
    sliding_window: int
    rope: dict[str, RopeSpec]
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    hidden_activation: str = "gelu_pytorch_tanh"
    attention_bias: bool = False
    pad_token_id: int = 0
    eos_token_ids: tuple[int, ...] = ()
    has_vision: bool = False
    bidirectional_vision: bool = False  # use_bidirectional_attention "vision": a media item's rows see each other in sliding layers
    kv_source: tuple[int, ...] = field(default=())  # per layer: the layer whose K/V it attends over

    # -- derived per-layer geometry ---------------------------------------------------------------
    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == SLIDING

    def layer_head_dim(self, i: int) -> int:
        return self.head_dim if self.is_sliding(i) else self.global_head_dim

    def layer_kv_heads(self, i: int) -> int:
        return self.num_key_value_heads if self.is_sliding(i) else self.num_global_key_value_heads

    def k_eq_v(self, i: int) -> bool:
        return self.attention_k_eq_v and not self.is_sliding(i)

    def shares_kv(self, i: int) -> bool:
        return self.kv_source[i] != i

    def mlp_width(self, i: int) -> int:
        return self.intermediate_size * (2 if self.use_double_wide_mlp and self.shares_kv(i) else 1)

    def kv_layers(self, kind: str) -> tuple[int, ...]:
        """Layers of `kind` that own a K/V cache (shared layers read their source's)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind and not self.shares_kv(i))

    @classmethod
    def from_hf(cls, hf: dict, architecture: str | None = None) -> Gemma4Config:
        arch = architecture or hf.get("model_type") or "gemma4"
        if arch not in TEXT_ARCHITECTURES:
            raise ConfigError(f"not a Gemma 4 config (model_type {arch!r})")
        text = hf.get("text_config") if arch == "gemma4" else hf
        if not isinstance(text, dict):
            raise ConfigError("a gemma4 config needs a text_config object")
        try:
            n = int(text["num_hidden_layers"])
            hidden = int(text["hidden_size"])
            heads = int(text["num_attention_heads"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"text config lacks {e}") from None
        kv = int(text.get("num_key_value_heads", heads))
        head_dim = int(text.get("head_dim") or hidden // heads)
        layer_types = list(text.get("layer_types") or
                           [SLIDING if (i + 1) % 6 else GLOBAL for i in range(n)])
        if len(layer_types) != n:
            raise ConfigError(f"layer_types has {len(layer_types)} entries for {n} layers")
        if any(t not in (SLIDING, GLOBAL) for t in layer_types):
            raise ConfigError(f"unknown layer types {sorted(set(layer_types) - {SLIDING, GLOBAL})}")
        layer_types[-1] = GLOBAL  # transformers forces the last layer global
        k_eq_v = bool(text.get("attention_k_eq_v", False))
        global_kv = text.get("num_global_key_value_heads")
        global_kv = int(global_kv) if (global_kv is not None and k_eq_v) else kv
        global_hd = int(text.get("global_head_dim") or 512)
        plc = text.get("per_layer_config")
        if isinstance(plc, dict):  # an explicit table overrides the global defaults
            for key, over in plc.items():
                if str(key).isdigit() and int(key) < n and layer_types[int(key)] == GLOBAL and isinstance(over, dict):
                    global_hd = int(over.get("head_dim", global_hd))
                    global_kv = int(over.get("num_key_value_heads", global_kv))
                    break
        rope = _rope(text.get("rope_parameters"))
        shared = int(text.get("num_kv_shared_layers") or 0)
        moe = bool(text.get("enable_moe_block", False))
        if text.get("use_bidirectional_attention") == "all":
            raise ConfigError("bidirectional Gemma 4 variants are not generative models")
        eos = hf.get("eos_token_id", text.get("eos_token_id"))
        cfg = cls(
            architecture=arch,
            vocab_size=int(text.get("vocab_size", 262144)),
            hidden_size=hidden,
            intermediate_size=int(text.get("intermediate_size", 4 * hidden)),
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            global_head_dim=global_hd,
            num_global_key_value_heads=global_kv,
            layer_types=tuple(layer_types),
            sliding_window=int(text.get("sliding_window") or 512),
            rope=rope,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(text.get("max_position_embeddings", 131072)),
            final_logit_softcapping=(float(text["final_logit_softcapping"])
                                     if text.get("final_logit_softcapping") else None),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
            attention_k_eq_v=k_eq_v,
            num_kv_shared_layers=shared,
            use_double_wide_mlp=bool(text.get("use_double_wide_mlp", False)),
            hidden_size_per_layer_input=int(text.get("hidden_size_per_layer_input") or 0),
            vocab_size_per_layer_input=int(text.get("vocab_size_per_layer_input") or text.get("vocab_size", 0)),
            enable_moe_block=moe,
            num_experts=int(text.get("num_experts") or 0) if moe else 0,
            top_k_experts=int(text.get("top_k_experts") or 0) if moe else 0,
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0) if moe else 0,
            hidden_activation=str(text.get("hidden_activation") or "gelu_pytorch_tanh"),
            attention_bias=bool(text.get("attention_bias", False)),
            pad_token_id=int(text.get("pad_token_id") or 0),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
            has_vision=bool(hf.get("vision_config")) if arch == "gemma4" else False,
            bidirectional_vision=text.get("use_bidirectional_attention") == "vision",
        )
        cfg.kv_source = _kv_sources(cfg.layer_types, shared)
        if moe and not (cfg.num_experts and cfg.top_k_experts and cfg.moe_intermediate_size):
            raise ConfigError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
        if heads % kv or heads % global_kv:
            raise ConfigError(f"{heads} attention heads do not group over {kv} / {global_kv} KV heads")
        return cfg


def _rope(params) -> dict[str, RopeSpec]:
    defaults = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                GLOBAL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
    params = params if isinstance(params, dict) and params else defaults
    out = {}
    for kind in (SLIDING, GLOBAL):
        p = params.get(kind) or defaults[kind]
        rtype = p.get("rope_type", "default")
        if rtype not in ("default", "proportional"):
            raise ConfigError(f"unsupported rope_type {rtype!r} for {kind}")
        # default RoPE ignores partial_rotary_factor in transformers' Gemma 4 (it rotates all of head_dim)
        partial = float(p.get("partial_rotary_factor", 1.0)) if rtype == "proportional" else 1.0
        factor = float(p.get("factor", 1.0)) if rtype == "proportional" else 1.0
        out[kind] = RopeSpec(theta=float(p.get("rope_theta", 10_000.0)), partial=partial, factor=factor, kind=rtype)
    return out


def _kv_sources(layer_types: tuple[str, ...], shared: int) -> tuple[int, ...]:
    """Per layer the layer whose K/V it uses: itself, or (for the last `shared` layers) the last
    non-shared layer of the same type."""
    n = len(layer_types)
    first_shared = n - shared
    if shared and first_shared <= 0:
        raise ConfigError("num_kv_shared_layers leaves no layer that computes K/V")
    src = list(range(n))
    for i in range(first_shared, n):
        owners = [j for j in range(first_shared) if layer_types[j] == layer_types[i]]
        if not owners:
            raise ConfigError(f"shared layer {i} ({layer_types[i]}) has no earlier layer of its type")
        src[i] = owners[-1]
    return tuple(src)
