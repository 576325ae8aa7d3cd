"""Gemma 4 attention over the paged KV cache (torch reference path).

Sliding layers attend to the last `window` positions (key p' is visible to query p when
p - window < p' <= p); global layers to every earlier position. With use_bidirectional_attention
"vision" a media row of a sliding layer also sees the later rows of its item (within the window),
as transformers' blockwise mask does; such a forward takes the torch path. q_norm and k_norm are scaled RMSNorms
over head_dim, v_norm an unscaled one; the softmax scale is 1 (the norms set the logit size).
A K=V global layer has no v_proj: its value is the raw key projection, v-normed (no RoPE).
A KV-shared layer has no K/V projections: it attends over the pages of its source layer, which
ran earlier in the same forward and has already written this forward's rows.
A group whose table is a ring (`Context.wrap`, the sliding layers) maps page index j to
table[j % wrap] (runner.py says why that is exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ninfer_gemma4.config import Gemma4Config
from ninfer_gemma4.gpu.attention import block_rows, decode_attention, kernel_meta, paged_attention, use_triton
from ninfer_gemma4.layers import RMSNorm, apply_rotary


def _use_kernels(x: torch.Tensor) -> bool:
    from ninfer_gemma4 import layers

    return layers._use_kernels(x)  # one switch for every fused small kernel (tests turn it off)


@dataclass
class Segment:
    """One lane's run of new tokens inside the flattened batch."""

    slot: int
    tables: dict[str, list[int]]  # KV group name -> page ids
    start: int
    length: int
    offset: int
    # media runs [a, b) (absolute positions) whose rows see each other in sliding layers
    # (use_bidirectional_attention "vision"); each ends inside this forward
    blocks: tuple[tuple[int, int], ...] = ()


@dataclass
class Context:
    segments: list[Segment]
    positions: torch.Tensor  # [N]
    page_size: int
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # owning layer -> (K, V) [pages, page, kvh, d]
    group_of: dict[int, str]  # owning layer -> KV group name
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # layer type -> cos, sin
    write_rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # group -> page, row
    device_tables: dict[str, torch.Tensor] = field(default_factory=dict)  # group -> int32 [B, W] (kernel path)
    wrap: dict[str, int] = field(default_factory=dict)  # group -> ring pages (its tables wrap)
    # (group, window, block_t) -> the kernel's (tiles, per_lane) on the device; the CUDA-Graph
    # decode fills these from its static buffers before the forward
    kernel_meta: dict = field(default_factory=dict)
    # --kv-dtype int8|fp8|k8v4: owning layer -> (K, V) scales of its quantised pages (global layers)
    kv_scale: dict = field(default_factory=dict)
    kv_format: object = None

    def write_kv(self, layer: int, page, row, k, v) -> None:
        """New rows of `layer`'s K/V at (page, row), encoded in the layer's --kv-dtype."""
        from ninfer_core.quant.kv import write_rows

        kc, vc = self.kv[layer]
        ks, vs = self.kv_scale[layer]
        write_rows(self.kv_format, kc, vc, ks, vs, page, row, k, v)

    def meta_of(self, group: str, window: int, block_t: int, page: int, device):
        key = (group, window, block_t)
        m = self.kernel_meta.get(key)
        if m is None:
            m = kernel_meta([s.start for s in self.segments], [s.length for s in self.segments], block_t, window,
                            page, device)
            self.kernel_meta[key] = m
        return m

    def tables_of(self, group: str, device) -> torch.Tensor:
        """The segments' page tables of `group` as one padded int32 tensor, built once per forward."""
        t = self.device_tables.get(group)
        if t is None:
            rows = [list(seg.tables[group]) for seg in self.segments]
            width = max(1, max(len(r) for r in rows))
            t = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)
            self.device_tables[group] = t
        return t


def grouped_attention(q, k, v, mask):
    """q [Tq, H, d], k/v [Tk, KVH, d], mask bool [Tq, Tk] -> [Tq, H, d]; GQA by grouping, fp32 softmax."""
    tq, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    qg = q.reshape(tq, kvh, g, d).permute(1, 2, 0, 3)  # [KVH, G, Tq, d]
    scores = (qg @ k.permute(1, 2, 0)[:, None]).float()  # [KVH, G, Tq, Tk]
    scores = scores.masked_fill(~mask[None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = probs @ v.permute(1, 0, 2)[:, None]  # [KVH, G, Tq, d]
    return out.permute(2, 0, 1, 3).reshape(tq, h, d)


class Attention(nn.Module):
    def __init__(self, cfg: Gemma4Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = cfg.layer_types[layer_idx]
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.layer_head_dim(layer_idx)
        self.kv_heads = cfg.layer_kv_heads(layer_idx)
        self.window = cfg.sliding_window if cfg.is_sliding(layer_idx) else None
        self.source = cfg.kv_source[layer_idx]
        h, bias, eps = cfg.hidden_size, cfg.attention_bias, cfg.rms_norm_eps
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.owns_kv = self.source == layer_idx
        if self.owns_kv:
            self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
            self.v_proj = None if cfg.k_eq_v(layer_idx) else nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
            self.k_norm = RMSNorm(self.head_dim, eps)
            self.v_norm = RMSNorm(self.head_dim, eps, with_scale=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=bias)

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        n = x.shape[0]
        cos, sin = ctx.rope[self.layer_type]
        if _use_kernels(x):  # norms, RoPE and the cache writes fused (gpu/fused.py); below is their reference
            return self._forward_fused(x, ctx, cos, sin)
        q = apply_rotary(self.q_norm(self.q_proj(x).view(n, self.heads, self.head_dim)), cos, sin)
        k_cache, v_cache = ctx.kv[self.source]
        if self.owns_kv:
            raw = self.k_proj(x).view(n, self.kv_heads, self.head_dim)
            v = raw if self.v_proj is None else self.v_proj(x).view(n, self.kv_heads, self.head_dim)
            k = apply_rotary(self.k_norm(raw), cos, sin)
            v = self.v_norm(v)
            page, row = ctx.write_rows[ctx.group_of[self.layer_idx]]
            if self.layer_idx in ctx.kv_scale:
                ctx.write_kv(self.layer_idx, page, row, k, v)
            else:
                k_cache[page, row] = k.to(k_cache.dtype)
                v_cache[page, row] = v.to(v_cache.dtype)
        return self._attend(q, k_cache, v_cache, x, ctx)

    def _forward_fused(self, x: torch.Tensor, ctx: Context, cos, sin) -> torch.Tensor:
        from ninfer_gemma4.gpu.fused import norm_rope

        n, eps = x.shape[0], self.q_norm.eps
        q = norm_rope(self.q_proj(x).view(n, self.heads, self.head_dim), self.q_norm.weight, eps, cos, sin)
        k_cache, v_cache = ctx.kv[self.source]
        if self.owns_kv:
            raw = self.k_proj(x).view(n, self.kv_heads, self.head_dim)
            v = raw if self.v_proj is None else self.v_proj(x).view(n, self.kv_heads, self.head_dim)
            page, row = ctx.write_rows[ctx.group_of[self.layer_idx]]
            if self.layer_idx in ctx.kv_scale:  # quantised pages: normed rows, then encoded
                ctx.write_kv(self.layer_idx, page, row, norm_rope(raw, self.k_norm.weight, eps, cos, sin),
                             norm_rope(v, None, eps))
            else:
                norm_rope(raw, self.k_norm.weight, eps, cos, sin, out=k_cache, page=page, row=row)
                norm_rope(v, None, eps, out=v_cache, page=page, row=row)
        return self._attend(q, k_cache, v_cache, x, ctx)

    def _attend(self, q, k_cache, v_cache, x, ctx: Context) -> torch.Tensor:
        return self.o_proj(self._attend_rows(q, k_cache, v_cache, x.shape[0], ctx).to(x.dtype))

    def _attend_rows(self, q, k_cache, v_cache, n: int, ctx: Context) -> torch.Tensor:
        """The attention output [n, heads * head_dim] before o_proj."""
        group = ctx.group_of[self.source]
        if self.source in ctx.kv_scale:
            return self._attend_quantized(q, k_cache, v_cache, ctx, group).reshape(n, -1)
        bidirectional = self.window is not None and any(seg.blocks for seg in ctx.segments)
        if use_triton(q) and _flat(ctx.segments) and not bidirectional:  # the Triton kernel, every lane at once
            window = self.window or 0
            if all(seg.length == 1 for seg in ctx.segments):  # a decode step: split over the keys
                out = decode_attention(q, k_cache, v_cache, ctx.tables_of(group, q.device), ctx.positions, window,
                                       1.0, wrap=ctx.wrap.get(group, 0))
                return out.reshape(n, -1)
            block_t, _ = block_rows(self.heads // self.kv_heads, self.head_dim)
            meta = ctx.meta_of(group, window, block_t, ctx.page_size, q.device)
            out = paged_attention(q.contiguous(), k_cache, v_cache, ctx.tables_of(group, q.device), None, None,
                                  window, 1.0, wrap=ctx.wrap.get(group, 0), meta=meta)
            return out.reshape(n, -1)
        out = torch.cat([self._segment(q, k_cache, v_cache, seg, seg.tables[group], ctx) for seg in ctx.segments])
        return out.reshape(n, -1)

    def _attend_quantized(self, q, k_cache, v_cache, ctx: Context, group: str):
        """Attention over quantised pages (a global layer: no window, no ring): per lane, the core
        kernel that dequantises in-kernel on the GPU path, else the reference over dequantised pages."""
        from ninfer_core.quant import kv_attention as QA
        from ninfer_core.quant.kv import page_views

        ks, vs = ctx.kv_scale[self.source]
        if not use_triton(q):
            kv = page_views(ctx.kv_format, k_cache, v_cache, ks, vs, q.dtype)
            return torch.cat([self._segment(q, *kv, seg, seg.tables[group], ctx) for seg in ctx.segments])
        outs = []
        for seg in ctx.segments:
            pages = torch.tensor(seg.tables[group], dtype=torch.int32, device=q.device)
            outs.append(QA.paged_prefill_attention(q[seg.offset: seg.offset + seg.length], ctx.kv_format, k_cache,
                                                   v_cache, ks, vs, pages, seg.start, 1.0))
        return torch.cat(outs)

    def _segment(self, q, k_cache, v_cache, seg: Segment, table, ctx: Context):
        ps = ctx.page_size
        end = seg.start + seg.length
        lo = 0 if self.window is None else max(0, seg.start - self.window + 1)
        first, last = lo // ps, -(-end // ps)
        wrap = ctx.wrap.get(ctx.group_of[self.source], 0)
        pages = [table[j % wrap] for j in range(first, last)] if wrap else table[first:last]
        idx = torch.tensor(pages, dtype=torch.int64, device=q.device)
        base = first * ps
        keys = k_cache[idx].reshape(-1, self.kv_heads, self.head_dim)[lo - base: end - base]
        vals = v_cache[idx].reshape(-1, self.kv_heads, self.head_dim)[lo - base: end - base]
        qpos = ctx.positions[seg.offset: seg.offset + seg.length]
        kpos = torch.arange(lo, end, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]
        if self.window is not None:
            for a, b in seg.blocks:  # a media row also sees the later rows of its item (they are in this forward)
                inside = (qpos >= a) & (qpos < b)
                mask |= inside[:, None] & (kpos[None, :] > qpos[:, None]) & (kpos[None, :] < b)
            mask &= kpos[None, :] > qpos[:, None] - self.window
        return grouped_attention(q[seg.offset: seg.offset + seg.length], keys, vals, mask)


def _flat(segments) -> bool:
    """Segments laid out back to back in lane order (what the kernel's row offsets assume)."""
    off = 0
    for seg in segments:
        if seg.offset != off:
            return False
        off += seg.length
    return True
