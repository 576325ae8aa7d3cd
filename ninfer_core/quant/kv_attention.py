"""Paged attention over quantised KV pages (`--kv-dtype int8 | fp8 | k8v4`), dequantised in-kernel.

The pages are `ninfer_core.quant.kv`'s layout: data [P, page, kv_heads, D] int8 / float8_e4m3fn, or
[P, page, kv_heads, D / 2] uint8 (int4, two per byte, low nibble = even column, value + 8), and one
fp32 scale per token and KV head [P, page, kv_heads]. A side stored in the model dtype (no scale)
is read as it is, so one kernel serves every KVFormat.

- `paged_decode_attention`: one query per lane over that lane's pages (lanes of different lengths),
  GQA by packing a KV head's query heads into one tile, split over pages (flash-decoding) and
  combined by log-sum-exp. Launch shapes depend only on B and the table width (CUDA-graph safe).
- `paged_prefill_attention`: a chunk of T queries of one sequence at positions start.. over its
  cached prefix and itself (its own rows written first), causal.

(The interpreter computes the dots in fp32: its bf16 casts of computed tiles are not exact.)
Each K/V tile is loaded as stored (1 byte, or half a byte, per value), scaled by its rows' scales
in fp32 registers and cast to the query dtype for `tl.dot`: the bytes read are the packed ones.
The torch references dequantise the gathered pages (`KVFormat.decode`) and run fp32 softmax
attention; the kernels run on CUDA or under TRITON_INTERPRET=1 (tests), else the references.
"""

from __future__ import annotations

import torch

from ninfer_core.accel import kernels as K
from ninfer_core.accel import use_triton
from ninfer_core.quant.kv import KVFormat

try:  # triton is optional: the CPU reference path never needs it
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    triton = tl = None
    HAVE_TRITON = False

KIND_IDS = {"model": 0, "int8": 1, "fp8": 2, "int4": 3}
MAX_SPLITS = K.COMBINE_MAX_SPLITS  # the shared split combine's bound


# ------------------------------------------------------------------------------------------------
# torch references
# ------------------------------------------------------------------------------------------------
def _gather(kind: str, data, scale, idx, kvh: int, d: int):
    """fp32 rows [n_pages * page, kvh, d] of pages `idx`."""
    if scale is None:
        return data[idx].reshape(-1, kvh, d).float()
    return KVFormat.decode(kind, data[idx], scale[idx], torch.float32).reshape(-1, kvh, d)


def ref_paged_decode_attention(q, fmt: KVFormat, k, v, k_scale, v_scale, block_table, seq_lens, scale):
    """q [B, H, D]; pages as the module doc says; block_table [B, W]; seq_lens [B] (keys per lane,
    the new token included). Returns [B, H, D] in q's dtype."""
    b, h, d = q.shape
    page, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    out = torch.empty_like(q)
    for i in range(b):
        n = int(seq_lens[i])
        idx = block_table[i, : -(-n // page)].long()
        kk = _gather(fmt.k_kind, k, k_scale, idx, kvh, d)[:n]
        vv = _gather(fmt.v_kind, v, v_scale, idx, kvh, d)[:n]
        s = torch.einsum("kgd,nkd->kgn", q[i].float().reshape(kvh, g, d), kk) * scale
        out[i] = torch.einsum("kgn,nkd->kgd", torch.softmax(s, -1), vv).reshape(h, d).to(q.dtype)
    return out


def ref_paged_prefill_attention(q, fmt: KVFormat, k, v, k_scale, v_scale, pages, start: int, scale):
    """q [T, H, D] at positions start..start+T-1 over keys 0..start+T-1 (all in the pages), causal."""
    t, h, d = q.shape
    page, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    total = start + t
    idx = pages[: -(-total // page)].long()
    kk = _gather(fmt.k_kind, k, k_scale, idx, kvh, d)[:total]
    vv = _gather(fmt.v_kind, v, v_scale, idx, kvh, d)[:total]
    s = torch.einsum("tkgd,nkd->kgtn", q.float().reshape(t, kvh, g, d), kk) * scale
    qpos = torch.arange(start, total, device=q.device)
    kpos = torch.arange(total, device=q.device)
    s = s.masked_fill(~(kpos[None, :] <= qpos[:, None]), float("-inf"))
    o = torch.einsum("kgtn,nkd->tkgd", torch.softmax(s, -1), vv)
    return o.reshape(t, h, d).to(q.dtype)


# ------------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------------
if HAVE_TRITON:

    @triton.jit
    def _load_tile(X, XS, page, offs_r, kvh, offs_d, s_p, s_r, s_h, ss_p, ss_r, ss_h, KIND: tl.constexpr):
        """fp32 rows [PAGE, D] of one page and KV head, dequantised (KIND: see KIND_IDS)."""
        base = X + page * s_p + offs_r[:, None] * s_r + kvh * s_h
        if KIND == 0:
            return tl.load(base + offs_d[None, :]).to(tl.float32)
        if KIND == 3:
            b = tl.load(base + offs_d[None, :] // 2).to(tl.int32)
            x = (((b >> ((offs_d[None, :] % 2) * 4)) & 15) - 8).to(tl.float32)
        elif KIND == 2:
            x = tl.load(base + offs_d[None, :]).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            x = tl.load(base + offs_d[None, :]).to(tl.float32)
        s = tl.load(XS + page * ss_p + offs_r * ss_r + kvh * ss_h)
        return x * s[:, None]

    @triton.jit
    def _qdecode_kernel(
        Q, K, V, KS, VS, BT, LENS, O_PART, LSE_PART, scale,
        s_qb, s_qh, s_kp, s_kr, s_kh, s_vp, s_vr, s_vh, s_sp, s_sr, s_sh, s_bt, s_ob, s_oh, s_os, s_lb, s_lh,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, SPLITS: tl.constexpr,
        KK: tl.constexpr, VK: tl.constexpr, F32: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        seq_len = tl.load(LENS + b)
        n_pages = (seq_len + PAGE - 1) // PAGE
        pps = (n_pages + SPLITS - 1) // SPLITS  # the lane's own pages in SPLITS parts (as the bf16 kernel)
        p0 = sp * pps
        p1 = tl.minimum(p0 + pps, n_pages)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        offs_r = tl.arange(0, PAGE)
        gmask = offs_g < G
        heads = kvh * G + offs_g
        q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)
        if F32:
            q = q.to(tl.float32)
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for p in range(p0, p1):
            page = tl.load(BT + b * s_bt + p).to(tl.int64)
            k = _load_tile(K, KS, page, offs_r, kvh, offs_d, s_kp, s_kr, s_kh, s_sp, s_sr, s_sh, KK)
            s = tl.dot(q, tl.trans(k.to(q.dtype))) * scale
            pos = p * PAGE + offs_r
            s = tl.where(pos[None, :] < seq_len, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            pr = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(pr, 1)
            v = _load_tile(V, VS, page, offs_r, kvh, offs_d, s_vp, s_vr, s_vh, s_sp, s_sr, s_sh, VK).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(pr.to(q.dtype), v)
            m = m_new
        valid = l > 0  # the part saw a key: an empty part's row is not stored (nor read by the combine)
        l_safe = tl.where(valid, l, 1.0)
        lse = tl.where(valid, m + tl.log(l_safe), float("-inf"))
        tl.store(O_PART + b * s_ob + heads[:, None] * s_oh + sp * s_os + offs_d[None, :], acc / l_safe[:, None],
                 mask=(gmask & valid)[:, None])
        tl.store(LSE_PART + b * s_lb + heads * s_lh + sp, lse, mask=gmask)

    @triton.jit(do_not_specialize=["start", "T"])
    def _qprefill_kernel(
        Q, K, V, KS, VS, BT, O, start, T, scale,
        s_qt, s_qh, s_kp, s_kr, s_kh, s_vp, s_vr, s_vh, s_sp, s_sr, s_sh, s_ot, s_oh,
        G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BM: tl.constexpr,
        KK: tl.constexpr, VK: tl.constexpr, F32: tl.constexpr,
    ):
        mb = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // G
        offs_m = mb * BM + tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        offs_r = tl.arange(0, PAGE)
        mmask = offs_m < T
        qpos = start + offs_m
        q = tl.load(Q + offs_m[:, None] * s_qt + h * s_qh + offs_d[None, :], mask=mmask[:, None], other=0.0)
        if F32:
            q = q.to(tl.float32)
        last = tl.minimum(start + (mb + 1) * BM, start + T) - 1
        m = tl.full([BM], float("-inf"), tl.float32)
        l = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        for p in range(last // PAGE + 1):
            page = tl.load(BT + p).to(tl.int64)
            k = _load_tile(K, KS, page, offs_r, kvh, offs_d, s_kp, s_kr, s_kh, s_sp, s_sr, s_sh, KK)
            s = tl.dot(q, tl.trans(k.to(q.dtype))) * scale
            kpos = p * PAGE + offs_r
            s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows past T see no key
            alpha = tl.exp(m - m_safe)
            pr = tl.exp(s - m_safe[:, None])
            l = l * alpha + tl.sum(pr, 1)
            v = _load_tile(V, VS, page, offs_r, kvh, offs_d, s_vp, s_vr, s_vh, s_sp, s_sr, s_sh, VK).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(pr.to(q.dtype), v)
            m = m_new
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(O + offs_m[:, None] * s_ot + h * s_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=mmask[:, None])


def _kernel_args(fmt: KVFormat, k, v, k_scale, v_scale):
    """(K, V, KS, VS, KK, VK): byte views of fp8 pages and a dummy scale for an unscaled side."""
    k = k.view(torch.uint8) if k.dtype == torch.float8_e4m3fn else k
    v = v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v
    some = k_scale if k_scale is not None else v_scale
    if some is None:
        raise ValueError("quantised paged attention over pages without scales (use the bf16 kernels)")
    ks = k_scale if k_scale is not None else some
    vs = v_scale if v_scale is not None else some
    if ks.stride() != vs.stride():
        raise ValueError("K and V scales of one layer must share a layout")
    return k, v, ks, vs, KIND_IDS[fmt.k_kind], KIND_IDS[fmt.v_kind]


def paged_decode_attention(q, fmt: KVFormat, k, v, k_scale, v_scale, block_table, seq_lens, scale,
                           pages_per_split: int | None = None):
    """See ref_paged_decode_attention. block_table int32 [B, W], seq_lens int32 [B] on q's device."""
    if not use_triton(q):
        return ref_paged_decode_attention(q, fmt, k, v, k_scale, v_scale, block_table, seq_lens, scale)
    b, h, d = q.shape
    page, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    q = q.contiguous()
    assert seq_lens.is_contiguous() and block_table.stride(1) == 1
    kd, vd, ks, vs, kk, vk = _kernel_args(fmt, k, v, k_scale, v_scale)
    w = block_table.shape[1]
    if pages_per_split:  # the tests' forced split: at most MAX_SPLITS parts over the table row
        splits = -(-w // max(pages_per_split, -(-w // MAX_SPLITS)))
    else:  # from the layer alone (K.decode_splits): a lane's bits do not depend on the batch or table width
        splits = min(K.decode_splits(kvh, q.is_cuda), MAX_SPLITS)
    o_part = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    _qdecode_kernel[(b, kvh, splits)](
        q, kd, vd, ks, vs, block_table, seq_lens, o_part, lse, scale,
        q.stride(0), q.stride(1), kd.stride(0), kd.stride(1), kd.stride(2), vd.stride(0), vd.stride(1), vd.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2), block_table.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        G=g, GP=max(16, triton.next_power_of_2(g)), D=d, PAGE=page, SPLITS=splits, KK=kk, VK=vk, F32=not q.is_cuda,
        num_warps=4,
    )
    out = torch.empty_like(q)
    # the bf16 path's split combine (the partials are fp32 whatever the KV format)
    K._decode_combine_kernel[(b, h)](o_part, lse, out, o_part.stride(0), o_part.stride(1), o_part.stride(2),
                                     lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), splits,
                                     H=h, SP=K.COMBINE_MAX_SPLITS, D=d, num_warps=4)
    return out


def paged_prefill_attention(q, fmt: KVFormat, k, v, k_scale, v_scale, pages, start: int, scale,
                            block_m: int | None = None):
    """See ref_paged_prefill_attention. pages: int32 tensor of the sequence's page ids."""
    if not use_triton(q):
        return ref_paged_prefill_attention(q, fmt, k, v, k_scale, v_scale, pages, start, scale)
    t, h, d = q.shape
    kvh = k.shape[2]
    q = q.contiguous()
    assert pages.is_contiguous()
    kd, vd, ks, vs, kk, vk = _kernel_args(fmt, k, v, k_scale, v_scale)
    bm = block_m or (16 if not q.is_cuda else 64)
    out = torch.empty_like(q)
    _qprefill_kernel[(triton.cdiv(t, bm), h)](
        q, kd, vd, ks, vs, pages, out, start, t, scale,
        q.stride(0), q.stride(1), kd.stride(0), kd.stride(1), kd.stride(2), vd.stride(0), vd.stride(1), vd.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2), out.stride(0), out.stride(1),
        G=h // kvh, D=d, PAGE=k.shape[1], BM=bm, KK=kk, VK=vk, F32=not q.is_cuda,
        num_warps=8 if q.is_cuda else 1, num_stages=2 if q.is_cuda else 1,
    )
    return out


# ------------------------------------------------------------------------------------------------
# the fused page write: quantise new tokens' K and V rows where they are stored
# ------------------------------------------------------------------------------------------------
if HAVE_TRITON:

    @triton.jit
    def _round_even(y):
        # round half to even (torch.round) for |y| < 2^22: adding 1.5 * 2^23 leaves no fraction bits
        return (y + 12582912.0) - 12582912.0

    @triton.jit
    def _write_side(X, C, CS, tok, h, page, row, s_xt, s_xh, s_cp, s_cr, s_ch, ss_p, ss_r, ss_h,
                    D: tl.constexpr, KIND: tl.constexpr):
        src = X + tok * s_xt + h * s_xh
        dst = C + page * s_cp + row * s_cr + h * s_ch
        if KIND == 0:
            d = tl.arange(0, D)
            tl.store(dst + d, tl.load(src + d).to(C.dtype.element_ty))
        elif KIND == 3:  # int4: byte j = (even column + 8) | (odd column + 8) << 4
            j = tl.arange(0, D // 2)
            xe = tl.load(src + 2 * j).to(tl.float32)
            xo = tl.load(src + 2 * j + 1).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(xe), 0), tl.max(tl.abs(xo), 0))
            s = tl.where(amax > 0, tl.div_rn(amax, 7.0), 1.0)
            qe = tl.minimum(tl.maximum(_round_even(tl.div_rn(xe, s)), -8.0), 7.0).to(tl.int32) + 8
            qo = tl.minimum(tl.maximum(_round_even(tl.div_rn(xo, s)), -8.0), 7.0).to(tl.int32) + 8
            tl.store(dst + j, (qe | (qo << 4)).to(tl.uint8))
            tl.store(CS + page * ss_p + row * ss_r + h * ss_h, s)
        else:
            d = tl.arange(0, D)
            x = tl.load(src + d).to(tl.float32)
            amax = tl.max(tl.abs(x), 0)
            if KIND == 1:
                s = tl.where(amax > 0, tl.div_rn(amax, 127.0), 1.0)
                q = tl.minimum(tl.maximum(_round_even(tl.div_rn(x, s)), -127.0), 127.0)
                tl.store(dst + d, q.to(tl.int8))
            else:
                s = tl.where(amax > 0, tl.div_rn(amax, 448.0), 1.0)
                y = tl.minimum(tl.maximum(tl.div_rn(x, s), -448.0), 448.0)
                tl.store(dst + d, y.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
            tl.store(CS + page * ss_p + row * ss_r + h * ss_h, s)

    @triton.jit
    def _qwrite_kernel(KX, VX, KC, VC, KS, VS, PAGE_T, ROW_T, s_kt, s_kh, s_vt, s_vh,
                       s_kp, s_kr, s_kh2, s_vp, s_vr, s_vh2, ss_p, ss_r, ss_h,
                       D: tl.constexpr, KK: tl.constexpr, VK: tl.constexpr):
        tok = tl.program_id(0)
        h = tl.program_id(1)
        page = tl.load(PAGE_T + tok).to(tl.int64)
        row = tl.load(ROW_T + tok).to(tl.int64)
        _write_side(KX, KC, KS, tok, h, page, row, s_kt, s_kh, s_kp, s_kr, s_kh2, ss_p, ss_r, ss_h, D, KK)
        _write_side(VX, VC, VS, tok, h, page, row, s_vt, s_vh, s_vp, s_vr, s_vh2, ss_p, ss_r, ss_h, D, VK)


def fused_write_supported(k, k_cache) -> bool:
    d = k.shape[-1]
    return HAVE_TRITON and use_triton(k) and k.dim() == 3 and d >= 16 and d & (d - 1) == 0 and k.stride(-1) == 1


def fused_write_rows(fmt: KVFormat, k_cache, v_cache, k_scale, v_scale, page_t, row_t, k, v) -> None:
    """`ninfer_core.quant.kv.write_rows` in one launch (a program per token and KV head quantises
    its K and V rows and stores data and scale): the torch version is about twenty launches per
    layer and step. Same bits as the torch version (round half to even, IEEE divisions)."""
    n, kvh, d = k.shape
    if n == 0:
        return
    if not k.is_cuda and "fp8" in (fmt.k_kind, fmt.v_kind):  # the interpreter's float8 cast is not RTNE
        from ninfer_core.quant.kv import write_rows

        write_rows(fmt, k_cache, v_cache, k_scale, v_scale, page_t, row_t, k, v, fused=False)
        return
    kc, vc, ks, vs, kk, vk = _kernel_args(fmt, k_cache, v_cache, k_scale, v_scale)
    page_t = page_t.reshape(-1)
    row_t = row_t.reshape(-1)
    if not page_t.is_contiguous():
        page_t = page_t.contiguous()
    if not row_t.is_contiguous():
        row_t = row_t.contiguous()
    _qwrite_kernel[(n, kvh)](
        k, v, kc, vc, ks, vs, page_t, row_t, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2), D=d, KK=kk, VK=vk, num_warps=1)
