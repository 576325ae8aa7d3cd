"""Triton kernels of the GPU path, each with the torch reference it is tested against.

- `paged_decode_attention`: one query per lane over that lane's KV pages (lanes of different
  lengths), GQA by packing a KV head's query heads into one tile, split over pages
  (flash-decoding) and combined by log-sum-exp.
- `paged_prefill_attention`: a chunk of T queries of one sequence over its cached prefix pages and
  itself, causal.
- (norms, SiLU, conv, q/k norm + RoPE: `fused_kernels`, re-exported here)
- `gdn_decode_inplace`: one Gated DeltaNet step per lane: gate and beta from the raw projections,
  L2-normalised q/k (GVA: value head h reads key head h // (HV / HK)), the delta rule on the
  fp32 state read from and written back to the lane's state slot in place.

Kernels run when triton is importable and the tensors are on CUDA, or on the CPU under
TRITON_INTERPRET=1 (the kernel tests); otherwise the torch references run.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

try:  # triton is optional: the CPU reference path never needs it
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    triton = tl = None
    HAVE_TRITON = False


from ninfer_core.accel import use_triton


# ------------------------------------------------------------------------------------------------
# torch references
# ------------------------------------------------------------------------------------------------
def ref_paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, key_start: int = 0):
    """q [B, H, D]; caches [P, page, KVH, D]; block_table [B, W] int; seq_lens [B] (keys per lane,
    the new token included); keys before `key_start` are skipped (a draft head has no key at
    position 0). Returns [B, H, D] in q's dtype (fp32 softmax)."""
    b, h, d = q.shape
    page, kvh = k_cache.shape[1], k_cache.shape[2]
    g = h // kvh
    out = torch.empty_like(q)
    for i in range(b):
        n = int(seq_lens[i])
        pages = block_table[i, : -(-n // page)].long()
        k = k_cache[pages].reshape(-1, kvh, d)[key_start:n].float()  # [n, KVH, D]
        v = v_cache[pages].reshape(-1, kvh, d)[key_start:n].float()
        qi = q[i].float().reshape(kvh, g, d)
        s = torch.einsum("kgd,nkd->kgn", qi, k) * scale
        p = torch.softmax(s, dim=-1)
        out[i] = torch.einsum("kgn,nkd->kgd", p, v).reshape(h, d).to(q.dtype)
    return out


def ref_paged_prefill_attention(q, k_cache, v_cache, pages, start, scale):
    """q [T, H, D] at positions start..start+T-1; pages [n] int (the sequence's page ids). Keys
    0..start+T-1 must already be in the cache. Returns [T, H, D] (causal, fp32 softmax)."""
    t, h, d = q.shape
    page, kvh = k_cache.shape[1], k_cache.shape[2]
    g = h // kvh
    total = start + t
    idx = pages[: -(-total // page)].long()
    k = k_cache[idx].reshape(-1, kvh, d)[:total].float()
    v = v_cache[idx].reshape(-1, kvh, d)[:total].float()
    qf = q.float().reshape(t, kvh, g, d)
    s = torch.einsum("tkgd,nkd->kgtn", qf, k) * scale
    qpos = torch.arange(start, total, device=q.device)
    kpos = torch.arange(total, device=q.device)
    s = s.masked_fill(~(kpos[None, :] <= qpos[:, None]), float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("kgtn,nkd->tkgd", p, v)
    return o.reshape(t, h, d).to(q.dtype)


def ref_gdn_decode(mixed, a_raw, b_raw, A_log, dt_bias, state, slots, hk, dk, dv, scale, eps=1e-6):
    """mixed [B, 2*HK*dk + HV*dv] (conv output, after SiLU); a_raw, b_raw [B, HV]; state
    [S, HV, dk, dv] fp32 updated in place at `slots`. Returns out [B, HV, dv] in mixed's dtype."""
    bsz = mixed.shape[0]
    hv = a_raw.shape[1]
    q, k, v = torch.split(mixed.float(), [hk * dk, hk * dk, hv * dv], dim=-1)
    q = q.reshape(bsz, hk, dk).repeat_interleave(hv // hk, dim=1)
    k = k.reshape(bsz, hk, dk).repeat_interleave(hv // hk, dim=1)
    v = v.reshape(bsz, hv, dv)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps) * scale
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
    g = -A_log.float().exp() * F.softplus(a_raw.float() + dt_bias.float())
    beta = torch.sigmoid(b_raw.float())
    idx = slots.long()
    s = state[idx] * g.exp()[..., None, None]
    kv = torch.einsum("bhk,bhkv->bhv", k, s)
    u = beta[..., None] * (v - kv)
    s = s + k[..., :, None] * u[..., None, :]
    out = torch.einsum("bhk,bhkv->bhv", q, s)
    state[idx] = s
    return out.to(mixed.dtype)


# ------------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------------
if HAVE_TRITON:

    @triton.jit
    def _paged_decode_kernel(
        Q, K, V, BT, LENS, O_PART, LSE_PART, scale,
        s_qb, s_qh, s_kp, s_kr, s_kh, s_bt, s_ob, s_oh, s_os, s_lb, s_lh,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, SPLITS: tl.constexpr,
        KSTART: tl.constexpr = 0,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        seq_len = tl.load(LENS + b)
        n_pages = (seq_len + PAGE - 1) // PAGE
        pps = (n_pages + SPLITS - 1) // SPLITS  # the lane's own pages in SPLITS parts
        p0 = sp * pps
        p1 = tl.minimum(p0 + pps, n_pages)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        offs_r = tl.arange(0, PAGE)
        gmask = offs_g < G
        heads = kvh * G + offs_g
        q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for p in range(p0, p1):
            page = tl.load(BT + b * s_bt + p).to(tl.int64)
            off = page * s_kp + offs_r[:, None] * s_kr + kvh * s_kh + offs_d[None, :]
            k = tl.load(K + off)
            s = tl.dot(q, tl.trans(k)) * scale
            pos = p * PAGE + offs_r
            s = tl.where((pos[None, :] < seq_len) & (pos[None, :] >= KSTART), s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            if KSTART > 0:  # a page whose every key is skipped keeps m at -inf
                m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_new)
            pr = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(pr, 1)
            v = tl.load(V + off)
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
            m = m_new
        valid = l > 0  # the part saw a key: an empty part's row is not stored (nor read by the combine)
        l_safe = tl.where(valid, l, 1.0)
        out = acc / l_safe[:, None]
        lse = tl.where(valid, m + tl.log(l_safe), float("-inf"))
        tl.store(O_PART + b * s_ob + heads[:, None] * s_oh + sp * s_os + offs_d[None, :], out,
                 mask=(gmask & valid)[:, None])
        tl.store(LSE_PART + b * s_lb + heads * s_lh + sp, lse, mask=gmask)

    # start / T / PPS vary with every resumed prefix and capture split: not specialised, so a new
    # alignment never triggers a compile inside a request's time to first token.
    @triton.jit(do_not_specialize=["start", "T", "PPS"])
    def _paged_prefill_kernel(
        Q, K, V, BT, O, O_PART, LSE_PART, start, T, scale, PPS,
        s_qt, s_qh, s_kp, s_kr, s_kh, s_ot, s_oh, s_pt, s_ph, s_ps, s_lt, s_lh,
        G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BM: tl.constexpr, SPLIT: tl.constexpr,
    ):
        mb = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        kvh = h // G
        offs_m = mb * BM + tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        offs_r = tl.arange(0, PAGE)
        mmask = offs_m < T
        qpos = start + offs_m
        q = tl.load(Q + offs_m[:, None] * s_qt + h * s_qh + offs_d[None, :], mask=mmask[:, None], other=0.0)
        last = tl.minimum(start + (mb + 1) * BM, start + T) - 1
        n_pages = last // PAGE + 1
        p0 = 0
        p1 = n_pages
        if SPLIT:
            p0 = sp * PPS
            p1 = tl.minimum(p0 + PPS, n_pages)
        m = tl.full([BM], float("-inf"), tl.float32)
        l = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        for p in range(p0, p1):
            page = tl.load(BT + p).to(tl.int64)
            off = page * s_kp + offs_r[:, None] * s_kr + kvh * s_kh + offs_d[None, :]
            k = tl.load(K + off)
            s = tl.dot(q, tl.trans(k)) * scale
            kpos = p * PAGE + offs_r
            s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet in this split
            alpha = tl.exp(m - m_safe)
            pr = tl.exp(s - m_safe[:, None])
            l = l * alpha + tl.sum(pr, 1)
            v = tl.load(V + off)
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
            m = m_new
        l_safe = tl.where(l > 0, l, 1.0)
        out = acc / l_safe[:, None]
        if SPLIT:
            lse = tl.where(l > 0, m + tl.log(l_safe), float("-inf"))
            tl.store(O_PART + offs_m[:, None] * s_pt + h * s_ph + sp * s_ps + offs_d[None, :], out,
                     mask=mmask[:, None])
            tl.store(LSE_PART + offs_m * s_lt + h * s_lh + sp, lse, mask=mmask)
        else:
            tl.store(O + offs_m[:, None] * s_ot + h * s_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                     mask=mmask[:, None])

    @triton.jit
    def _gdn_decode_kernel(
        MIXED, A_RAW, B_RAW, A_LOG, DT_BIAS, STATE, SLOTS, OUT, scale, eps,
        s_mb, s_ab, s_bb, s_s0, s_s1, s_s2, s_ob, s_oh,
        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    ):
        b = tl.program_id(0)
        hv = tl.program_id(1)
        iv = tl.program_id(2)
        hk = hv // (HV // HK)
        slot = tl.load(SLOTS + b).to(tl.int64)
        offs_k = tl.arange(0, DK)
        offs_v = iv * BV + tl.arange(0, BV)
        row = MIXED + b * s_mb
        q = tl.load(row + hk * DK + offs_k).to(tl.float32)
        k = tl.load(row + HK * DK + hk * DK + offs_k).to(tl.float32)
        v = tl.load(row + 2 * HK * DK + hv * DV + offs_v).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
        k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
        x = tl.load(A_RAW + b * s_ab + hv).to(tl.float32) + tl.load(DT_BIAS + hv).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = -tl.exp(tl.load(A_LOG + hv).to(tl.float32)) * softplus
        beta = tl.sigmoid(tl.load(B_RAW + b * s_bb + hv).to(tl.float32))
        sp = STATE + slot * s_s0 + hv * s_s1 + offs_k[:, None] * s_s2 + offs_v[None, :]
        s = tl.load(sp) * tl.exp(g)
        kv = tl.sum(s * k[:, None], 0)
        u = beta * (v - kv)
        s = s + k[:, None] * u[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(sp, s)
        tl.store(OUT + b * s_ob + hv * s_oh + offs_v, o.to(OUT.dtype.element_ty))

    # S (the split count) is a runtime value and SP a fixed bound, so a new split count never
    # compiles a new kernel inside a request.
    @triton.jit
    def _combine_splits(O_PART, LSE, b, h, s_ob, s_oh, s_os, s_lb, s_lh, S, SP: tl.constexpr, D: tl.constexpr):
        """Row (b, h) of the split partial outputs combined by their log-sum-exp weights (fp32 [D])."""
        offs_s = tl.arange(0, SP)
        offs_d = tl.arange(0, D)
        smask = offs_s < S
        lse = tl.load(LSE + b * s_lb + h * s_lh + offs_s, mask=smask, other=float("-inf"))
        top = tl.max(lse, 0)
        w = tl.exp(lse - top)  # empty splits: exp(-inf) = 0
        part = tl.load(O_PART + b * s_ob + h * s_oh + offs_s[:, None] * s_os + offs_d[None, :],
                       mask=(smask & (lse > float("-inf")))[:, None], other=0.0)  # empty parts: not written
        return tl.sum(part * w[:, None], 0) / tl.sum(w, 0)

    @triton.jit(do_not_specialize=["S"])
    def _decode_combine_kernel(O_PART, LSE, OUT, s_ob, s_oh, s_os, s_lb, s_lh, s_qb, s_qh, S,
                               H: tl.constexpr, SP: tl.constexpr, D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        out = _combine_splits(O_PART, LSE, b, h, s_ob, s_oh, s_os, s_lb, s_lh, S, SP, D)
        tl.store(OUT + b * s_qb + h * s_qh + tl.arange(0, D), out.to(OUT.dtype.element_ty))


COMBINE_MAX_SPLITS = 64


def ref_gdn_prefill_recurrent(mixed, a_raw, b_raw, A_log, dt_bias, state, slot: int, hk, dk, dv, scale, eps=1e-6):
    """T tokens of one sequence, one recurrent step after the other (ref_gdn_decode per token);
    state[slot] is read and written in place. Returns [T, HV, dv]."""
    slots = torch.tensor([slot], dtype=torch.int64, device=mixed.device)
    outs = [ref_gdn_decode(mixed[i:i + 1], a_raw[i:i + 1], b_raw[i:i + 1], A_log, dt_bias, state, slots,
                           hk, dk, dv, scale, eps) for i in range(mixed.shape[0])]
    return torch.cat(outs)


if HAVE_TRITON:

    @triton.jit
    def gdn_token_step(row, a_ptr, b_ptr, s, neg_a, dtb, hk, hv, offs_k, offs_v, scale, eps,
                       HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
        """One gated delta step of a (value head, value slice) program on the state tile `s`
        [DK, BV] (fp32): the token's q/k/v from its conv-output row, the gate and beta from its raw
        a/b. Returns (new state, normalised q) -- the short-chunk and verify kernels' shared body."""
        q = tl.load(row + hk * DK + offs_k).to(tl.float32)
        k = tl.load(row + HK * DK + hk * DK + offs_k).to(tl.float32)
        v = tl.load(row + 2 * HK * DK + hv * DV + offs_v).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
        k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
        x = tl.load(a_ptr).to(tl.float32) + dtb
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        beta = tl.sigmoid(tl.load(b_ptr).to(tl.float32))
        s = s * tl.exp(neg_a * softplus)
        kv = tl.sum(s * k[:, None], 0)
        u = beta * (v - kv)
        s = s + k[:, None] * u[None, :]
        return s, q

    @triton.jit(do_not_specialize=["T", "slot"])
    def _gdn_prefill_recurrent_kernel(
        MIXED, A_RAW, B_RAW, A_LOG, DT_BIAS, STATE, OUT, T, slot, scale, eps,
        s_mt, s_at, s_bt, s_s0, s_s1, s_s2, s_ot, s_oh,
        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    ):
        hv = tl.program_id(0)
        iv = tl.program_id(1)
        hk = hv // (HV // HK)
        offs_k = tl.arange(0, DK)
        offs_v = iv * BV + tl.arange(0, BV)
        sp = STATE + slot * s_s0 + hv * s_s1 + offs_k[:, None] * s_s2 + offs_v[None, :]
        s = tl.load(sp)
        neg_a = -tl.exp(tl.load(A_LOG + hv).to(tl.float32))
        dtb = tl.load(DT_BIAS + hv).to(tl.float32)
        row = MIXED
        a_ptr = A_RAW + hv
        b_ptr = B_RAW + hv
        o_ptr = OUT + hv * s_oh + offs_v
        for _t in range(T):  # pointers advance one token per step
            s, q = gdn_token_step(row, a_ptr, b_ptr, s, neg_a, dtb, hk, hv, offs_k, offs_v, scale, eps, HK, DK, DV)
            o = tl.sum(s * q[:, None], 0)
            tl.store(o_ptr, o.to(OUT.dtype.element_ty))
            row += s_mt
            a_ptr += s_at
            b_ptr += s_bt
            o_ptr += s_ot
        tl.store(sp, s)


RECURRENT_PREFILL_MAX_T = 64


def gdn_prefill_recurrent(mixed, a_raw, b_raw, A_log, dt_bias, state, slot: int, hk, dk, dv, scale, eps=1e-6):
    """A short chunk (a capture-split tail, a few resumed tokens) in one launch: the decode step's
    math looped over the tokens inside the kernel, the state held in registers. Replaces the gate
    glue and fla's chunked kernels, whose launches dominate a chunk of a few tokens."""
    if not use_triton(mixed):
        return ref_gdn_prefill_recurrent(mixed, a_raw, b_raw, A_log, dt_bias, state, slot, hk, dk, dv, scale, eps)
    t = mixed.shape[0]
    hv = a_raw.shape[1]
    out = torch.empty(t, hv, dv, dtype=mixed.dtype, device=mixed.device)
    bv = min(32, dv)
    assert mixed.stride(1) == 1 and state.is_contiguous() and a_raw.stride(1) == 1 and b_raw.stride(1) == 1
    _gdn_prefill_recurrent_kernel[(hv, triton.cdiv(dv, bv))](
        mixed, a_raw, b_raw, A_log, dt_bias, state, out, t, slot, scale, eps,
        mixed.stride(0), a_raw.stride(0), b_raw.stride(0),
        state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1),
        HK=hk, HV=hv, DK=dk, DV=dv, BV=bv,
        num_warps=4,
    )
    return out


DECODE_TARGET_PROGRAMS = 256  # about two per SM of the H200's 132 at batch 1 (8 under the interpreter)


def decode_splits(kv_heads: int, on_cuda: bool = True) -> int:
    """Parts a decode lane's pages are split into, from the layer only (not the batch, the table width
    or a lane's length): the same bits alone and batched, eager and in a graph; few in the interpreter."""
    return max(1, min(COMBINE_MAX_SPLITS, (DECODE_TARGET_PROGRAMS if on_cuda else 8) // max(1, kv_heads)))


def _decode_splits(q, k_cache, v_cache, block_table, seq_lens, scale, pages_per_split=None, key_start: int = 0):
    """The split (flash-decoding) pass of paged decode attention: per lane, head and split of the
    pages, the partial output and its log-sum-exp -> (o_part [B, H, S, D] fp32, lse [B, H, S], S)."""
    b, h, d = q.shape
    page, kvh = k_cache.shape[1], k_cache.shape[2]
    g = h // kvh
    w = block_table.shape[1]
    assert seq_lens.is_contiguous() and block_table.stride(1) == 1 and q.is_contiguous()
    splits = -(-w // pages_per_split) if pages_per_split else decode_splits(kvh, q.is_cuda)
    o_part = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(b, kvh, splits)](
        q, k_cache, v_cache, block_table, seq_lens, o_part, lse, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse.stride(0), lse.stride(1),
        G=g, GP=max(16, triton.next_power_of_2(g)), D=d, PAGE=page, SPLITS=splits, KSTART=key_start,
        num_warps=4,
    )
    return o_part, lse, splits


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, pages_per_split=None,
                           key_start: int = 0):
    """See ref_paged_decode_attention. block_table int32 [B, W]; seq_lens int32 [B] on q's device.
    Launch shapes depend only on B and W, so the call is CUDA-graph safe."""
    if not use_triton(q):
        return ref_paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, key_start)
    b, h, d = q.shape
    o_part, lse, splits = _decode_splits(q, k_cache, v_cache, block_table, seq_lens, scale, pages_per_split,
                                         key_start)
    out = torch.empty_like(q)
    _decode_combine_kernel[(b, h)](
        o_part, lse, out, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), splits, H=h, SP=COMBINE_MAX_SPLITS, D=d,
        num_warps=4,
    )
    return out


PREFILL_TARGET_PROGRAMS = 528  # ~4 waves over the H200's 132 SMs


def prefill_splits(t: int, heads: int, total_pages: int, block_m: int = 64) -> int:
    """Key splits for a prefill chunk: 1 when the query blocks alone fill the device; else split the
    pages (>= 8 per split) so that a short chunk over a long cached prefix (a resumed conversation)
    still runs on every SM instead of a few programs walking every page."""
    programs = -(-t // block_m) * heads
    if programs >= PREFILL_TARGET_PROGRAMS // 2:
        return 1
    want = -(-PREFILL_TARGET_PROGRAMS // programs)
    return max(1, min(want, total_pages // 8, COMBINE_MAX_SPLITS))


def paged_prefill_attention(q, k_cache, v_cache, pages, start: int, scale, block_m: int = 64,
                            splits: int | None = None):
    """See ref_paged_prefill_attention. pages: int32 tensor of the sequence's page ids. `splits`
    (default: prefill_splits) > 1 splits the keys flash-decoding style and combines by log-sum-exp."""
    if not use_triton(q):
        return ref_paged_prefill_attention(q, k_cache, v_cache, pages, start, scale)
    t, h, d = q.shape
    page, kvh = k_cache.shape[1], k_cache.shape[2]
    assert pages.is_contiguous() and q.stride(2) == 1
    total_pages = -(-(start + t) // page)
    if splits is None:
        splits = prefill_splits(t, h, total_pages, block_m)
    pps = -(-total_pages // max(1, min(splits, COMBINE_MAX_SPLITS)))
    splits = -(-total_pages // pps)
    out = torch.empty_like(q)
    if splits > 1:
        o_part = torch.empty(t, h, splits, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(t, h, splits, dtype=torch.float32, device=q.device)
    else:
        o_part, lse = out, out  # unused
    _paged_prefill_kernel[(triton.cdiv(t, block_m), h, splits)](
        q, k_cache, v_cache, pages, out, o_part, lse, start, t, scale, pps,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2) if splits > 1 else 0,
        lse.stride(0), lse.stride(1),
        G=h // kvh, D=d, PAGE=page, BM=block_m, SPLIT=splits > 1,
        num_warps=8, num_stages=2 if q.is_cuda else 1,
    )
    if splits > 1:
        _decode_combine_kernel[(t, h)](
            o_part, lse, out, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), splits, H=h, SP=COMBINE_MAX_SPLITS, D=d,
            num_warps=4,
        )
    return out


def gdn_decode_inplace(mixed, a_raw, b_raw, A_log, dt_bias, state, slots, hk, dk, dv, scale, eps=1e-6):
    """See ref_gdn_decode. The state slots are read and written in place; CUDA-graph safe."""
    if not use_triton(mixed):
        return ref_gdn_decode(mixed, a_raw, b_raw, A_log, dt_bias, state, slots, hk, dk, dv, scale, eps)
    bsz = mixed.shape[0]
    hv = a_raw.shape[1]
    out = torch.empty(bsz, hv, dv, dtype=mixed.dtype, device=mixed.device)
    bv = min(32, dv)
    assert mixed.stride(1) == 1 and state.is_contiguous() and slots.is_contiguous()
    assert a_raw.stride(1) == 1 and b_raw.stride(1) == 1
    _gdn_decode_kernel[(bsz, hv, triton.cdiv(dv, bv))](
        mixed, a_raw, b_raw, A_log, dt_bias, state, slots, out, scale, eps,
        mixed.stride(0), a_raw.stride(0), b_raw.stride(0),
        state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1),
        HK=hk, HV=hv, DK=dk, DV=dv, BV=bv,
        num_warps=4,
    )
    return out


def softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# norms, SiLU, conv and q/k norm + RoPE live in fused_kernels; re-exported so callers keep kernels.X
from ninfer_core.accel.fused_kernels import (  # noqa: F401
    add_rmsnorm,
    conv_prefill,
    conv_update,
    gated_rmsnorm,
    qk_norm_rope,
    ref_add_rmsnorm,
    ref_conv_prefill,
    ref_conv_update,
    ref_gated_rmsnorm,
    ref_qk_norm_rope,
    ref_silu_mul,
    silu_mul,
)

if HAVE_TRITON:  # the jit functions the decode-step fusions below call
    from ninfer_core.accel.fused_kernels import (  # noqa: F401
        _add_rmsnorm_kernel,
        _conv_prefill_kernel,
        _conv_update_kernel,
        _gated_rmsnorm_kernel,
        _norm_rope_head,
        _qk_norm_rope_kernel,
        _silu_mul_kernel,
    )


# ------------------------------------------------------------------------------------------------
# decode-step fusions (issue 6): the attention decode writes its K/V rows inside the q/k norm +
# RoPE kernel and applies the output gate inside the split combine. Same rounding points as the
# kernel chains they replace.
# ------------------------------------------------------------------------------------------------
def ref_qk_norm_rope_kv(q, k, v, q_w, k_w, cos, sin, eps, k_cache, v_cache, wpage, wrow):
    """ref_qk_norm_rope, and the new k (normed, rotated) and v rows written into the paged caches at
    (wpage[n], wrow[n]). Returns q [N, H, D] contiguous."""
    qo, ko = ref_qk_norm_rope(q, k, q_w, k_w, cos, sin, eps)
    k_cache[wpage, wrow] = ko.to(k_cache.dtype)
    v_cache[wpage, wrow] = v.to(v_cache.dtype)
    return qo


def ref_paged_decode_attention_gated(q, k_cache, v_cache, block_table, seq_lens, scale, gate):
    """ref_paged_decode_attention times sigmoid(gate) (gate [B, H, D], any strides) as
    GatedAttention.finish rounds it (attention output and sigmoid in q's dtype) -> [B, H*D]."""
    o = ref_paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale)
    b = q.shape[0]
    return o.reshape(b, -1) * torch.sigmoid(gate.reshape(b, -1))


if HAVE_TRITON:

    @triton.jit
    def _qk_norm_rope_kv_kernel(Q, K, V, QW, KW, COS, SIN, QO, KC, VC, WPAGE, WROW, eps,
                                s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_cn, s_qon, s_qoh, s_cp, s_cr, s_ch,
                                H: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr):
        """_qk_norm_rope_kernel whose k programs write the rotated k row and the v row straight into
        the paged caches (both caches share one layout) instead of returning k."""
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        out, hk, hvec, d = _norm_rope_head(Q, K, QW, KW, COS, SIN, QO, n, h, eps, s_qn, s_qh, s_kn, s_kh, s_cn,
                                           s_qon, s_qoh, H, D, ROT)
        page = tl.load(WPAGE + n).to(tl.int64)
        dst = page * s_cp + tl.load(WROW + n).to(tl.int64) * s_cr + hk * s_ch + d
        kmask = hvec >= H
        tl.store(KC + dst, out.to(KC.dtype.element_ty), mask=kmask)
        vrow = tl.load(V + n * s_vn + hk * s_vh + d, mask=kmask, other=0.0)
        tl.store(VC + dst, vrow.to(VC.dtype.element_ty), mask=kmask)

    @triton.jit(do_not_specialize=["S"])
    def _decode_combine_gated_kernel(O_PART, LSE, GATE, OUT, s_ob, s_oh, s_os, s_lb, s_lh, s_gb, s_gh, s_yb, S,
                                     H: tl.constexpr, SP: tl.constexpr, D: tl.constexpr):
        """_decode_combine_kernel, then o * sigmoid(gate) rounded as GatedAttention.finish rounds it,
        stored as rows [B, H*D] ready for o_proj."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_d = tl.arange(0, D)
        dt = OUT.dtype.element_ty
        o = _combine_splits(O_PART, LSE, b, h, s_ob, s_oh, s_os, s_lb, s_lh, S, SP, D).to(dt).to(tl.float32)
        g = tl.load(GATE + b * s_gb + h * s_gh + offs_d).to(tl.float32)
        sg = tl.sigmoid(g).to(dt).to(tl.float32)
        tl.store(OUT + b * s_yb + h * D + offs_d, (o * sg).to(dt))


def qk_norm_rope_kv(q, k, v, q_w, k_w, cos, sin, eps, k_cache, v_cache, wpage, wrow):
    """See ref_qk_norm_rope_kv (replaces qk_norm_rope + two index_put launches in a decode step).
    wpage / wrow int64 [N] on the device; q, k, v may be strided views (last dim contiguous)."""
    if not use_triton(q):
        return ref_qk_norm_rope_kv(q, k, v, q_w, k_w, cos, sin, eps, k_cache, v_cache, wpage, wrow)
    n, h, d = q.shape
    kvh = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert cos.stride(1) == 1 and cos.stride(0) == sin.stride(0) and d == triton.next_power_of_2(d)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert wpage.is_contiguous() and wrow.is_contiguous()
    qo = torch.empty(n, h, d, dtype=q.dtype, device=q.device)
    _qk_norm_rope_kv_kernel[(n, h + kvh)](
        q, k, v, q_w, k_w, cos, sin, qo, k_cache, v_cache, wpage, wrow, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        qo.stride(0), qo.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        H=h, D=d, ROT=cos.shape[-1], num_warps=4,
    )
    return qo


def paged_decode_attention_gated(q, k_cache, v_cache, block_table, seq_lens, scale, gate, pages_per_split=None):
    """See ref_paged_decode_attention_gated: the split decode kernel, then one combine launch that
    also applies the output gate (replaces combine + sigmoid + mul + the gate's copy). gate [B, H, D]
    may be a strided view. Returns [B, H*D]; CUDA-graph safe like paged_decode_attention."""
    if not use_triton(q):
        return ref_paged_decode_attention_gated(q, k_cache, v_cache, block_table, seq_lens, scale, gate)
    assert gate.stride(2) == 1
    b, h, d = q.shape
    o_part, lse, splits = _decode_splits(q, k_cache, v_cache, block_table, seq_lens, scale, pages_per_split)
    out = torch.empty(b, h * d, dtype=q.dtype, device=q.device)
    _decode_combine_gated_kernel[(b, h)](
        o_part, lse, gate, out, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        gate.stride(0), gate.stride(1), out.stride(0), splits, H=h, SP=COMBINE_MAX_SPLITS, D=d,
        num_warps=4,
    )
    return out
