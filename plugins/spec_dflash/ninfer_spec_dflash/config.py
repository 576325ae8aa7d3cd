"""The drafter's configuration, read from a published checkpoint's config.json (z-lab/dflash layout).

A DFlash drafter's config is a Qwen3 decoder config (`hidden_size`, `num_hidden_layers`, heads,
`head_dim`, `intermediate_size`, `rms_norm_eps`, RoPE theta) plus `block_size`, `num_target_layers`
and `dflash_config: {mask_token_id, target_layer_ids}`. DFlash2 adds `conv_kernel_size`,
`conv_group_size`, `selector_rank` and `selector_top_k`, found at the top level or in
`dflash_config`. The artifact keeps this config as it is under `manifest["drafters"][kind]`.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("dflash", "dflash2")


class DrafterConfigError(ValueError):
    """A drafter config that cannot be served (names the key)."""


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The layers a checkpoint without `target_layer_ids` conditions on: the middle layer for a
    one-layer drafter, else evenly spread from layer 1 to the fourth from last (the reference's rule)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    lo, hi = 1, num_target_layers - 3
    return tuple(int(round(lo + i * (hi - lo) / (num_draft_layers - 1))) for i in range(num_draft_layers))


def _int(cfg: dict, key: str, where: str = "", minimum: int = 1) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise DrafterConfigError(f"drafter config {where}{key} must be an integer >= {minimum}, got {v!r}")
    return v


@dataclass(frozen=True)
class DrafterConfig:
    kind: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    attention_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # DFlash2
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size if self.conv_group_size else 0

    def window(self, layer: int) -> int | None:
        """The sliding window of a draft layer (None: it attends to the whole context)."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @classmethod
    def from_hf(cls, cfg: dict, kind: str) -> DrafterConfig:
        if kind not in KINDS:
            raise DrafterConfigError(f"unknown drafter kind {kind!r} ({', '.join(KINDS)})")
        if not isinstance(cfg, dict):
            raise DrafterConfigError("the drafter config is not a JSON object")
        extra = cfg.get("dflash_config") or {}
        if not isinstance(extra, dict):
            raise DrafterConfigError("drafter config dflash_config must be an object")
        hidden = _int(cfg, "hidden_size")
        layers = _int(cfg, "num_hidden_layers")
        heads = _int(cfg, "num_attention_heads")
        kv = _int(cfg, "num_key_value_heads") if "num_key_value_heads" in cfg else heads
        head_dim = _int(cfg, "head_dim") if cfg.get("head_dim") else hidden // heads
        if heads % kv:
            raise DrafterConfigError(f"drafter config: {heads} attention heads are not a multiple of {kv} KV heads")
        block = _int(cfg, "block_size") if "block_size" in cfg else 16
        if block < 2:
            raise DrafterConfigError(f"drafter config block_size must be at least 2, got {block}")
        if extra.get("mask_token_id") is None and cfg.get("mask_token_id") is None:
            raise DrafterConfigError("drafter config has no dflash_config.mask_token_id")
        mask = _int(extra if "mask_token_id" in extra else cfg, "mask_token_id", "dflash_config.", minimum=0)
        ids = extra.get("target_layer_ids", cfg.get("target_layer_ids"))
        if ids is None:
            ids = default_target_layers(_int(cfg, "num_target_layers"), layers)
        if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise DrafterConfigError(f"drafter config dflash_config.target_layer_ids must be layer indices, got {ids!r}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = float(cfg.get("rope_theta") or (rope.get("rope_theta") if isinstance(rope, dict) else None) or 10000.0)
        types = tuple(cfg.get("layer_types") or ())
        if types and len(types) != layers:
            raise DrafterConfigError(f"drafter config layer_types lists {len(types)} layers, not {layers}")
        window = cfg.get("sliding_window") if "sliding_attention" in types else None
        dflash2: dict = {}
        if kind == "dflash2":
            for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
                src = extra if key in extra else cfg
                if key not in src:
                    raise DrafterConfigError(f"a DFlash2 drafter config needs {key} (top level or dflash_config)")
                dflash2[key] = _int(src, key)
            if hidden % dflash2["conv_group_size"]:
                raise DrafterConfigError(f"drafter hidden_size {hidden} is not a multiple of conv_group_size "
                                         f"{dflash2['conv_group_size']}")
        return cls(kind=kind, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                   head_dim=head_dim, intermediate_size=_int(cfg, "intermediate_size"),
                   rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, block_size=block,
                   mask_token_id=mask, target_layer_ids=tuple(ids), attention_bias=bool(cfg.get("attention_bias")),
                   sliding_window=int(window) if window else None, layer_types=types, **dflash2)


def tensor_shapes(c: DrafterConfig, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of a drafter checkpoint by its checkpoint name (without the artifact's prefix)."""
    h, hd = c.hidden_size, c.head_dim
    out = {"fc.weight": (h, len(c.target_layer_ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": (c.num_heads * hd, h), p + "self_attn.k_proj.weight": (c.num_kv_heads * hd, h),
            p + "self_attn.v_proj.weight": (c.num_kv_heads * hd, h), p + "self_attn.o_proj.weight": (h, c.num_heads * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, h), p + "mlp.up_proj.weight": (c.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, c.intermediate_size),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })  # fmt: skip
        if c.attention_bias:
            out.update({p + "self_attn.q_proj.bias": (c.num_heads * hd,), p + "self_attn.k_proj.bias": (c.num_kv_heads * hd,),
                        p + "self_attn.v_proj.bias": (c.num_kv_heads * hd,), p + "self_attn.o_proj.bias": (h,)})
        if c.kind == "dflash2":
            for conv in ("attention_conv", "mlp_conv"):
                out[p + f"{conv}.base_kernel"] = (2, c.conv_kernel_size, h)
                out[p + f"{conv}.kernel_projection.weight"] = (2 * c.conv_kernel_size * c.conv_groups, h)
    if c.kind == "dflash2":
        out["candidate_selector.hidden_projection.weight"] = (c.selector_rank, h)
        out["candidate_selector.predecessor_codebook"] = (vocab_size, c.selector_rank)
        out["candidate_selector.successor_codebook"] = (vocab_size, c.selector_rank)
    return out
