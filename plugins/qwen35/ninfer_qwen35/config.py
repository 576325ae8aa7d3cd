"""The Qwen3.5 text-model configuration, read from a Hugging Face config.json as stored in an artifact.

Accepts both shapes HF uses: the multimodal `Qwen3_5(Moe)Config` with the language model under
`text_config`, and the flat text-only config of `Qwen3_5(Moe)ForCausalLM`. Missing keys take the
defaults of transformers' `Qwen3_5TextConfig` / `Qwen3_5MoeTextConfig`. No torch import here.

The dataclass and `ConfigError` are core's (`ninfer_core.nn.config`); this module adds the parser.
"""

from __future__ import annotations

from ninfer_core.nn.config import ConfigError, HybridConfig, RopeConfig

MOE_ARCHITECTURES = ("qwen3_5_moe", "qwen3_5_moe_text")

# transformers' class defaults (Qwen3_5TextConfig; the MoE text config differs where listed).
_DENSE_DEFAULTS = {
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 32768,
}
_MOE_DEFAULTS = {
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8,
    "num_experts": 256,
}


class Qwen35Config(HybridConfig):
    """The hybrid geometry (ninfer_core.nn.config) read with Qwen3.5's keys and defaults."""

    @classmethod
    def from_hf(cls, hf_config: dict, architecture: str | None = None) -> Qwen35Config:
        """Parse an HF config dict (nested under `text_config` or flat)."""
        top = dict(hf_config)
        text = dict(top.get("text_config") or top)
        arch = architecture or top.get("model_type") or text.get("model_type") or "qwen3_5"
        is_moe = arch in MOE_ARCHITECTURES or "num_experts" in text
        defaults = _MOE_DEFAULTS if is_moe else _DENSE_DEFAULTS

        def get(key, default=None):
            if key in text and text[key] is not None:
                return text[key]
            return defaults.get(key, default)

        hidden = int(get("hidden_size"))
        n_layers = int(get("num_hidden_layers"))
        n_heads = int(get("num_attention_heads"))
        head_dim = int(get("head_dim") or hidden // n_heads)
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
            ]
        layer_types = tuple(layer_types[:n_layers])
        unknown = set(layer_types) - {"full_attention", "linear_attention"}
        if unknown or len(layer_types) != n_layers:
            raise ConfigError(f"unsupported layer_types {sorted(unknown) or layer_types!r}")
        act = text.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ConfigError(f"unsupported hidden_act {act!r} (Qwen3.5 uses silu)")

        # Tying follows the top-level config, as transformers does for the outer model.
        tie = top.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        eos = text.get("eos_token_id", top.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))

        kw = {
            "architecture": arch,
            "vocab_size": int(get("vocab_size")),
            "hidden_size": hidden,
            "num_hidden_layers": n_layers,
            "layer_types": layer_types,
            "num_attention_heads": n_heads,
            "num_key_value_heads": int(get("num_key_value_heads")),
            "head_dim": head_dim,
            "rms_norm_eps": float(get("rms_norm_eps", 1e-6)),
            "attention_bias": bool(get("attention_bias", False)),
            "rope": _parse_rope(text),
            "max_position_embeddings": int(get("max_position_embeddings")),
            "linear_conv_kernel_dim": int(get("linear_conv_kernel_dim", 4)),
            "linear_key_head_dim": int(get("linear_key_head_dim", 128)),
            "linear_value_head_dim": int(get("linear_value_head_dim", 128)),
            "linear_num_key_heads": int(get("linear_num_key_heads", 16)),
            "linear_num_value_heads": int(get("linear_num_value_heads", 32)),
            "tie_word_embeddings": bool(tie),
            "mtp_num_hidden_layers": int(get("mtp_num_hidden_layers", 0) or 0),
            "eos_token_ids": eos_ids,
        }
        if is_moe:
            kw.update(
                is_moe=True,
                num_experts=int(get("num_experts")),
                num_experts_per_tok=int(get("num_experts_per_tok")),
                moe_intermediate_size=int(get("moe_intermediate_size")),
                shared_expert_intermediate_size=int(get("shared_expert_intermediate_size")),
                # transformers' Qwen3.5-MoE config drops norm_topk_prob and its router always
                # renormalises the top-k weights; a stored value is ignored the same way
                norm_topk_prob=True,
            )
        else:
            kw["intermediate_size"] = int(get("intermediate_size", 12288))
        cfg = cls(**kw)
        if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if n_heads % cfg.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        return cfg


def _parse_rope(text: dict) -> RopeConfig:
    """RoPE settings with transformers' precedence: rope_scaling replaces rope_parameters; keys
    inside the dict win over top-level rope_theta / partial_rotary_factor; partial factor
    defaults to 0.25 (Qwen3.5's backward-compatible default)."""
    params = dict(text.get("rope_scaling") or text.get("rope_parameters") or {})
    theta = params.get("rope_theta", text.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type in ("mrope",):
        rope_type = "default"
    if rope_type not in ("default", "linear"):
        raise ConfigError(f"unsupported rope_type {rope_type!r} (supported: default, linear)")
    section = tuple(int(s) for s in params.get("mrope_section", (11, 11, 10)))
    return RopeConfig(
        theta=float(theta),
        partial_rotary_factor=float(partial),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)) if rope_type == "linear" else 1.0,
        mrope_section=section,
        mrope_interleaved=bool(params.get("mrope_interleaved", True)),
    )
