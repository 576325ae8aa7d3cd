"""Sliding-window paged attention for Gemma 4 (prefill chunks and decode in one batch), in Triton,
with the torch reference it is tested against.

A batch is lanes of new query rows: lane b has `qlens[b]` queries at positions `starts[b]` ..
`starts[b] + qlens[b] - 1` (a decode is one query, a prefill chunk many), flattened in lane order
into q [T, H, D]. Its keys are in the paged caches [P, page, KVH, D] through `tables[b]` (page ids
by page index; the rows of this forward already written). Query p sees key p' when p' <= p and,
with `window` > 0 (a sliding layer), p' > p - window: pages wholly behind the window are never
read, so their ids may be anything (a pool that released them). With `wrap` > 0 the table is a
ring: page index j reads tables[b][j % wrap] (the sliding layers' per-slot ring, see runner.py). GQA: query head h reads KV head
h // (H / KVH). Softmax scale `scale` (1 for Gemma 4: q_norm/k_norm set the logit size), fp32
accumulation, output in q's dtype.

The kernel packs, per KV head, the G = H / KVH query heads of BLOCK_T consecutive query positions
of one lane into the rows of one tile, so a decode step reads each key page once for all its
query heads; it loops over the key pages the tile's rows can see (online softmax).

A batch of one query per lane (a decode step) runs `decode_attention` instead: flash-decoding, the
keys a lane sees split into a fixed number of parts (`decode_splits`: from the KV-head count and
the window only, so a lane's result has the same bits alone and in any batch), one program per
(lane, KV head, part), then a log-sum-exp combine. The tile kernel gives a decode step one program
per KV head walking every page (16 programs on the 31B's sliding layers, 2 on the 26B-A4B's global
ones): at a 512-token context that was 31 us per layer on the H200, a fifth of the step.
Kernels run when triton is importable and q is on CUDA, or on the CPU under TRITON_INTERPRET=1
(the kernel tests); otherwise the torch reference runs.
"""

from __future__ import annotations

import torch

from ninfer_core.accel import HAVE_TRITON
from ninfer_core.accel import use_triton as use_triton  # re-exported: one rule for every family
from ninfer_core.accel.kernels import decode_splits as core_decode_splits

if HAVE_TRITON:  # triton is optional: the CPU reference path never needs it
    import triton
    import triton.language as tl


def ref_paged_attention(q, k_cache, v_cache, tables, starts, qlens, window: int, scale: float, wrap: int = 0):
    """The torch reference (see the module docstring). tables: list of page-id lists (or an int
    tensor [B, W]); starts, qlens: ints per lane."""
    t, h, d = q.shape
    ps, kvh = k_cache.shape[1], k_cache.shape[2]
    g = h // kvh
    out = torch.empty_like(q)
    off = 0
    for b, (start, n) in enumerate(zip(starts, qlens)):
        start, n = int(start), int(n)
        end = start + n
        lo = max(0, start - window + 1) if window > 0 else 0
        first, last = lo // ps, -(-end // ps)
        table = tables[b]
        idx = [j % wrap for j in range(first, last)] if wrap > 0 else range(first, last)
        ids = torch.as_tensor([int(table[j]) for j in idx], dtype=torch.long, device=q.device)
        keys = k_cache[ids].reshape(-1, kvh, d)[lo - first * ps: end - first * ps].float()
        vals = v_cache[ids].reshape(-1, kvh, d)[lo - first * ps: end - first * ps].float()
        qpos = torch.arange(start, end, device=q.device)
        kpos = torch.arange(lo, end, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]
        if window > 0:
            mask &= kpos[None, :] > qpos[:, None] - window
        qs = q[off: off + n].float().reshape(n, kvh, g, d).permute(1, 2, 0, 3)  # [KVH, G, n, d]
        scores = (qs @ keys.permute(1, 2, 0)[:, None]) * scale  # [KVH, G, n, k]
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = probs @ vals.permute(1, 0, 2)[:, None]  # [KVH, G, n, d]
        out[off: off + n] = o.permute(2, 0, 1, 3).reshape(n, h, d).to(q.dtype)
        off += n
    return out


if HAVE_TRITON:

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, tile_ptr, qoff_ptr, start_ptr, qlen_ptr,
        stride_qt, stride_qh, stride_kp, stride_kr, stride_kh, stride_vp, stride_vr, stride_vh,
        stride_ot, stride_oh, stride_tb,
        scale, window, wrap,
        G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        # a tile: its lane, first query (within the lane) and the key pages its rows can see
        lane = tl.load(tile_ptr + tile * 4)
        t0 = tl.load(tile_ptr + tile * 4 + 1)
        first_page = tl.load(tile_ptr + tile * 4 + 2)
        last_page = tl.load(tile_ptr + tile * 4 + 3)
        qoff = tl.load(qoff_ptr + lane)
        start = tl.load(start_ptr + lane)
        qlen = tl.load(qlen_ptr + lane)

        rows = tl.arange(0, BLOCK_R)  # row r: query t0 + r // G, head kv_head * G + r % G
        t_in = t0 + rows // G
        head = kv_head * G + rows % G
        row_ok = (rows < BLOCK_T * G) & (t_in < qlen)
        qpos = start + t_in
        dims = tl.arange(0, BLOCK_D)
        d_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + (qoff + t_in)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_R], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        cols = tl.arange(0, PAGE)
        for pg in range(first_page, last_page + 1):
            slot_pg = tl.where(wrap > 0, pg % tl.maximum(wrap, 1), pg)
            page = tl.load(table_ptr + lane * stride_tb + slot_pg).to(tl.int64)
            kpos = pg * PAGE + cols
            k = tl.load(k_ptr + page * stride_kp + cols[:, None] * stride_kr + kv_head * stride_kh + dims[None, :],
                        mask=d_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [BLOCK_R, PAGE]
            ok = (kpos[None, :] <= qpos[:, None]) & row_ok[:, None]
            ok = ok & ((kpos[None, :] > qpos[:, None] - window) | (window <= 0))
            s = tl.where(ok, s, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            p = tl.where(ok, p, 0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + page * stride_vp + cols[:, None] * stride_vr + kv_head * stride_vh + dims[None, :],
                        mask=d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + (qoff + t_in)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


    @triton.jit
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, opart_ptr, lse_ptr,
        stride_qb, stride_qh, stride_kp, stride_kr, stride_kh, stride_vp, stride_vr, stride_vh, stride_tb,
        stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
        scale, window, wrap,
        G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    ):
        """Part `sp` of the key blocks (BLOCK_N keys) lane `lane` sees, for the G query heads of one
        KV head: the part's softmax-normalised output and its log-sum-exp (-inf for an empty part)."""
        lane = tl.program_id(0)
        kv_head = tl.program_id(1)
        sp = tl.program_id(2)
        pos = tl.load(pos_ptr + lane).to(tl.int32)
        lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
        first = lo // BLOCK_N
        nblk = pos // BLOCK_N - first + 1
        per = (nblk + SPLITS - 1) // SPLITS
        b0 = first + sp * per
        b1 = tl.minimum(b0 + per, first + nblk)

        rows = tl.arange(0, GP)
        head = kv_head * G + rows
        row_ok = rows < G
        dims = tl.arange(0, BLOCK_D)
        d_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + lane * stride_qb + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([GP], -1.0e30, tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, BLOCK_D], tl.float32)
        cols = tl.arange(0, BLOCK_N)
        for blk in range(b0, b1):
            key0 = blk * BLOCK_N
            pg = key0 // PAGE
            slot_pg = tl.where(wrap > 0, pg % tl.maximum(wrap, 1), pg)
            page = tl.load(table_ptr + lane * stride_tb + slot_pg).to(tl.int64)
            kpos = key0 + cols
            r = key0 % PAGE + cols
            ok = (kpos <= pos) & (kpos >= lo)  # lo: the window's first key (0 on a global layer)
            ld = ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + page * stride_kp + r[:, None] * stride_kr + kv_head * stride_kh + dims[None, :],
                        mask=ld, other=0.0)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [GP, BLOCK_N]
            s = tl.where(ok[None, :], s, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            p = tl.where(ok[None, :], p, 0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + page * stride_vp + r[:, None] * stride_vr + kv_head * stride_vh + dims[None, :],
                        mask=ld, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
        valid = l_i > 0  # the part saw a key (an empty part: b1 <= b0)
        l_safe = tl.where(valid, l_i, 1.0)
        out = acc / l_safe[:, None]
        lse = tl.where(valid, m_i + tl.log(l_safe), float("-inf"))
        tl.store(opart_ptr + lane * stride_ob + head[:, None] * stride_oh + sp * stride_os + dims[None, :], out,
                 mask=row_ok[:, None] & d_ok[None, :] & valid[:, None])
        tl.store(lse_ptr + lane * stride_lb + head * stride_lh + sp, lse, mask=row_ok)

    @triton.jit
    def _decode_combine_kernel(
        opart_ptr, lse_ptr, o_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_yb, stride_yh,
        SPLITS: tl.constexpr, SP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """Row (lane, head), dims block: the parts weighted by exp(lse - max); empty parts (-inf)
        weigh 0 and their partial rows (never written) are not read."""
        lane = tl.program_id(0)
        head = tl.program_id(1)
        dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = dims < HEAD_DIM
        parts = tl.arange(0, SP)
        lse = tl.load(lse_ptr + lane * stride_lb + head * stride_lh + parts, mask=parts < SPLITS,
                      other=float("-inf"))
        w = tl.exp(lse - tl.max(lse, 0))
        used = lse > float("-inf")
        part = tl.load(opart_ptr + lane * stride_ob + head * stride_oh + parts[:, None] * stride_os + dims[None, :],
                       mask=used[:, None] & d_ok[None, :], other=0.0)
        out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
        tl.store(o_ptr + lane * stride_yb + head * stride_yh + dims, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def decode_block(head_dim: int, page: int) -> int:
    """Keys a decode program reads per step of its loop (a divisor of the page, >= tl.dot's 16)."""
    return min(page, 32 if head_dim <= 256 else 16)


def decode_splits(kv_heads: int, window: int, head_dim: int, page: int, on_cuda: bool = True) -> int:
    """Parts of a decode lane's keys: enough programs for the device at batch 1, never more parts
    than a sliding window has key blocks. Depends on the layer only (not on the batch or a lane's
    length), so a lane's result is the same alone and batched, eager and in a CUDA Graph. The
    interpreter (the CPU tests) runs programs one at a time: a few parts there."""
    s = core_decode_splits(kv_heads, on_cuda)  # core's count for its paged decode, capped below
    if window > 0:
        s = min(s, -(-window // decode_block(head_dim, page)) + 1)
    return s


def decode_attention(q, k_cache, v_cache, tables, positions, window: int, scale: float, wrap: int = 0,
                     splits: int | None = None):
    """One query per lane (q [B, H, D], lane b at `positions[b]`, a device tensor) over its pages:
    the same result as `paged_attention` with qlens all 1, split over the keys (see the module
    docstring). tables int32 [B, W] on q's device. CUDA-graph safe: launch shapes depend on B and
    the layer only."""
    b, h, d = q.shape
    if not use_triton(q):
        starts = [int(p) for p in positions.tolist()]
        return ref_paged_attention(q, k_cache, v_cache, tables, starts, [1] * b, window, scale, wrap)
    kvh = k_cache.shape[2]
    g = h // kvh
    page = k_cache.shape[1]
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("decode_attention needs the head dimension contiguous")
    block_n = decode_block(d, page)
    if page % block_n:
        raise ValueError(f"a page of {page} rows is not a multiple of {block_n}")
    s = splits or decode_splits(kvh, window, d, page, q.is_cuda)
    block_d = triton.next_power_of_2(d)
    opart = torch.empty(b, h, s, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(b, kvh, s)](
        q, k_cache, v_cache, tables, positions, opart, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), tables.stride(0),
        opart.stride(0), opart.stride(1), opart.stride(2), lse.stride(0), lse.stride(1),
        float(scale), int(window), int(wrap),
        G=g, GP=max(16, triton.next_power_of_2(g)), HEAD_DIM=d, BLOCK_D=block_d, PAGE=page, BLOCK_N=block_n,
        SPLITS=s, num_warps=4,
    )
    out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    cd = min(block_d, 128)
    _decode_combine_kernel[(b, h, triton.cdiv(d, cd))](
        opart, lse, out, opart.stride(0), opart.stride(1), opart.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        SPLITS=s, SP=triton.next_power_of_2(s), HEAD_DIM=d, BLOCK_D=cd, num_warps=4,
    )
    return out


def tiles(starts, qlens, block_t: int, window: int, page: int) -> list[list[int]]:
    """[lane, first query, first key page, last key page] of every tile (host arithmetic, so the
    kernel loops over exactly the pages a tile's rows can see)."""
    out = []
    for b, (start, n) in enumerate(zip(starts, qlens)):
        start, n = int(start), int(n)
        for t0 in range(0, n, block_t):
            last_q = start + min(t0 + block_t, n) - 1
            lo = max(0, start + t0 - window + 1) if window > 0 else 0
            out.append([b, t0, lo // page, last_q // page])
    return out


def block_rows(g: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_T query positions, BLOCK_R rows) of a tile: at least 16 rows (tl.dot's minimum),
    fewer for wide heads so the fp32 accumulator [rows, head_dim] stays within registers."""
    target = 64 if head_dim <= 128 else 32 if head_dim <= 256 else 16
    rows = max(16, triton.next_power_of_2(g)) if HAVE_TRITON else max(16, g)
    while rows < target:
        rows *= 2
    return max(1, rows // g), rows


def paged_attention(q, k_cache, v_cache, tables, starts, qlens, window: int, scale: float, wrap: int = 0,
                    meta=None):
    """See the module docstring. `tables` is an int32 tensor [B, W] on q's device (or lists for the
    reference); starts, qlens: lists of ints. `meta`: (tiles int32 [n, 4], per_lane int32 [3, B])
    already on the device (`kernel_meta`, the CUDA-Graph decode), in place of starts and qlens."""
    if not use_triton(q):
        return ref_paged_attention(q, k_cache, v_cache, tables, starts, qlens, window, scale, wrap)
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    g = h // kvh
    page = k_cache.shape[1]
    dev = q.device
    if not isinstance(tables, torch.Tensor):
        width = max(len(x) for x in tables)
        tables = torch.tensor([list(x) + [0] * (width - len(x)) for x in tables], dtype=torch.int32, device=dev)
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged_attention needs the head dimension contiguous")
    block_t, block_r = block_rows(g, d)
    out = torch.empty_like(q)
    if meta is None:
        meta = kernel_meta(starts, qlens, block_t, window, page, dev)
        if meta is None:
            return out
    tile_meta, per_lane = meta
    _paged_attention_kernel[(tile_meta.shape[0], kvh)](
        q, k_cache, v_cache, out, tables, tile_meta, per_lane[0], per_lane[1], per_lane[2],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), tables.stride(0),
        float(scale), int(window), int(wrap),
        G=g, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), PAGE=page, BLOCK_T=block_t, BLOCK_R=block_r,
    )
    return out


def host_meta(starts, qlens, block_t: int, window: int, page: int) -> tuple[list[list[int]], list[list[int]]]:
    """(tiles, per_lane [qoffs, starts, qlens]) as host lists."""
    qoffs, acc = [], 0
    for n in qlens:
        qoffs.append(acc)
        acc += int(n)
    return tiles(starts, qlens, block_t, window, page), [qoffs, [int(s) for s in starts], [int(n) for n in qlens]]


def kernel_meta(starts, qlens, block_t: int, window: int, page: int, device):
    tile_rows, per_lane = host_meta(starts, qlens, block_t, window, page)
    if not tile_rows:
        return None
    return (torch.tensor(tile_rows, dtype=torch.int32, device=device),
            torch.tensor(per_lane, dtype=torch.int32, device=device))
