"""The PLE module of a layer: hashed n-gram rows injected into every hyper-connection stream.

Per token: e = concat(rows) [ple_embed_dim]; a value v = value_proj(e) [H] and one key per stream
k = norm(key_proj(e)) [hc, H] gate the value by the normalised streams q:
    g = signed_sqrt(<k_s, q_s> / sqrt(H));  y_s = sigmoid(g_s) * v
then y + silu(dilated depthwise conv(norm(y))) (kernel `ple_conv_kernel_size`, dilation n-gram
size) is added to the streams before the layer's blocks (transformers' `Qwen4ExpTextPLELayer`).

Per-lane state (in the state slot): the last n - 1 token ids (the n-gram context; a fresh lane
holds EOS) and the convolution's last (kernel - 1) * dilation input columns.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ninfer_flash_next.config import FlashNextConfig
from ninfer_flash_next.hyper import GroupedRMSNorm
from ninfer_flash_next.ngram import NgramHasher


class PLELayer(nn.Module):
    def __init__(self, cfg: FlashNextConfig, layer_idx: int, ple_index: int):
        super().__init__()
        h, hch, eps = cfg.base.hidden_size, cfg.hc_hidden, cfg.base.rms_norm_eps
        self.layer_idx, self.hidden, self.hc = layer_idx, h, cfg.hc_count
        self.kernel, self.dilation, self.state_len = cfg.ple_conv_kernel_size, cfg.ngram_size, cfg.ple_conv_state
        self.hasher = NgramHasher(cfg, ple_index)
        self.rows = None  # an NgramRows, set by the loader (None: --no-ngram-table, the module is skipped)
        self.key_proj = nn.Linear(cfg.ple_embed_dim, hch, bias=False)
        self.value_proj = nn.Linear(cfg.ple_embed_dim, h, bias=False)
        self.norm_key = GroupedRMSNorm(hch, h, eps)
        self.norm_query = GroupedRMSNorm(hch, h, eps)
        self.norm_conv = GroupedRMSNorm(hch, h, eps)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(hch, 1, self.kernel), requires_grad=False)

    def embeddings(self, ids: torch.Tensor, dtype, device) -> torch.Tensor:
        """Table rows [T, R] -> concatenated embeddings [T, ple_embed_dim]."""
        return self.rows.fetch(ids).to(device=device, dtype=dtype).flatten(-2)

    def gated_values(self, streams: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """streams [N, hc*H], emb [N, E] -> y [N, hc*H] (before the convolution)."""
        key = self.norm_key(self.key_proj(emb)).unflatten(-1, (self.hc, self.hidden))
        value = self.value_proj(emb)
        query = self.norm_query(streams).unflatten(-1, (self.hc, self.hidden))
        gate = (key * query).sum(-1, keepdim=True) / math.sqrt(self.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        return (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)

    def conv(self, y_normed: torch.Tensor, state: torch.Tensor):
        """y_normed [T, C] after the lane's state [C, S] -> (silu(conv) [T, C], full input [C, S + T])."""
        full = torch.cat([state.to(y_normed.dtype), y_normed.t()], dim=-1)
        out = F.conv1d(full[None], self.conv1d.weight, groups=full.shape[0], dilation=self.dilation)[0]
        return F.silu(out).t(), full

    def forward(self, streams: torch.Tensor, tokens: torch.Tensor, ctx) -> torch.Tensor:
        """streams [N, hc*H] of the flattened batch -> streams + PLE; advances each lane's state."""
        cache = ctx.cache
        ctx_all, conv_all = cache.ple_ctx[self.layer_idx], cache.ple_conv[self.layer_idx]
        ids, new_ctx = [], []
        for seg in ctx.segments:
            toks = tokens[seg.offset: seg.offset + seg.length]
            prev = ctx_all[seg.slot]
            ids.append(self.hasher.row_ids(prev, toks))
            new_ctx.append(torch.cat([prev, toks.to(prev.dtype)]))
        emb = self.embeddings(torch.cat(ids), streams.dtype, streams.device)  # one pass for the batch
        y = self.gated_values(streams, emb)
        y_normed = self.norm_conv(y)
        outs = []
        c = ctx_all.shape[-1]
        for seg, hist in zip(ctx.segments, new_ctx):
            rows = slice(seg.offset, seg.offset + seg.length)
            out, full = self.conv(y_normed[rows], conv_all[seg.slot])
            outs.append(out)
            ctx_all[seg.slot] = hist[-c:]
            conv_all[seg.slot] = full[:, -self.state_len:].to(conv_all.dtype)
            if seg.kind == "verify":  # the state after each token, for commit
                t = seg.length
                ctx_hist = torch.stack([hist[j + 1: j + 1 + c] for j in range(t)])
                conv_hist = torch.stack([full[:, j + 1: j + 1 + self.state_len] for j in range(t)]).to(conv_all.dtype)
                ctx.verify_states.setdefault(seg.slot, {})[("ple", self.layer_idx)] = (ctx_hist, conv_hist)
        return streams + y + torch.cat(outs)
