"""Triton kernels of Flash-Next's indexed (sparse) attention, each with the torch reference it is
tested against (tests/test_flash_next_sparse_kernels.py, under TRITON_INTERPRET=1 on the CPU).

Per query row t (a lane `lane[t]`, a position `qpos[t]`, nb = (qpos + 1) // ratio complete blocks):

- `index_scores`: score[t, b] = sum_h relu(q_i[t, h] . kb[lane, b]) / sqrt(d_i) for b < nb[t]
  (fp32; -1 past nb: scores are >= 0), kb the pooled block keys (`pooled_block_keys`, torch).
- `topk_blocks`: the `k` best blocks of each row, in ascending block order. An exact threshold
  search (31 passes of a bit-wise binary search over the scores' fp32 bits, which order like the
  values for scores >= 0), then one pass emitting every block above the threshold and the lowest
  indexed of those equal to it: ties resolve to the lowest block index (torch.topk leaves them
  unspecified, so no implementation can promise transformers' choice on exact ties).
- `sparse_attention`: GQA attention of each row over its kept keys only: the selected blocks
  (sparse rows, nb > k) or every complete block (dense rows), then the tail (the incomplete last
  block up to the query itself). Keys are gathered from the paged cache through the lane's block
  table; a row's keys are split flash-decoding style when there are few rows, and the splits are
  combined by core's log-sum-exp kernel. Every row reads at most budget + ratio - 1 keys.

Hand-written because the selection and the gathered keys are this model's own: core's paged
kernels (which the dense prefill prefix still uses) read contiguous causal prefixes.
"""

from __future__ import annotations

import math

import torch

from ninfer_core.accel import use_triton
from ninfer_core.nn.layers import apply_rotary

try:
    import triton
    import triton.language as tl

    from ninfer_core.accel.kernels import COMBINE_MAX_SPLITS, _decode_combine_kernel

    HAVE_TRITON = True
except Exception:  # noqa: BLE001 - pragma: no cover - depends on the install
    triton = tl = None
    HAVE_TRITON = False

TARGET_PROGRAMS = 528  # ~4 waves over the H200's 132 SMs (as core's prefill split heuristic)


# ------------------------------------------------------------------------------------------------
# torch references
# ------------------------------------------------------------------------------------------------
def pooled_block_keys(raw: torch.Tensor, k_norm, rotary, ratio: int) -> torch.Tensor:
    """raw [L, nb * ratio, d] index keys of L lanes -> [L, nb, d] block keys: the mean of each block
    (fp32, then the keys' dtype), the indexer's k norm, RoPE at the block's first position."""
    lanes, n, d = raw.shape
    nb = n // ratio
    pooled = k_norm(raw.reshape(lanes, nb, ratio, d).float().mean(dim=2).to(raw.dtype))
    cos, sin = rotary.cos_sin(torch.arange(nb, device=raw.device) * ratio, pooled.dtype)
    flat = pooled.transpose(0, 1)  # [nb, L, d]: every lane's block b turns by block b's angle
    return apply_rotary(flat, cos, sin).transpose(0, 1).contiguous()


def ref_index_scores(q, kb, lane, nb):
    """q [T, h, d]; kb [L, NB, d]; lane, nb [T] int -> [T, NB] fp32 (-1 where b >= nb[t])."""
    keys = kb[lane.long()].float()  # [T, NB, d]
    s = torch.relu(torch.einsum("thd,tbd->tbh", q.float(), keys)).sum(-1) / math.sqrt(q.shape[-1])
    cols = torch.arange(kb.shape[1], device=q.device)
    return torch.where(cols[None, :] < nb[:, None].long(), s, torch.full_like(s, -1.0))


def ref_topk_blocks(scores, nb, k: int):
    """The k best of scores[t, :nb[t]] per row, ties to the lowest index, ascending -> [T, k] int32."""
    out = torch.empty((scores.shape[0], k), dtype=torch.int32, device=scores.device)
    for t in range(scores.shape[0]):
        row = scores[t, : int(nb[t])].clamp_min(0.0)
        order = torch.sort(row, descending=True, stable=True).indices[:k]
        out[t] = order.sort().values.to(torch.int32)
    return out


def kept_positions(qpos: int, sel_row, sparse: bool, ratio: int) -> torch.Tensor:
    """The key positions one row attends (ascending): selected or all complete blocks, then the tail."""
    nb = (qpos + 1) // ratio
    blocks = sel_row.long() if sparse else torch.arange(nb)
    inner = (blocks[:, None] * ratio + torch.arange(ratio)[None, :]).reshape(-1)
    return torch.cat([inner.cpu(), torch.arange(nb * ratio, qpos + 1)])


def ref_sparse_attention(q, k_cache, v_cache, block_table, lane, qpos, sel, sparse, ratio: int, scale: float):
    """q [T, H, D]; caches [P, page, KVH, D]; block_table [L, W]; lane, qpos, sparse [T]; sel [T, k]
    (rows with sparse[t] false ignore theirs). fp32 softmax; returns [T, H, D] in q's dtype."""
    t_rows, h, d = q.shape
    page, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for t in range(t_rows):
        pos = kept_positions(int(qpos[t]), sel[t].cpu(), bool(sparse[t]), ratio).to(q.device)
        pages = block_table[int(lane[t])].long()[pos // page]
        k = k_cache[pages, pos % page].float()  # [n, KVH, D]
        v = v_cache[pages, pos % page].float()
        qi = q[t].float().reshape(kvh, h // kvh, d)
        p = torch.softmax(torch.einsum("kgd,nkd->kgn", qi, k) * scale, dim=-1)
        out[t] = torch.einsum("kgn,nkd->kgd", p, v).reshape(h, d).to(q.dtype)
    return out


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------
if HAVE_TRITON:

    @triton.jit
    def _index_scores_kernel(Q, KB, LANE, NB, S, s_qt, s_qh, s_kl, s_kb, s_st, NBMAX, sqrt_d,
                             HI: tl.constexpr, HP: tl.constexpr, DI: tl.constexpr, BN: tl.constexpr,
                             IEEE: tl.constexpr):
        t = tl.program_id(0)
        jb = tl.program_id(1)
        lane = tl.load(LANE + t).to(tl.int64)
        nb = tl.load(NB + t)
        offs_h = tl.arange(0, HP)
        offs_d = tl.arange(0, DI)
        offs_b = jb * BN + tl.arange(0, BN)
        valid = offs_b < nb
        q = tl.load(Q + t * s_qt + offs_h[:, None] * s_qh + offs_d[None, :], mask=(offs_h < HI)[:, None], other=0.0)
        kb = tl.load(KB + lane * s_kl + offs_b[:, None] * s_kb + offs_d[None, :], mask=valid[:, None], other=0.0)
        if IEEE:  # fp32 inputs: no TF32 rounding (the references are fp32)
            s = tl.dot(q, tl.trans(kb), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kb))  # [HP, BN] fp32; padded heads are 0 and relu keeps them 0
        score = tl.sum(tl.maximum(s, 0.0), 0) / sqrt_d
        tl.store(S + t * s_st + offs_b, tl.where(valid, score, -1.0), mask=offs_b < NBMAX)

    @triton.jit
    def _topk_kernel(S, NB, SEL, s_st, s_sel, K, BN: tl.constexpr):
        t = tl.program_id(0)
        nb = tl.load(NB + t)
        offs = tl.arange(0, BN)
        row = S + t * s_st
        # the k-th largest score's bits: the largest thr with count(bits >= thr) >= K
        thr = nb * 0
        for i in range(31):
            cand = thr | (1 << (30 - i))
            cnt = nb * 0
            for start in range(0, nb, BN):
                m = start + offs < nb
                x = tl.load(row + start + offs, mask=m, other=0.0).to(tl.int32, bitcast=True)
                x = tl.where(m, tl.maximum(x, 0), -1)  # -0.0 reads as 0.0
                cnt += tl.sum((x >= cand).to(tl.int32), 0)
            thr = tl.where(cnt >= K, cand, thr)
        gt = nb * 0
        for start in range(0, nb, BN):
            m = start + offs < nb
            x = tl.load(row + start + offs, mask=m, other=0.0).to(tl.int32, bitcast=True)
            x = tl.where(m, tl.maximum(x, 0), -1)
            gt += tl.sum((x > thr).to(tl.int32), 0)
        need = K - gt  # blocks equal to the threshold that are kept, lowest index first
        written = nb * 0
        eq_seen = nb * 0
        for start in range(0, nb, BN):
            m = start + offs < nb
            x = tl.load(row + start + offs, mask=m, other=0.0).to(tl.int32, bitcast=True)
            x = tl.where(m, tl.maximum(x, 0), -1)
            is_eq = (x == thr).to(tl.int32)
            eq_rank = eq_seen + tl.cumsum(is_eq, 0) - is_eq
            keep = ((x > thr) | ((is_eq > 0) & (eq_rank < need))).to(tl.int32)
            at = written + tl.cumsum(keep, 0) - keep
            tl.store(SEL + t * s_sel + at, start + offs, mask=keep > 0)
            written += tl.sum(keep, 0)
            eq_seen += tl.sum(is_eq, 0)

    @triton.jit
    def _sparse_attn_kernel(Q, K, V, BT, LANE, QPOS, SEL, SPARSE, OUT, O_PART, LSE, scale, KT, VPS,
                            s_qt, s_qh, s_kp, s_kr, s_kh, s_bt, s_sel, s_ot, s_oh,
                            s_pt, s_ph, s_ps, s_lt, s_lh,
                            G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                            R: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr):
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        lane = tl.load(LANE + t).to(tl.int64)
        qpos = tl.load(QPOS + t)
        sparse_i = tl.load(SPARSE + t)
        nb = (qpos + 1) // R
        nblk = tl.where(sparse_i != 0, KT, nb)
        n_in = nblk * R  # keys of the kept complete blocks; the tail follows
        n_virt = n_in + qpos + 1 - nb * R
        v0 = sp * VPS
        v1 = tl.minimum(v0 + VPS, n_virt)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BN)
        gmask = offs_g < G
        heads = kvh * G + offs_g
        q = tl.load(Q + t * s_qt + heads[:, None] * s_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for start in range(v0, v1, BN):
            v = start + offs_n
            valid = v < v1
            in_blocks = v < n_in
            slot = v // R
            use_sel = valid & in_blocks & ((offs_n * 0 + sparse_i) != 0)
            chosen = tl.load(SEL + t * s_sel + slot, mask=use_sel, other=0)
            blk = tl.where(use_sel, chosen, slot)
            pos = tl.where(in_blocks, blk * R + v % R, nb * R + v - n_in)
            pos = tl.where(valid, pos, 0)
            page = tl.load(BT + lane * s_bt + pos // PAGE, mask=valid, other=0).to(tl.int64)
            off = page * s_kp + (pos % PAGE).to(tl.int64) * s_kr + kvh * s_kh
            k = tl.load(K + off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            pr = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(pr, 1)
            vv = tl.load(V + off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(pr.to(vv.dtype), vv, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(pr.to(vv.dtype), vv)
            m = m_new
        l_safe = tl.where(l > 0, l, 1.0)
        out = acc / l_safe[:, None]
        if SPLIT:
            lse = tl.where(v1 > v0, m + tl.log(l_safe), float("-inf"))
            tl.store(O_PART + t * s_pt + heads[:, None] * s_ph + sp * s_ps + offs_d[None, :], out,
                     mask=gmask[:, None])
            tl.store(LSE + t * s_lt + heads * s_lh + sp, lse, mask=gmask)
        else:
            tl.store(OUT + t * s_ot + heads[:, None] * s_oh + offs_d[None, :], out.to(OUT.dtype.element_ty),
                     mask=gmask[:, None])


def index_scores(q, kb, lane, nb, block_n: int = 64):
    """See ref_index_scores. q [T, h, d] (d a power of two), kb [L, NB, d], lane/nb int32 [T]."""
    if not use_triton(q):
        return ref_index_scores(q, kb, lane, nb)
    t, h, d = q.shape
    nbmax = kb.shape[1]
    assert q.stride(2) == 1 and kb.stride(2) == 1
    out = torch.empty((t, nbmax), dtype=torch.float32, device=q.device)
    if t == 0 or nbmax == 0:
        return out
    _index_scores_kernel[(t, triton.cdiv(nbmax, block_n))](
        q, kb, lane, nb, out, q.stride(0), q.stride(1), kb.stride(0), kb.stride(1), out.stride(0), nbmax,
        math.sqrt(d), HI=h, HP=max(16, triton.next_power_of_2(h)), DI=d, BN=block_n,
        IEEE=q.dtype == torch.float32, num_warps=4)
    return out


def topk_blocks(scores, nb, k: int, block_n: int = 1024):
    """See ref_topk_blocks; every row needs nb[t] >= k. scores [T, NB] fp32, nb int32 [T]."""
    if not use_triton(scores):
        return ref_topk_blocks(scores, nb, k)
    out = torch.empty((scores.shape[0], k), dtype=torch.int32, device=scores.device)
    if scores.shape[0]:
        bn = min(block_n, max(16, triton.next_power_of_2(scores.shape[1])))
        _topk_kernel[(scores.shape[0],)](scores, nb, out, scores.stride(0), out.stride(0), k, BN=bn, num_warps=4)
    return out


def attention_splits(rows: int, kv_heads: int, max_keys: int, block_n: int) -> int:
    """Key splits per row: enough programs to fill the device when there are few rows (decode)."""
    programs = max(1, rows * kv_heads)
    if programs >= TARGET_PROGRAMS // 2:
        return 1
    return max(1, min(-(-TARGET_PROGRAMS // programs), -(-max_keys // block_n), COMBINE_MAX_SPLITS))


def sparse_attention(q, k_cache, v_cache, block_table, lane, qpos, sel, sparse, ratio: int, block_topk: int,
                     scale: float, max_keys: int | None = None, block_n: int = 32, splits: int | None = None):
    """See ref_sparse_attention. block_table int32 [L, W]; lane, qpos, sparse int32 [T]; sel int32
    [T, block_topk]. `max_keys`: an upper bound of any row's kept keys (default budget + ratio - 1);
    `splits` (default attention_splits) > 1 splits each row's keys and combines by log-sum-exp."""
    if not use_triton(q):
        return ref_sparse_attention(q, k_cache, v_cache, block_table, lane, qpos, sel, sparse, ratio, scale)
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    out = torch.empty_like(q)
    if t == 0:
        return out
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and block_table.stride(1) == 1
    keys = max_keys or block_topk * ratio + ratio - 1
    splits = splits or attention_splits(t, kvh, keys, block_n)
    vps = -(-keys // splits)
    vps = -(-vps // block_n) * block_n
    splits = -(-keys // vps)
    if splits > 1:
        o_part = torch.empty(t, h, splits, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(t, h, splits, dtype=torch.float32, device=q.device)
    else:
        o_part = lse = out  # unused
    _sparse_attn_kernel[(t, kvh, splits)](
        q, k_cache, v_cache, block_table, lane, qpos, sel, sparse, out, o_part, lse, scale, block_topk, vps,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        sel.stride(0), out.stride(0), out.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2) if splits > 1 else 0, lse.stride(0), lse.stride(1),
        G=h // kvh, GP=max(16, triton.next_power_of_2(h // kvh)), D=d, PAGE=k_cache.shape[1], R=ratio,
        BN=block_n, SPLIT=splits > 1, IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2 if q.is_cuda else 1)
    if splits > 1:
        _decode_combine_kernel[(t, h)](
            o_part, lse, out, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), splits, H=h, SP=COMBINE_MAX_SPLITS, D=d, num_warps=4)
    return out
