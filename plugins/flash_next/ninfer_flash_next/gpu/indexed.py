"""The indexed attention layer on the GPU path (the layer is attention.py's; the kernels are
sparse_attention.py's).

Per forward, once for every indexed layer (the rows' lanes, positions, block tables and which
rows are sparse are the same in each): the rows of a prefill chunk still inside the dense
threshold (position < budget + ratio - 1) go through core's causal paged prefill kernel; every
other row (decode and verify rows, the sparse part of a prefill chunk) through the sparse kernels:
block keys pooled from the cached raw index keys (torch), scores and top-k (Triton), attention
over the kept keys (Triton). Quantised KV pages (--kv-dtype) and the CPU keep the reference path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer_core.accel import kernels as K
from ninfer_core.accel import use_triton
from ninfer_flash_next.attention import IndexedAttention
from ninfer_flash_next.gpu import sparse_attention as SA

SCORE_BYTES = 256 << 20  # scores of at most this size per launch (prefill chunks over long prefixes)


@dataclass
class _Plan:
    dense: list  # (first row, rows, start, pages int32) of the dense prefix of prefill segments
    rows: torch.Tensor | None  # kernel rows of the batch (None: all of them, in order)
    n: int  # kernel rows
    lane: torch.Tensor  # int32 [n]
    qpos: torch.Tensor  # int32 [n]
    sparse: torch.Tensor  # int32 [n]
    table: torch.Tensor  # int32 [lanes, width], padded with the lane's first page
    max_keys: int
    s_idx: torch.Tensor | None  # positions in the kernel rows of the sparse rows (None: all)
    s_n: int
    s_lane: torch.Tensor  # int32 [s_n]: index into s_lanes
    s_nb: torch.Tensor  # int32 [s_n]
    s_lanes: torch.Tensor  # int64 [ls]: lanes with sparse rows
    s_nbmax: int


def plan(ctx, ratio: int, block_topk: int, ps: int, dev) -> _Plan:
    dense_end = block_topk * ratio + ratio - 1  # positions below it see at most block_topk blocks
    dense, rows, lanes, qpos, tables = [], [], [], [], []
    for li, seg in enumerate(ctx.segments):
        total = seg.start + seg.length
        tables.append(seg.pages[: -(-total // ps)])
        first = 0
        if not seg.stepwise:
            nd = max(0, min(total, dense_end) - seg.start)
            if nd:
                pages = torch.tensor(seg.pages[: -(-(seg.start + nd) // ps)], dtype=torch.int32, device=dev)
                dense.append((seg.offset, nd, seg.start, pages))
            first = nd
        for j in range(first, seg.length):
            rows.append(seg.offset + j)
            lanes.append(li)
            qpos.append(seg.start + j)
    width = max(len(t) for t in tables)
    table = torch.tensor([list(t) + [t[0]] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
    nb = [(p + 1) // ratio for p in qpos]
    sparse = [int(b > block_topk) for b in nb]
    s_pos = [i for i, s in enumerate(sparse) if s]
    s_lanes = sorted({lanes[i] for i in s_pos})
    local = {ln: i for i, ln in enumerate(s_lanes)}
    total_rows = sum(seg.length for seg in ctx.segments)

    def i32(v):
        return torch.tensor(v, dtype=torch.int32, device=dev)

    return _Plan(
        dense=dense, rows=None if rows == list(range(total_rows)) else torch.tensor(rows, device=dev), n=len(rows),
        lane=i32(lanes), qpos=i32(qpos), sparse=i32(sparse), table=table,
        max_keys=min(max(qpos, default=0) + 1, dense_end),
        s_idx=None if len(s_pos) == len(rows) else torch.tensor(s_pos, device=dev), s_n=len(s_pos),
        s_lane=i32([local[lanes[i]] for i in s_pos]), s_nb=i32([nb[i] for i in s_pos]),
        s_lanes=torch.tensor(s_lanes, dtype=torch.int64, device=dev), s_nbmax=max((nb[i] for i in s_pos), default=0),
    )


class KernelIndexedAttention(IndexedAttention):
    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        if self.indexer is None or not use_triton(x) or self.layer_idx in ctx.cache.kv_scale:
            return super().forward(x, ctx)
        ind = self.indexer
        q, gate, k, v = self.project(x, ctx.cos, ctx.sin)
        page_t, row_t = self.write_new_kv(ctx, k, v)
        k_cache, v_cache = ctx.cache.kv[self.layer_idx]
        iq, ik = ind.project(x, ctx.cos, ctx.sin)
        i_cache = ctx.cache.index[self.layer_idx]
        i_cache[page_t, row_t] = ik.to(i_cache.dtype)
        ps = ctx.cache.page_size
        p = getattr(ctx, "flash_sparse_plan", None)
        if p is None:
            p = ctx.flash_sparse_plan = plan(ctx, ind.ratio, ind.block_topk, ps, x.device)
        out = torch.empty_like(q)
        for first, nd, start, pages in p.dense:
            out[first:first + nd] = K.paged_prefill_attention(q[first:first + nd], k_cache, v_cache, pages, start,
                                                              self.scale)
        if p.n:
            sel = self._select(p, iq, i_cache, ps, ctx.rotary)
            qk = q if p.rows is None else q[p.rows]
            got = SA.sparse_attention(qk, k_cache, v_cache, p.table, p.lane, p.qpos, sel, p.sparse, ind.ratio,
                                      ind.block_topk, self.scale, max_keys=p.max_keys)
            if p.rows is None:
                out = got
            else:
                out[p.rows] = got
        return self.finish(out.to(x.dtype), gate)

    def _select(self, p: _Plan, iq, i_cache, ps: int, rotary) -> torch.Tensor:
        """The selected blocks [n, block_topk] int32 of the kernel rows (zeros for dense rows)."""
        ind = self.indexer
        sel = torch.zeros((p.n, ind.block_topk), dtype=torch.int32, device=iq.device)
        if not p.s_n:
            return sel
        keys = p.s_nbmax * ind.ratio
        kpos = torch.arange(keys, device=iq.device)
        pages = p.table[p.s_lanes][:, kpos // ps].long()  # [ls, keys]
        raw = i_cache[pages, (kpos % ps)[None, :].expand_as(pages)]  # [ls, keys, d_i]
        kb = SA.pooled_block_keys(raw, ind.k_layernorm, rotary, ind.ratio)
        rows = iq if p.rows is None else iq[p.rows]
        rows = rows if p.s_idx is None else rows[p.s_idx]
        chunk = max(1, SCORE_BYTES // max(1, 4 * p.s_nbmax))
        picked = []
        for a in range(0, p.s_n, chunk):
            scores = SA.index_scores(rows[a:a + chunk].contiguous(), kb, p.s_lane[a:a + chunk], p.s_nb[a:a + chunk])
            picked.append(SA.topk_blocks(scores, p.s_nb[a:a + chunk], ind.block_topk))
        picked = torch.cat(picked) if len(picked) > 1 else picked[0]
        if p.s_idx is None:
            return picked
        sel[p.s_idx] = picked
        return sel
