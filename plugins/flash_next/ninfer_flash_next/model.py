"""The Flash-Next text model: embeddings copied into `hc_count` streams, hybrid GDN / indexed
attention layers each with an MoE block, both behind hyper-connections, an optional PLE module
before a layer's blocks, and a final mixer (no final norm: the mixer's normalised mix feeds lm_head).

Module and parameter names follow the Hugging Face checkpoint under `model.` (and
`model.language_model.` in the multimodal layout), so loading is a prefix rename plus the fusing
of per-expert weights and of the n-gram table shards (which stay in the artifact, read per pass).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ninfer_core.nn.gdn import GatedDeltaNet
from ninfer_core.nn.layers import RotaryEmbedding
from ninfer_core.nn.moe import SparseMoeBlock
from ninfer_flash_next.attention import IndexedAttention
from ninfer_flash_next.config import FlashNextConfig
from ninfer_flash_next.hyper import GatedResidual
from ninfer_flash_next.ple import PLELayer


class SigmoidGatedRMSNorm(nn.Module):
    """The GDN output norm with a sigmoid gate (output_gate_type "sigmoid"); same rounding points
    as core's silu-gated one (`ninfer_core.nn.layers.GatedRMSNorm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(dtype) * torch.sigmoid(z.float())).to(dtype)


class FlashDecoderLayer(nn.Module):
    def __init__(self, cfg: FlashNextConfig, layer_idx: int):
        super().__init__()
        base = cfg.base
        self.layer_type = base.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(base, layer_idx)
            if cfg.output_gate == "sigmoid":
                self.linear_attn.norm = SigmoidGatedRMSNorm(base.linear_value_head_dim, base.rms_norm_eps)
        else:
            self.self_attn = IndexedAttention(cfg, layer_idx)
        self.mlp = SparseMoeBlock(base)
        self.ple = None
        if layer_idx in cfg.ple_layer_ids:
            self.ple = PLELayer(cfg, layer_idx, cfg.ple_layer_ids.index(layer_idx))
        args = (base.hidden_size, cfg.hc_count, cfg.hc_lowrank, base.rms_norm_eps)
        self.attn_hyper_connection = GatedResidual(*args)
        self.mlp_hyper_connection = GatedResidual(*args)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.layer_type == "linear_attention" else self.self_attn

    def forward(self, streams: torch.Tensor, tokens: torch.Tensor, ctx) -> torch.Tensor:
        if self.ple is not None and self.ple.rows is not None:
            streams = self.ple(streams, tokens, ctx)
        x, w = self.attn_hyper_connection.mix(streams)
        streams = GatedResidual.inject(streams, self.mixer(x, ctx), w)
        x, w = self.mlp_hyper_connection.mix(streams)
        return GatedResidual.inject(streams, self.mlp(x), w)


class FlashNextModel(nn.Module):
    def __init__(self, cfg: FlashNextConfig):
        super().__init__()
        base = cfg.base
        self.cfg, self.fcfg = base, cfg
        self.embed_tokens = nn.Embedding(base.vocab_size, base.hidden_size)
        self.layers = nn.ModuleList(FlashDecoderLayer(cfg, i) for i in range(base.num_hidden_layers))
        # the whole model: the hybrid runner this family's runner builds on reads these (a pipeline
        # stage of another family holds a range); Flash-Next serves no pipeline stages (pipeline_layers 0)
        self.layer_range = range(base.num_hidden_layers)
        self.first = self.last = True
        self.hyper_connection_mixer = GatedResidual(base.hidden_size, cfg.hc_count, cfg.hc_lowrank,
                                                    base.rms_norm_eps, combine=False)
        self.lm_head = nn.Linear(base.hidden_size, base.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None
        for p in self.parameters():
            p.requires_grad_(False)

    def init_rotary(self, device) -> None:
        self.rotary = RotaryEmbedding(self.cfg.head_dim, self.cfg.rope, device=device)

    def forward(self, tokens: torch.Tensor, ctx, collect: tuple[int, ...] = (),
                embeds: torch.Tensor | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [N] -> final hidden states [N, hidden] (the input of lm_head). `hidden` (a
        pipeline stage's input in the hybrid runner's call) is never given: no stages here.

        `collect`: layers whose output is stored in `ctx.layer_outputs` as the mean of the streams."""
        if hidden is not None:
            raise NotImplementedError("Flash-Next serves no pipeline stages")
        x = self.embed_tokens(tokens) if embeds is None else embeds
        ctx.cos, ctx.sin = self.rotary.cos_sin(ctx.positions, x.dtype)
        ctx.rotary = self.rotary
        streams = x.repeat(1, self.fcfg.hc_count)  # [N, hc * H]
        for i, layer in enumerate(self.layers):
            streams = layer(streams, tokens, ctx)
            if i in collect:
                ctx.layer_outputs[i] = streams.unflatten(-1, (self.fcfg.hc_count, -1)).mean(-2)
        return self.hyper_connection_mixer.mix(streams)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab]."""
        return F.linear(hidden, self.lm_head.weight).float()
