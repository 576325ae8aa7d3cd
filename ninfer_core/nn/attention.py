"""Gated full attention over the paged KV cache (torch reference path).

q_proj yields per head [query | gate] (2 * head_dim); q_norm / k_norm (zero-centred RMSNorm over
head_dim) come before the partial RoPE; the attention output is multiplied by sigmoid(gate)
before o_proj. GQA is computed by grouping query heads per KV head, never by copying K/V.
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer_core.nn.config import HybridConfig
from ninfer_core.nn.context import ForwardContext
from ninfer_core.nn.layers import ZeroCenteredRMSNorm, apply_rotary


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """Softmax attention with GQA by grouping.

    q: [B, Tq, H, d]; k, v: [B, Tk, KVH, d]; mask: bool [B, Tq, Tk] (True = may attend).
    Returns [B, Tq, H, d]. Scores and softmax in fp32, as transformers' eager path on fp32.
    """
    b, tq, h, d = q.shape
    kvh = k.shape[2]
    grp = h // kvh
    qg = q.reshape(b, tq, kvh, grp, d).permute(0, 2, 3, 1, 4)  # [B, KVH, G, Tq, d]
    kt = k.permute(0, 2, 3, 1)[:, :, None]  # [B, KVH, 1, d, Tk]
    vv = v.permute(0, 2, 1, 3)[:, :, None]  # [B, KVH, 1, Tk, d]
    scores = (qg @ kt).float() * scale  # [B, KVH, G, Tq, Tk]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = probs @ vv  # [B, KVH, G, Tq, d]
    return out.permute(0, 3, 1, 2, 4).reshape(b, tq, h, d)


class GatedAttention(nn.Module):
    def __init__(self, cfg: HybridConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.scale = self.head_dim**-0.5
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [N, hidden] -> q [N, H, d], gate [N, H*d], k, v [N, KVH, d] (RoPE applied)."""
        n = x.shape[0]
        qg = self.q_proj(x).view(n, self.heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(n, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        return q, gate.reshape(n, -1), k, v

    def finish(self, attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """attn [N, H, d] -> o_proj(attn * sigmoid(gate))."""
        out = attn.reshape(attn.shape[0], -1) * torch.sigmoid(gate)
        return self.o_proj(out)

    def write_new_kv(self, ctx: ForwardContext, k, v):
        """Write the new tokens' K/V (position p -> page pages[p // ps], row p % ps), quantised per
        --kv-dtype; returns the (page, row) index tensors for anything else stored per row."""
        ps = ctx.cache.page_size
        page_ids, rows = [], []
        for seg in ctx.segments:
            pos = range(seg.start, seg.start + seg.length)
            page_ids.extend(seg.pages[p // ps] for p in pos)
            rows.extend(p % ps for p in pos)
        page_t = torch.tensor(page_ids, device=k.device)
        row_t = torch.tensor(rows, device=k.device)
        ctx.cache.write_kv(self.layer_idx, page_t, row_t, k, v)
        return page_t, row_t

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, gate, k, v = self.project(x, ctx.cos, ctx.sin)
        ps = ctx.cache.page_size
        self.write_new_kv(ctx, k, v)
        k_cache, v_cache = ctx.cache.kv_views(self.layer_idx, q.dtype)

        if ctx.all_stepwise:
            attn = self._rows(q, k_cache, v_cache, ctx.segments, ps)
        else:
            attn = torch.cat([self._rows(q, k_cache, v_cache, [seg], ps, seg.offset) if seg.stepwise
                              else self._prefill_segment(q, k_cache, v_cache, seg, ps) for seg in ctx.segments])
        return self.finish(attn.to(x.dtype), gate)

    def _prefill_segment(self, q, k_cache, v_cache, seg, ps):
        """Causal attention of one segment's new queries over its cached prefix and itself."""
        total = seg.start + seg.length
        n_pages = -(-total // ps)
        idx = torch.tensor(seg.pages[:n_pages], device=q.device)
        keys = k_cache[idx].reshape(n_pages * ps, self.kv_heads, self.head_dim)[:total]
        vals = v_cache[idx].reshape(n_pages * ps, self.kv_heads, self.head_dim)[:total]
        qpos = torch.arange(seg.start, total, device=q.device)
        kpos = torch.arange(total, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]
        qs = q[seg.offset : seg.offset + seg.length]
        return grouped_attention(qs[None], keys[None], vals[None], mask[None], self.scale)[0]

    def _rows(self, q, k_cache, v_cache, segments, ps, offset: int = 0):
        """Every token of decode / verify segments as its own query over its lane's pages, up to and
        including its own position (the decode math; lanes padded to the longest and masked)."""
        lengths, tables = [], []
        for seg in segments:
            for j in range(seg.length):
                n = seg.start + j + 1
                lengths.append(n)
                tables.append(seg.pages[: -(-n // ps)])
        rows = q[offset : offset + len(lengths)]
        return paged_rows_attention(rows, k_cache, v_cache, tables, lengths, ps, self.scale)


def paged_rows_attention(q, k_cache, v_cache, tables, lengths, ps: int, scale: float, key_start: int = 0):
    """One query per row over the keys [key_start, length) of its page table (rows padded to the
    longest and masked). q [N, H, d] -> [N, H, d]."""
    max_pages = max(len(t) for t in tables)
    table = torch.tensor([list(t) + [t[0]] * (max_pages - len(t)) for t in tables], device=q.device)
    b = len(lengths)
    kvh, hd = k_cache.shape[2], k_cache.shape[3]
    keys = k_cache[table].reshape(b, max_pages * ps, kvh, hd)
    vals = v_cache[table].reshape(b, max_pages * ps, kvh, hd)
    lens = torch.tensor(lengths, device=q.device)
    idx = torch.arange(max_pages * ps, device=q.device)[None, :]
    mask = ((idx < lens[:, None]) & (idx >= key_start))[:, None, :]
    return grouped_attention(q[:, None], keys, vals, mask, scale)[:, 0]
