"""Test helpers for models built from `ninfer_core.nn`: the checkpoint tensor names of a hybrid
decoder layer and deterministic random weights for them (families' tiny test artifacts use both).

Weights are drawn per tensor from a generator seeded by (seed, tensor name), so an artifact is the
same bytes on every build and tensors can be produced one at a time while a writer streams them.
Scales keep activations O(1) and logits spread (not near-uniform).
"""

from __future__ import annotations

import math
import zlib

import torch


def decoder_layer_shapes(cfg: dict, prefix: str, layer_type: str) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes of one `DecoderLayer` (under `prefix`) of a Hugging Face config
    dict: its mixer of `layer_type`, and an MoE block when the config has `num_experts`."""
    h = cfg["hidden_size"]
    shapes = {f"{prefix}input_layernorm.weight": (h,), f"{prefix}post_attention_layernorm.weight": (h,)}
    if layer_type == "linear_attention":
        kd = cfg["linear_key_head_dim"] * cfg["linear_num_key_heads"]
        vd = cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"]
        hv, a = cfg["linear_num_value_heads"], f"{prefix}linear_attn."
        shapes.update({
            a + "in_proj_qkv.weight": (2 * kd + vd, h), a + "in_proj_z.weight": (vd, h),
            a + "in_proj_b.weight": (hv, h), a + "in_proj_a.weight": (hv, h),
            a + "conv1d.weight": (2 * kd + vd, 1, cfg["linear_conv_kernel_dim"]),
            a + "dt_bias": (hv,), a + "A_log": (hv,), a + "norm.weight": (cfg["linear_value_head_dim"],),
            a + "out_proj.weight": (h, vd),
        })  # fmt: skip
    else:
        hd, nh, kvh, a = (
            cfg["head_dim"],
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
            f"{prefix}self_attn.",
        )
        shapes.update({
            a + "q_proj.weight": (2 * nh * hd, h), a + "k_proj.weight": (kvh * hd, h),
            a + "v_proj.weight": (kvh * hd, h), a + "o_proj.weight": (h, nh * hd),
            a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,),
        })  # fmt: skip
    m = f"{prefix}mlp."
    if "num_experts" in cfg:
        e, i, s = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
        shapes.update({
            m + "gate.weight": (e, h), m + "experts.gate_up_proj": (e, 2 * i, h), m + "experts.down_proj": (e, h, i),
            m + "shared_expert.gate_proj.weight": (s, h), m + "shared_expert.up_proj.weight": (s, h),
            m + "shared_expert.down_proj.weight": (h, s), m + "shared_expert_gate.weight": (1, h),
        })  # fmt: skip
    else:
        i = cfg["intermediate_size"]
        shapes.update(
            {m + "gate_proj.weight": (i, h), m + "up_proj.weight": (i, h), m + "down_proj.weight": (h, i)}
        )
    return shapes


def random_tensor(
    name: str, shape: tuple[int, ...], seed: int, dtype=torch.float32, tied: bool = False
) -> torch.Tensor:
    """The deterministic random value of one named tensor (the same in either name layout)."""
    key = name.removeprefix("model.language_model.").removeprefix("model.")
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63))

    def randn():
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("linear_attn.norm.weight"):
        t = 1.0 + 0.1 * randn()  # plain-weight gated norm
    elif name.endswith("norm.weight"):
        t = 0.1 * randn()  # zero-centred norms: (1 + w)
    elif leaf == "A_log":
        t = torch.empty(shape).uniform_(0.1, 2.0, generator=gen).log()
    elif leaf == "dt_bias":
        t = 1.0 + 0.1 * randn()
    elif name.endswith("embed_tokens.weight"):
        # tied: this is also the head; 2/sqrt(h) gives logits of std ~2
        t = randn() * (2.0 / math.sqrt(shape[1]) if tied else 1.0)
    elif name == "lm_head.weight":
        t = randn() * (2.0 / math.sqrt(shape[1]))
    elif name.endswith("conv1d.weight"):
        t = randn() / math.sqrt(shape[-1])
    else:  # projections [.., out, in]: unit-variance outputs
        t = randn() / math.sqrt(shape[-1])
    return t.to(dtype)
