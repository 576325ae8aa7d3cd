"""The Qwen3.5 text model (dense or MoE): embeddings, hybrid GDN / gated-attention stack, head.

The layers are core's hybrid building blocks (`ninfer_core.nn`); this module assembles them.

Module and parameter names follow the Hugging Face checkpoint under its text prefix
(`layers.3.self_attn.q_proj.weight` ...), so loading is a rename of the prefix only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ninfer_core.nn.context import ForwardContext
from ninfer_core.nn.decoder import DecoderLayer
from ninfer_core.nn.layers import RotaryEmbedding, ZeroCenteredRMSNorm
from ninfer_qwen35.config import Qwen35Config


class AbsentLayer(nn.Module):
    """A layer another pipeline stage holds: no parameters, keeps the layer indices of the list."""

    layer_type = "absent"


class Qwen35TextModel(nn.Module):
    """The whole model, or one pipeline stage of it: `layers` (a range of layer indices) holds the
    stage's layers; the first stage alone has the embeddings, the last alone the norm and head."""

    def __init__(self, cfg: Qwen35Config, layers: range | None = None):
        super().__init__()
        self.cfg = cfg
        n = cfg.num_hidden_layers
        self.layer_range = range(n) if layers is None else layers
        self.first, self.last = self.layer_range.start == 0, self.layer_range.stop == n
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if self.first else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) if i in self.layer_range else AbsentLayer()
                                    for i in range(n))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.last else None
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if self.last else None
        self.rotary: RotaryEmbedding | None = None  # built after the weights are materialised
        for p in self.parameters():
            p.requires_grad_(False)

    def init_rotary(self, device) -> None:
        self.rotary = RotaryEmbedding(self.cfg.head_dim, self.cfg.rope, device=device)

    def forward(self, tokens: torch.Tensor, ctx: ForwardContext, collect: tuple[int, ...] = (),
                embeds: torch.Tensor | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [N] -> final-normed hidden states [N, hidden] (the input of lm_head); a stage that
        is not the last returns the residual stream after its last layer instead.

        `collect`: layer indices whose output (the residual stream after the layer) is stored in
        `ctx.layer_outputs`; `embeds` replaces the token embeddings (media spliced in); `hidden`
        (a stage after the first) is the residual stream the previous stage sent."""
        if hidden is not None:
            x = hidden
        else:
            x = self.embed_tokens(tokens) if embeds is None else embeds
        rope = ctx.rope_positions if ctx.rope_positions is not None else ctx.positions
        ctx.cos, ctx.sin = self.rotary.cos_sin(rope, x.dtype)
        for i in self.layer_range:
            x = self.layers[i](x, ctx)
            if i in collect:
                ctx.layer_outputs[i] = x
        return self.norm(x) if self.last else x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab]."""
        return F.linear(hidden, self.lm_head.weight).float()
