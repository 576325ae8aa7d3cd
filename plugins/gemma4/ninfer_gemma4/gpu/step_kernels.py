"""Triton kernels of the fused Gemma 4 forward (`gpu/step.py`), each beside the torch form it is
checked against (`ref_*`, the roundings of the reference path's ops). All compute in fp32 and round
to the activation dtype where the reference's tensors are rounded that matter (a norm's input, a
GEMM's input); in fp32 they agree with the reference to fp32 rounding.

- `qkv_norm_rope`: one launch for every head of a layer's fused q|k|v projection output: q heads
  normed, roped and written to a [T, H, d] tensor, k heads normed, roped and v heads v-normed,
  both scattered into the paged caches at the forward's write rows (a K=V layer's v reads the k
  columns). Replaces three `norm_rope` launches.
- `add_norms`: x' = (base + RMSNorm(y) * w) [* scalar] and up to three RMSNorms of x' (a
  weight each, the last optionally times a constant: the router's input): the post-attention
  residual with the next norms of the layer in one launch; the layer tail of a dense layer with
  the next layer's input norm.
- `moe_tail`: the routed rows' weighted sum over a token's k pairs (optionally through a row
  permutation: the prefill's expert-sorted rows), the two branch norms, the post-FF residual, the
  layer scalar and the next layer's input norm: one launch where torch ran about fifteen.
- `gelu_mul`: GeGLU's gelu_tanh(gate) * up of a fused [T, 2I] output.
- `route`: softmax over the experts, top-k, renormalisation and the per-expert scales of the
  router (one program per token, no host sync).
- `expert_gate_up_gelu`: the grouped-expert gate|up GEMV with the GeGLU in its epilogue (each
  expert a round picked read once for all tokens that chose it; `_pair_owner` of
  ninfer_core.accel.moe_gemv picks the owning program). Core's kernel has SiLU in its epilogue,
  Gemma's experts use gelu_tanh, hence this one; its down projection is core's `grouped_down`.
- `embed_norm`: the scaled token embedding and the first layer's input norm; `rope_cos_sin`: a
  layer type's cos/sin tables; `softcap`: cap * tanh(logits / cap) in place.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ninfer_gemma4.gpu.attention import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ninfer_core.accel.moe_gemv import _pair_owner

GELU_C = math.sqrt(2.0 / math.pi)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8


def _rms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    return xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)


# ------------------------------------------------------------------------------------------------
# torch references
# ------------------------------------------------------------------------------------------------
def ref_qkv_norm_rope(qkv, hq, hk, d, qw, kw, eps, cos, sin, keqv: bool):
    """(q [T, hq, d], k [T, hk, d], v [T, hk, d]) of a fused projection output [T, (hq + hk [+ hk]) d]."""
    from ninfer_gemma4.gpu.fused import ref_norm_rope

    t = qkv.shape[0]
    q = ref_norm_rope(qkv[:, : hq * d].view(t, hq, d), qw, eps, cos, sin)
    if not hk:
        return q, None, None
    raw = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
    vraw = raw if keqv else qkv[:, (hq + hk) * d: (hq + 2 * hk) * d].view(t, hk, d)
    return q, ref_norm_rope(raw, kw, eps, cos, sin), ref_norm_rope(vraw, None, eps)


def ref_add_norms(base, y, w, eps, scalar=None, norms=(), last_mult=None):
    """x' = (base + norm(y) * w) [* scalar]; [x'] + [norm(x') * wi for wi in norms] (the last one
    times `last_mult` when given: the router's scale * hidden^-1/2)."""
    normed = (_rms(y.float(), eps) * w.float()).type_as(y)
    x = base + normed
    if scalar is not None:
        x = x * scalar
    outs = [x]
    for i, wi in enumerate(norms):
        z = (_rms(x.float(), eps) * wi.float()).type_as(x)
        if last_mult is not None and i == len(norms) - 1:
            z = z * last_mult
        outs.append(z)
    return outs


def ref_moe_tail(rows, weights, mlp, x1, w1, w2, wpost, eps, scalar=None, w_next=None, perm=None):
    """x' = (x1 + norm(norm1(mlp) + norm2(routed)) * wpost) [* scalar] with routed the weighted sum
    over a token's k rows of `rows` ([T * k, H], pair order t * k + j, or row perm[t * k + j]); weights
    [T, k] fp32 (None: k = 1, the rows are already summed). Returns [x'] (+ [norm(x') * w_next])."""
    t = mlp.shape[0]
    if perm is not None:
        rows = rows[perm]
    if weights is None:
        routed = rows
    else:
        k = weights.shape[1]
        pr = (rows.float() * weights.reshape(-1, 1).float()).to(mlp.dtype)
        routed = pr.view(t, k, -1).sum(1, dtype=torch.float32).to(mlp.dtype)
    a = (_rms(mlp.float(), eps) * w1.float()).type_as(mlp)
    b = (_rms(routed.float(), eps) * w2.float()).type_as(mlp)
    return ref_add_norms(x1, a + b, wpost, eps, scalar, () if w_next is None else (w_next,))


def ref_gelu_mul(gu):
    gate, up = gu.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def ref_route(logits, k: int, per_expert_scale):
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, idx = torch.topk(probs, k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    return w * per_expert_scale[idx], idx


def ref_expert_gate_up_gelu(x, top_i, gate_up):
    """[T * k, I]: gelu_tanh(x W_g^T) * (x W_u^T) per (token, slot), row t * k + j."""
    n, k = top_i.shape
    ws = gate_up.index_select(0, top_i.reshape(-1)).view(n, k, *gate_up.shape[1:])
    gu = torch.einsum("tjoh,th->tjo", ws.float(), x.float()).to(x.dtype)
    return ref_gelu_mul(gu).reshape(n * k, -1)


def ref_embed_norm(ids, table, scale, w, eps):
    x = F.embedding(ids, table) * scale
    return x, (_rms(x.float(), eps) * w.float()).type_as(x)


def ref_rope_cos_sin(freq, positions, dtype):
    from ninfer_gemma4.layers import rope_tables

    return rope_tables(freq, positions, dtype)


def ref_softcap(logits, cap: float):
    return torch.tanh(logits / cap) * cap


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------
if HAVE_TRITON:

    @triton.jit
    def _tanh(z):
        return 2.0 * tl.sigmoid(2.0 * z) - 1.0

    @triton.jit
    def _gelu_tanh(g):
        return 0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))

    @triton.jit
    def _rownorm(x, D, eps):
        return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps))

    @triton.jit
    def _qkv_norm_rope_kernel(x_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, page_ptr, row_ptr,
                              D, HQ, HK, stride_xt, stride_c, stride_qt, stride_qh, stride_kp, stride_kr, stride_kh,
                              stride_vp, stride_vr, stride_vh, eps, KEQV: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        h = cols * 0 + tl.program_id(1)  # the head as a block (the flags below mask block loads)
        is_q = h < HQ
        is_k = (h >= HQ) & (h < HQ + HK)
        is_v = h >= HQ + HK
        j = tl.where(is_q, h, tl.where(is_k, h - HQ, h - HQ - HK))
        col = tl.where(is_q, h, HQ + j)
        if not KEQV:
            col = tl.where(is_v, HQ + HK + j, col)
        src = x_ptr + t * stride_xt + col.to(tl.int64) * D
        x = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        w = (tl.load(qw_ptr + cols, mask=ok & is_q, other=0.0).to(tl.float32)
             + tl.load(kw_ptr + cols, mask=ok & is_k, other=0.0).to(tl.float32) + is_v.to(tl.float32))
        y = x * inv * w
        half = D // 2
        lo = cols < half
        partner = tl.where(lo, cols + half, cols - half)
        wp = (tl.load(qw_ptr + partner, mask=ok & is_q, other=0.0).to(tl.float32)
              + tl.load(kw_ptr + partner, mask=ok & is_k, other=0.0).to(tl.float32) + is_v.to(tl.float32))
        xp = tl.load(src + partner, mask=ok, other=0.0).to(tl.float32) * inv * wp
        xp = tl.where(lo, -xp, xp)
        c = tl.load(cos_ptr + t * stride_c + cols, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_c + cols, mask=ok, other=0.0).to(tl.float32)
        y = tl.where(is_v, y, y * c + xp * s)
        tl.store(q_ptr + t * stride_qt + j.to(tl.int64) * stride_qh + cols, y.to(q_ptr.dtype.element_ty),
                 mask=ok & is_q)
        if HK > 0:
            p = tl.load(page_ptr + t).to(tl.int64)
            r = tl.load(row_ptr + t).to(tl.int64)
            tl.store(kc_ptr + p * stride_kp + r * stride_kr + j.to(tl.int64) * stride_kh + cols,
                     y.to(kc_ptr.dtype.element_ty), mask=ok & is_k)
            tl.store(vc_ptr + p * stride_vp + r * stride_vr + j.to(tl.int64) * stride_vh + cols,
                     y.to(vc_ptr.dtype.element_ty), mask=ok & is_v)

    @triton.jit
    def _add_norms_kernel(b_ptr, y_ptr, w_ptr, s_ptr, o_ptr, wa_ptr, oa_ptr, wb_ptr, ob_ptr, wc_ptr, mc_ptr, oc_ptr,
                          D, stride_b, stride_y, stride_o, eps, mult,
                          HAS_S: tl.constexpr, NORMS: tl.constexpr, HAS_MC: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        y = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        out = tl.load(b_ptr + row * stride_b + cols, mask=ok, other=0.0).to(tl.float32) + _rownorm(y, D, eps) * w
        if HAS_S:
            out = out * tl.load(s_ptr).to(tl.float32)
        dt = o_ptr.dtype.element_ty
        out = out.to(dt)
        tl.store(o_ptr + row * D + cols, out, mask=ok)
        if NORMS > 0:
            xn = _rownorm(out.to(tl.float32), D, eps)
            tl.store(oa_ptr + row * D + cols, (xn * tl.load(wa_ptr + cols, mask=ok, other=0.0).to(tl.float32)).to(dt),
                     mask=ok)
            if NORMS > 1:
                tl.store(ob_ptr + row * D + cols,
                         (xn * tl.load(wb_ptr + cols, mask=ok, other=0.0).to(tl.float32)).to(dt), mask=ok)
            if NORMS > 2:
                z = xn * tl.load(wc_ptr + cols, mask=ok, other=0.0).to(tl.float32)
                if HAS_MC:
                    z = z * tl.load(mc_ptr + cols, mask=ok, other=0.0).to(tl.float32) * mult
                tl.store(oc_ptr + row * D + cols, z.to(dt), mask=ok)

    @triton.jit
    def _moe_tail_kernel(r_ptr, pw_ptr, perm_ptr, m_ptr, x_ptr, w1_ptr, w2_ptr, wp_ptr, s_ptr, wn_ptr, o_ptr, on_ptr,
                         D, stride_r, eps, K: tl.constexpr, HAS_W: tl.constexpr, PERM: tl.constexpr,
                         HAS_S: tl.constexpr, NEXT: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        dt = o_ptr.dtype.element_ty
        routed = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(K):
            if PERM:
                rr = tl.load(perm_ptr + t * K + j).to(tl.int64)
            else:
                rr = t * K + j
            v = tl.load(r_ptr + rr * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
            if HAS_W:
                v = (v * tl.load(pw_ptr + t * K + j)).to(dt).to(tl.float32)
            routed += v
        routed = routed.to(dt).to(tl.float32)
        mlp = tl.load(m_ptr + t * D + cols, mask=ok, other=0.0).to(tl.float32)
        a = (_rownorm(mlp, D, eps) * tl.load(w1_ptr + cols, mask=ok, other=0.0).to(tl.float32)).to(dt)
        b = (_rownorm(routed, D, eps) * tl.load(w2_ptr + cols, mask=ok, other=0.0).to(tl.float32)).to(dt)
        ysum = (a.to(tl.float32) + b.to(tl.float32)).to(dt).to(tl.float32)
        out = (tl.load(x_ptr + t * D + cols, mask=ok, other=0.0).to(tl.float32)
               + _rownorm(ysum, D, eps) * tl.load(wp_ptr + cols, mask=ok, other=0.0).to(tl.float32))
        if HAS_S:
            out = out * tl.load(s_ptr).to(tl.float32)
        out = out.to(dt)
        tl.store(o_ptr + t * D + cols, out, mask=ok)
        if NEXT:
            xn = _rownorm(out.to(tl.float32), D, eps) * tl.load(wn_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(on_ptr + t * D + cols, xn.to(dt), mask=ok)

    @triton.jit
    def _gelu_mul_kernel(gu_ptr, o_ptr, I, stride_g, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < I
        dt = o_ptr.dtype.element_ty
        g = tl.load(gu_ptr + t * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + t * stride_g + I + cols, mask=ok, other=0.0).to(tl.float32)
        a = _gelu_tanh(g).to(dt).to(tl.float32)
        tl.store(o_ptr + t * I + cols, (a * u).to(dt), mask=ok)

    @triton.jit
    def _route_kernel(l_ptr, pes_ptr, w_ptr, i_ptr, E, stride_l, K: tl.constexpr, KP: tl.constexpr,
                      BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < E
        s = tl.load(l_ptr + t * stride_l + cols, mask=ok, other=float("-inf")).to(tl.float32)
        p = tl.exp(s - tl.max(s, axis=0))
        p = tl.where(ok, p, 0.0)
        p = p / tl.sum(p, axis=0)
        ks = tl.arange(0, KP)
        top_w = tl.zeros([KP], tl.float32)
        top_i = tl.zeros([KP], tl.int64)
        for j in tl.static_range(K):
            best = tl.max(p, axis=0)
            arg = tl.min(tl.where(p == best, cols, BLOCK), axis=0)  # the lowest index among ties
            top_w = tl.where(ks == j, best, top_w)
            top_i = tl.where(ks == j, arg.to(tl.int64), top_i)
            p = tl.where(cols == arg, -1.0, p)
        kok = ks < K
        top_w = top_w / tl.sum(tl.where(kok, top_w, 0.0), axis=0)
        top_w = top_w * tl.load(pes_ptr + top_i, mask=kok, other=0.0).to(tl.float32)
        tl.store(w_ptr + t * K + ks, top_w, mask=kok)
        tl.store(i_ptr + t * K + ks, top_i, mask=kok)

    @triton.jit
    def _expert_gate_up_gelu_kernel(X, TOPI, WGU, ACT, M, H, I, s_x, s_we, s_wn, s_a,
                                    KTOP: tl.constexpr, KP: tl.constexpr, QP: tl.constexpr, BLOCK_M: tl.constexpr,
                                    BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
        p = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        e, dup, match, row = _pair_owner(TOPI, p, offs_m, m_mask, KTOP, KTOP, KP, QP)
        if dup == 0:
            base_g = WGU + e * s_we
            base_u = base_g + I * s_wn
            offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
            n_mask = offs_n < I
            rows = tl.where(n_mask, offs_n, 0).to(tl.int64)
            offs_k = tl.arange(0, BK)
            g_ptr = base_g + rows[:, None] * s_wn + offs_k[None, :]
            u_ptr = base_u + rows[:, None] * s_wn + offs_k[None, :]
            x_ptr = X + offs_m[:, None] * s_x + offs_k[None, :]
            acc_g = tl.zeros([BN, BLOCK_M], tl.float32)
            acc_u = tl.zeros([BN, BLOCK_M], tl.float32)
            for k0 in range(0, H, BK):
                km = (k0 + offs_k) < H
                xt = tl.load(x_ptr + k0, mask=m_mask[:, None] & km[None, :], other=0.0)
                wg = tl.load(g_ptr + k0, mask=km[None, :], other=0.0)
                wu = tl.load(u_ptr + k0, mask=km[None, :], other=0.0)
                if IEEE:
                    xf = tl.trans(xt).to(tl.float32)
                    acc_g += tl.dot(wg.to(tl.float32), xf, input_precision="ieee")
                    acc_u += tl.dot(wu.to(tl.float32), xf, input_precision="ieee")
                else:
                    acc_g += tl.dot(wg, tl.trans(xt))
                    acc_u += tl.dot(wu, tl.trans(xt))
            dt = ACT.dtype.element_ty
            g = acc_g.to(dt).to(tl.float32)
            u = acc_u.to(dt).to(tl.float32)
            a = _gelu_tanh(g).to(dt).to(tl.float32)
            tl.store(ACT + row[None, :].to(tl.int64) * s_a + offs_n[:, None], (a * u).to(dt),
                     mask=n_mask[:, None] & match[None, :])

    @triton.jit
    def _embed_norm_kernel(ids_ptr, tab_ptr, sc_ptr, w_ptr, x_ptr, xn_ptr, D, stride_tab, eps, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        tok = tl.load(ids_ptr + t).to(tl.int64)
        dt = x_ptr.dtype.element_ty
        x = (tl.load(tab_ptr + tok * stride_tab + cols, mask=ok, other=0.0).to(tl.float32)
             * tl.load(sc_ptr).to(tl.float32)).to(dt)
        tl.store(x_ptr + t * D + cols, x, mask=ok)
        xn = _rownorm(x.to(tl.float32), D, eps) * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(xn_ptr + t * D + cols, xn.to(dt), mask=ok)

    @triton.jit
    def _rope_kernel(pos_ptr, f_ptr, c_ptr, s_ptr, HALF, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < 2 * HALF
        f = tl.load(f_ptr + cols % HALF, mask=ok, other=0.0)
        a = tl.load(pos_ptr + t).to(tl.float32) * f
        tl.store(c_ptr + t * 2 * HALF + cols, tl.cos(a).to(c_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + t * 2 * HALF + cols, tl.sin(a).to(s_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _softcap_kernel(l_ptr, N, cap, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        v = tl.load(l_ptr + offs, mask=ok, other=0.0)
        tl.store(l_ptr + offs, _tanh(v / cap) * cap, mask=ok)


# ------------------------------------------------------------------------------------------------
# launchers (the reference where Triton does not run on the tensors)
# ------------------------------------------------------------------------------------------------
def qkv_norm_rope(qkv, hq, hk, d, qw, kw, eps, cos, sin, keqv: bool, k_cache=None, v_cache=None, page=None, row=None):
    """q [T, hq, d] of a fused projection output, its k and v (hk heads each) normed into the caches
    at (page, row); see `ref_qkv_norm_rope`."""
    t = qkv.shape[0]
    if not use_triton(qkv) or qkv.stride(-1) != 1 or (hk and (k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1)):
        q, k, v = ref_qkv_norm_rope(qkv, hq, hk, d, qw, kw, eps, cos, sin, keqv)
        if hk:
            k_cache[page, row] = k.to(k_cache.dtype)
            v_cache[page, row] = v.to(v_cache.dtype)
        return q
    q = torch.empty(t, hq, d, dtype=qkv.dtype, device=qkv.device)
    if t:
        cos, sin = cos.contiguous(), sin.contiguous()
        kc, vc = (k_cache, v_cache) if hk else (q.unsqueeze(0), q.unsqueeze(0))
        pg, rw = (page.reshape(-1).contiguous(), row.reshape(-1).contiguous()) if hk else (q, q)
        block = triton.next_power_of_2(d)
        _qkv_norm_rope_kernel[(t, hq + 2 * hk)](
            qkv, qw, kw if kw is not None else qw, cos, sin, q, kc, vc, pg, rw, d, hq, hk, qkv.stride(0),
            cos.stride(0), q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
            vc.stride(0), vc.stride(1), vc.stride(2), float(eps), KEQV=keqv, BLOCK=block,
            num_warps=4 if block <= 256 else 8)
    return q


def add_norms(base, y, w, eps, scalar=None, norms=(), last_mult=None):
    """See `ref_add_norms`; base, y [T, D]; at most three norms; last_mult (tensor [D], float)."""
    if (not use_triton(y) or base.stride(-1) != 1 or y.stride(-1) != 1 or len(norms) > 3
            or (last_mult is not None and len(norms) != 3)):
        lm = None if last_mult is None else last_mult[0] * last_mult[1]
        return ref_add_norms(base, y, w, eps, scalar, norms, lm)
    t, d = y.shape
    outs = [torch.empty(t, d, dtype=base.dtype, device=base.device) for _ in range(1 + len(norms))]
    if t:
        ws = list(norms) + [w] * (3 - len(norms))
        os_ = outs[1:] + [outs[0]] * (3 - len(norms))
        mc, mult = (last_mult if last_mult is not None else (w, 1.0))
        block = triton.next_power_of_2(d)
        _add_norms_kernel[(t,)](base, y, w, scalar if scalar is not None else w, outs[0], ws[0], os_[0], ws[1], os_[1],
                                ws[2], mc, os_[2], d, base.stride(0), y.stride(0), d, float(eps), float(mult),
                                HAS_S=scalar is not None, NORMS=len(norms), HAS_MC=last_mult is not None,
                                BLOCK=block, num_warps=_warps(block))
    return outs


def moe_tail(rows, weights, mlp, x1, w1, w2, wpost, eps, scalar=None, w_next=None, perm=None):
    """See `ref_moe_tail`."""
    if not use_triton(mlp) or rows.stride(-1) != 1 or not (mlp.is_contiguous() and x1.is_contiguous()):
        return ref_moe_tail(rows, weights, mlp, x1, w1, w2, wpost, eps, scalar, w_next, perm)
    t, d = mlp.shape
    k = 1 if weights is None else weights.shape[1]
    out = torch.empty_like(mlp)
    on = torch.empty_like(mlp) if w_next is not None else out
    if t:
        block = triton.next_power_of_2(d)
        pw = weights.contiguous() if weights is not None else out
        _moe_tail_kernel[(t,)](rows, pw, perm if perm is not None else out, mlp, x1, w1, w2, wpost,
                               scalar if scalar is not None else w1, w_next if w_next is not None else w1, out, on,
                               d, rows.stride(0), float(eps), K=k, HAS_W=weights is not None, PERM=perm is not None,
                               HAS_S=scalar is not None, NEXT=w_next is not None, BLOCK=block, num_warps=_warps(block))
    return [out] if w_next is None else [out, on]


def gelu_mul(gu):
    if not use_triton(gu) or gu.stride(-1) != 1 or gu.dim() != 2:
        return ref_gelu_mul(gu)
    t, i2 = gu.shape
    i = i2 // 2
    out = torch.empty(t, i, dtype=gu.dtype, device=gu.device)
    if t:
        block = min(1024, triton.next_power_of_2(i))
        _gelu_mul_kernel[(t, triton.cdiv(i, block))](gu, out, i, gu.stride(0), BLOCK=block, num_warps=4)
    return out


def route(logits, k: int, per_expert_scale):
    """(weights fp32 [T, k], index int64 [T, k]); see `ref_route`."""
    if not use_triton(logits) or logits.stride(-1) != 1:
        return ref_route(logits, k, per_expert_scale)
    t, e = logits.shape
    w = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, per_expert_scale, w, idx, e, logits.stride(0), K=k,
                            KP=max(2, triton.next_power_of_2(k)), BLOCK=max(16, triton.next_power_of_2(e)), num_warps=1)
    return w, idx


EXPERT_BN, EXPERT_BK, EXPERT_TOKENS = 32, 128, 16


def expert_gate_up_gelu(x, top_i, gate_up):
    n, k = top_i.shape
    if (not use_triton(x) or not 1 <= n <= EXPERT_TOKENS or x.stride(1) != 1 or gate_up.stride(2) != 1
            or x.dtype != gate_up.dtype):
        return ref_expert_gate_up_gelu(x, top_i, gate_up)
    hidden, inter = x.shape[1], gate_up.shape[1] // 2
    act = torch.empty(n * k, inter, dtype=x.dtype, device=x.device)
    _expert_gate_up_gelu_kernel[(n * k, triton.cdiv(inter, EXPERT_BN))](
        x, top_i.contiguous(), gate_up, act, n, hidden, inter, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        act.stride(0), KTOP=k, KP=max(2, triton.next_power_of_2(k)), QP=max(2, triton.next_power_of_2(n * k)),
        BLOCK_M=16, BN=EXPERT_BN, BK=EXPERT_BK, IEEE=x.dtype == torch.float32 or not x.is_cuda,
        num_warps=4, num_stages=3)
    return act


def embed_norm(ids, table, scale, w, eps):
    """(x [T, D], norm(x) * w) of the scaled token embeddings; scale a one-element tensor."""
    if not use_triton(table) or table.stride(-1) != 1:
        return ref_embed_norm(ids, table, scale, w, eps)
    t, d = ids.shape[0], table.shape[1]
    x = torch.empty(t, d, dtype=table.dtype, device=table.device)
    xn = torch.empty_like(x)
    if t:
        block = triton.next_power_of_2(d)
        _embed_norm_kernel[(t,)](ids, table, scale, w, x, xn, d, table.stride(0), float(eps), BLOCK=block,
                                 num_warps=_warps(block))
    return x, xn


def rope_cos_sin(freq, positions, dtype):
    if not use_triton(freq):
        return ref_rope_cos_sin(freq, positions, dtype)
    t, half = positions.shape[0], freq.shape[0]
    c = torch.empty(t, 2 * half, dtype=dtype, device=freq.device)
    s = torch.empty_like(c)
    if t:
        _rope_kernel[(t,)](positions, freq.float().contiguous(), c, s, half,
                           BLOCK=triton.next_power_of_2(2 * half), num_warps=1)
    return c, s


def softcap(logits, cap: float):
    """cap * tanh(logits / cap) of fp32 logits, in place on the kernel path."""
    if not use_triton(logits) or not logits.is_contiguous() or logits.dtype != torch.float32:
        return ref_softcap(logits, cap)
    n = logits.numel()
    if n:
        _softcap_kernel[(triton.cdiv(n, 1024),)](logits, n, float(cap), BLOCK=1024, num_warps=4)
    return logits
