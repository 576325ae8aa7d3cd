"""The Flash-Next full-attention layer: core's gated attention behind a block indexer (QSA).

The indexer scores compressed key blocks for every query and keeps the best `budget / ratio`
complete blocks plus the incomplete tail block; attention runs over the kept keys only. A query
that sees at most budget + ratio - 1 keys keeps every block, so attention is dense up to there.

    q_i = rope(norm(index_q(x)))            [heads_i, d_i] at the query's position
    K_b = rope(norm(mean(raw_k[b*r:(b+1)*r])))  at the block's first position
    score_b = sum_h relu(q_i[h] . K_b) / sqrt(d_i)

Raw index keys (index_k(x), before the norm) are stored per token in the layer's KV pages beside
K and V ([num_pages, page_size, d_i]), so a decode pools blocks over the lane's whole prefix.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ninfer_core.nn.attention import GatedAttention, grouped_attention
from ninfer_core.nn.layers import ZeroCenteredRMSNorm, apply_rotary
from ninfer_flash_next.config import FlashNextConfig


class Indexer(nn.Module):
    def __init__(self, cfg: FlashNextConfig):
        super().__init__()
        self.heads, self.head_dim, self.budget, self.ratio = cfg.indexer
        self.block_topk = self.budget // self.ratio
        eps = cfg.base.rms_norm_eps
        self.index_qk_proj = nn.Linear(cfg.base.hidden_size, (self.heads + 1) * self.head_dim, bias=False)
        self.q_layernorm = ZeroCenteredRMSNorm(self.head_dim, eps)
        self.k_layernorm = ZeroCenteredRMSNorm(self.head_dim, eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [N, H] -> (queries [N, heads, d] normed and rotated, raw keys [N, d])."""
        qk = self.index_qk_proj(x)
        q, k = qk.split([self.heads * self.head_dim, self.head_dim], dim=-1)
        q = self.q_layernorm(q.reshape(x.shape[0], self.heads, self.head_dim))
        return apply_rotary(q, cos, sin), k

    def select(self, q: torch.Tensor, qpos: torch.Tensor, raw_keys: torch.Tensor, rotary) -> torch.Tensor:
        """Keys each query may attend: bool [Tq, total] for queries at qpos [Tq] over the raw keys
        [total, d] of positions 0..total-1 (causal included)."""
        total = raw_keys.shape[0]
        kpos = torch.arange(total, device=q.device)
        causal = kpos[None, :] <= qpos[:, None]
        nb = (qpos + 1) // self.ratio  # complete blocks each query sees
        big = int(nb.max())
        if big <= self.block_topk:
            return causal
        blocks = raw_keys[: big * self.ratio].reshape(big, self.ratio, self.head_dim)
        pooled = self.k_layernorm(blocks.float().mean(dim=1).to(raw_keys.dtype))
        starts = torch.arange(big, device=q.device) * self.ratio
        cos, sin = rotary.cos_sin(starts, pooled.dtype)
        kb = apply_rotary(pooled[:, None, :], cos, sin)[:, 0]
        scores = torch.relu(torch.einsum("thd,bd->tbh", q.float(), kb.float())).sum(-1) / math.sqrt(self.head_dim)
        chosen = torch.zeros((len(qpos), big), dtype=torch.bool, device=q.device)
        # top-k over exactly the blocks each query sees: relu makes exact ties (all-zero scores)
        # common, and their order depends on the width topk runs over (transformers' is nb)
        for n in torch.unique(nb[nb > self.block_topk]).tolist():
            rows = (nb == n).nonzero()[:, 0]
            top = scores[rows, :n].topk(self.block_topk, dim=-1).indices
            chosen[rows[:, None], top] = True
        block_of = (kpos // self.ratio).clamp_max(big - 1)
        in_block = kpos[None, :] < (nb * self.ratio)[:, None]
        keep = torch.where(in_block, chosen.gather(-1, block_of[None].expand(len(qpos), -1)), True)
        sparse = (nb > self.block_topk)[:, None]
        return causal & torch.where(sparse, keep, True)


class IndexedAttention(GatedAttention):
    """Gated attention (q_proj/k_proj/v_proj/o_proj, q_norm/k_norm) plus the indexer."""

    def __init__(self, cfg: FlashNextConfig, layer_idx: int):
        super().__init__(cfg.base, layer_idx)
        self.indexer = Indexer(cfg) if cfg.indexer is not None else None

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        q, gate, k, v = self.project(x, ctx.cos, ctx.sin)
        ps = ctx.cache.page_size
        dev = x.device
        page_t, row_t = self.write_new_kv(ctx, k, v)  # the gated attention's write (per --kv-dtype)
        k_cache, v_cache = ctx.cache.kv_views(self.layer_idx, q.dtype)
        iq = None
        if self.indexer is not None:
            iq, ik = self.indexer.project(x, ctx.cos, ctx.sin)
            i_cache = ctx.cache.index[self.layer_idx]
            i_cache[page_t, row_t] = ik.to(i_cache.dtype)
        outs = []
        for seg in ctx.segments:
            total = seg.start + seg.length
            n_pages = -(-total // ps)
            idx = torch.tensor(seg.pages[:n_pages], device=dev)
            keys = k_cache[idx].reshape(n_pages * ps, self.kv_heads, self.head_dim)[:total]
            vals = v_cache[idx].reshape(n_pages * ps, self.kv_heads, self.head_dim)[:total]
            qpos = torch.arange(seg.start, total, device=dev)  # cache rows of the queries
            rows_q = slice(seg.offset, seg.offset + seg.length)
            if self.indexer is not None:
                raw = ctx.cache.index[self.layer_idx][idx].reshape(n_pages * ps, -1)[:total]
                mask = self.indexer.select(iq[rows_q], qpos, raw, ctx.rotary)
            else:
                mask = torch.arange(total, device=dev)[None, :] <= qpos[:, None]
            outs.append(grouped_attention(q[rows_q][None], keys[None], vals[None], mask[None], self.scale)[0])
        return self.finish(torch.cat(outs).to(x.dtype), gate)
