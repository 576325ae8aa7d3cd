"""The hybrid decoder layer: a pre-norm residual block around a Gated DeltaNet or gated-attention
mixer, then one around the MLP (dense SwiGLU or sparse MoE, `layers.make_mlp`).

Module names follow the Hugging Face checkpoints of these models (`linear_attn` / `self_attn`,
`mlp`, `input_layernorm`, `post_attention_layernorm`), so a family loads a layer by a prefix rename.
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer_core.nn.attention import GatedAttention
from ninfer_core.nn.config import HybridConfig
from ninfer_core.nn.context import ForwardContext
from ninfer_core.nn.gdn import GatedDeltaNet
from ninfer_core.nn.layers import ZeroCenteredRMSNorm, make_mlp


class DecoderLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, layer_idx: int, layer_type: str | None = None):
        super().__init__()
        self.layer_type = layer_type or cfg.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = GatedAttention(cfg, layer_idx)
        self.mlp = make_mlp(cfg)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.layer_type == "linear_attention" else self.self_attn

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.mixer(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))
