"""Fused elementwise and small decode-step kernels of the GPU path (split out of
`ninfer_core.accel.kernels`, which re-exports every name here so callers keep `kernels.X`):
add + zero-centred RMSNorm, gated RMSNorm, SiLU-multiply, the causal conv's decode update and
prefill, and q/k RMSNorm + RoPE. Each with the torch reference it is tested against; kernels run
when triton is importable and the tensors are on CUDA, or on the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer_core.accel import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl


# ------------------------------------------------------------------------------------------------
# fused elementwise ops (one launch each instead of 6-10 torch kernels; same rounding points as
# the reference modules: results rounded to the activation dtype where the modules round)
# ------------------------------------------------------------------------------------------------
def ref_add_rmsnorm(x, delta, weight, eps):
    """(x + delta, zero-centred RMSNorm of it) as ZeroCenteredRMSNorm computes; delta may be None."""
    if delta is not None:
        x = x + delta
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return x, (xf * (1.0 + weight.float())).to(x.dtype)


def ref_gated_rmsnorm(x, z, weight, eps):
    """GatedRMSNorm: rows of x [..., d] normalised, times weight, times silu(z) (fp32 gate)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    return (out * F.silu(z.float())).to(dtype)


def ref_silu_mul(gu):
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


if HAVE_TRITON:

    @triton.jit
    def _add_rmsnorm_kernel(X, D, W, XO, HO, eps, N, s_x, s_d, s_xo, s_ho,
                            HAS_D: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(X + row * s_x + offs, mask=mask, other=0.0)
        if HAS_D:
            d = tl.load(D + row * s_d + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(XO.dtype.element_ty)
            tl.store(XO + row * s_xo + offs, x, mask=mask)
        xf = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(HO + row * s_ho + offs, (xf * r * (1.0 + w)).to(HO.dtype.element_ty), mask=mask)

    @triton.jit
    def _gated_rmsnorm_kernel(X, Z, W, O, eps, rows, s_x, s_z, s_o,
                              N: tl.constexpr, BR: tl.constexpr):
        r0 = tl.program_id(0) * BR
        rr = r0 + tl.arange(0, BR)
        cols = tl.arange(0, N)
        rmask = rr < rows
        rr64 = rr.to(tl.int64)
        x = tl.load(X + rr64[:, None] * s_x + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        z = tl.load(Z + rr64[:, None] * s_z + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        w = tl.load(W + cols).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, 1) / N + eps)
        t = (x * r[:, None]).to(O.dtype.element_ty).to(tl.float32)
        t = (t * w[None, :]).to(O.dtype.element_ty).to(tl.float32)
        out = t * (z * tl.sigmoid(z))
        tl.store(O + rr64[:, None] * s_o + cols[None, :], out.to(O.dtype.element_ty), mask=rmask[:, None])

    @triton.jit
    def _silu_mul_kernel(GU, O, I, s_gu, s_o, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        g = tl.load(GU + row * s_gu + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + row * s_gu + I + offs, mask=mask, other=0.0).to(tl.float32)
        s = (g * tl.sigmoid(g)).to(O.dtype.element_ty).to(tl.float32)
        tl.store(O + row * s_o + offs, (s * u).to(O.dtype.element_ty), mask=mask)


def add_rmsnorm(x, delta, weight, eps):
    """Fused residual add + zero-centred RMSNorm over the last dim of 2-D x: returns (x', h)."""
    if not use_triton(x) or x.dim() != 2:
        return ref_add_rmsnorm(x, delta, weight, eps)
    n_rows, n = x.shape
    xo = torch.empty_like(x) if delta is not None else x
    ho = torch.empty_like(x)
    d = delta if delta is not None else x
    assert x.stride(1) == 1 and d.stride(1) == 1
    _add_rmsnorm_kernel[(n_rows,)](
        x, d, weight, xo, ho, eps, n, x.stride(0), d.stride(0), xo.stride(0), ho.stride(0),
        HAS_D=delta is not None, BLOCK=triton.next_power_of_2(n), num_warps=8 if n >= 2048 else 4,
    )
    return xo, ho


def gated_rmsnorm(x, z, weight, eps):
    """x, z [rows, d] (d a power of two) -> GatedRMSNorm(x, z)."""
    if not use_triton(x):
        return ref_gated_rmsnorm(x, z, weight, eps)
    rows, n = x.shape
    assert x.stride(1) == 1 and z.stride(1) == 1 and n == triton.next_power_of_2(n)
    out = torch.empty_like(x)
    br = 16
    _gated_rmsnorm_kernel[(triton.cdiv(rows, br),)](
        x, z, weight, out, eps, rows, x.stride(0), z.stride(0), out.stride(0), N=n, BR=br, num_warps=4,
    )
    return out


def silu_mul(gu):
    """gu [rows, 2I] = [gate | up] -> silu(gate) * up [rows, I]."""
    if not use_triton(gu):
        return ref_silu_mul(gu)
    rows, two_i = gu.shape
    i = two_i // 2
    out = torch.empty(rows, i, dtype=gu.dtype, device=gu.device)
    block = 1024
    assert gu.stride(1) == 1
    _silu_mul_kernel[(rows, triton.cdiv(i, block))](gu, out, i, gu.stride(0), out.stride(0), BLOCK=block,
                                                    num_warps=4)
    return out


# ------------------------------------------------------------------------------------------------
# decode/prefill glue fused: conv-state update (+SiLU) and q/k RMSNorm + partial RoPE (one launch
# each where the torch glue took ~7 and ~25); the families' GPU runners use both.
# ------------------------------------------------------------------------------------------------
def ref_conv_update(mixed, conv_all, weight, slots):
    """One new column per lane: silu(depthwise conv over [state | x]); the state shifts in place.
    mixed [B, C]; conv_all [S, C, K-1]; weight [C, K]; slots [B]."""
    full = torch.cat([conv_all[slots].to(mixed.dtype), mixed[..., None]], dim=-1)
    out = F.silu((full * weight[None]).sum(-1))
    conv_all[slots] = full[..., 1:].to(conv_all.dtype)
    return out


def ref_qk_norm_rope(q, k, q_w, k_w, cos, sin, eps):
    """Zero-centred RMSNorm of q [N, H, D] and k [N, KVH, D] over D, then neox RoPE on the first
    cos.shape[-1] dims; returns contiguous (q, k)."""
    from ninfer_core.nn.layers import apply_rotary

    def norm(x, w):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * (1.0 + w.float())).to(x.dtype)

    return apply_rotary(norm(q, q_w), cos, sin).contiguous(), apply_rotary(norm(k, k_w), cos, sin).contiguous()


if HAVE_TRITON:

    @triton.jit
    def _conv_update_kernel(MIXED, STATE, W, SLOTS, OUT, C, s_mb, s_s0, s_ob, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < C
        slot = tl.load(SLOTS + b).to(tl.int64)
        x = tl.load(MIXED + b * s_mb + c, mask=m, other=0.0)
        sp = STATE + slot * s_s0 + c * 3
        s0 = tl.load(sp, mask=m, other=0.0)
        s1 = tl.load(sp + 1, mask=m, other=0.0)
        s2 = tl.load(sp + 2, mask=m, other=0.0)
        wp = W + c * 4
        acc = (s0.to(tl.float32) * tl.load(wp, mask=m, other=0.0).to(tl.float32)
               + s1.to(tl.float32) * tl.load(wp + 1, mask=m, other=0.0).to(tl.float32)
               + s2.to(tl.float32) * tl.load(wp + 2, mask=m, other=0.0).to(tl.float32)
               + x.to(tl.float32) * tl.load(wp + 3, mask=m, other=0.0).to(tl.float32))
        tl.store(sp, s1, mask=m)
        tl.store(sp + 1, s2, mask=m)
        tl.store(sp + 2, x.to(s2.dtype), mask=m)
        tl.store(OUT + b * s_ob + c, (acc * tl.sigmoid(acc)).to(OUT.dtype.element_ty), mask=m)

    @triton.jit
    def _norm_rope_head(Q, K, QW, KW, COS, SIN, QO, n, h, eps, s_qn, s_qh, s_kn, s_kh, s_cn, s_qon, s_qoh,
                        H: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr):
        """Program (n, h) of the q/k norm + partial-RoPE kernels: heads h < H are q heads (stored to
        QO here), the rest k heads; returns the rotated row, its k head and the head vector."""
        is_q = h < H
        hq = tl.minimum(h, H - 1)
        hk = tl.maximum(h - H, 0)
        d = tl.arange(0, D)
        half: tl.constexpr = ROT // 2
        partner = tl.where(d < half, d + half, d - half)
        in_rot = d < ROT
        pq = Q + n * s_qn + hq * s_qh
        pk = K + n * s_kn + hk * s_kh
        x = tl.where(is_q, tl.load(pq + d), tl.load(pk + d)).to(tl.float32)
        w = tl.where(is_q, tl.load(QW + d), tl.load(KW + d)).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        y = (x * r * (1.0 + w)).to(QO.dtype.element_ty).to(tl.float32)
        xp = tl.where(is_q, tl.load(pq + partner, mask=in_rot, other=0.0),
                      tl.load(pk + partner, mask=in_rot, other=0.0)).to(tl.float32)
        wp = tl.where(is_q, tl.load(QW + partner, mask=in_rot, other=0.0),
                      tl.load(KW + partner, mask=in_rot, other=0.0)).to(tl.float32)
        yp = (xp * r * (1.0 + wp)).to(QO.dtype.element_ty).to(tl.float32)
        cs = tl.load(COS + n * s_cn + d, mask=in_rot, other=1.0).to(tl.float32)
        sn = tl.load(SIN + n * s_cn + d, mask=in_rot, other=0.0).to(tl.float32)
        sign = tl.where(d < half, -1.0, 1.0)
        out = tl.where(in_rot, y * cs + sign * yp * sn, y).to(QO.dtype.element_ty)
        hvec = tl.zeros([D], dtype=tl.int32) + h
        tl.store(QO + n * s_qon + hq * s_qoh + d, out, mask=hvec < H)
        return out, hk, hvec, d

    @triton.jit
    def _qk_norm_rope_kernel(Q, K, QW, KW, COS, SIN, QO, KO, eps,
                             s_qn, s_qh, s_kn, s_kh, s_cn, s_qon, s_qoh, s_kon, s_koh,
                             H: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        out, hk, hvec, d = _norm_rope_head(Q, K, QW, KW, COS, SIN, QO, n, h, eps, s_qn, s_qh, s_kn, s_kh, s_cn,
                                           s_qon, s_qoh, H, D, ROT)
        tl.store(KO + n * s_kon + hk * s_koh + d, out, mask=hvec >= H)


def ref_conv_prefill(x, conv_all, weight, slot: int):
    """T new rows of one sequence: x [T, C] (rows may be strided) -> silu(causal depthwise conv over
    [state | x]) [T, C]; the slot's state [C, K-1] becomes the last K-1 inputs (in place)."""
    from ninfer_core.nn.gdn import causal_conv_prefill

    out, new = causal_conv_prefill(x.t(), conv_all[slot], weight)
    conv_all[slot] = new.to(conv_all.dtype)
    return out.t().contiguous()


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["T"])
    def _conv_prefill_kernel(X, STATE, W, OUT, T, C, s_xt, s_ot, BT: tl.constexpr, BC: tl.constexpr):
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        tm = t < T
        cm = c < C
        acc = tl.zeros([BT, BC], tl.float32)
        for j in tl.static_range(4):  # tap j reads input time t - 3 + j: x, or the cached state
            src = t - 3 + j
            from_x = src >= 0
            xv = tl.load(X + src.to(tl.int64)[:, None] * s_xt + c[None, :],
                         mask=(from_x & tm)[:, None] & cm[None, :], other=0.0).to(tl.float32)
            sv = tl.load(STATE + c[None, :] * 3 + (3 + src)[:, None],
                         mask=((~from_x) & tm)[:, None] & cm[None, :], other=0.0).to(tl.float32)
            w = tl.load(W + c * 4 + j, mask=cm, other=0.0).to(tl.float32)
            acc += (xv + sv) * w[None, :]
        out = acc * tl.sigmoid(acc)
        tl.store(OUT + t.to(tl.int64)[:, None] * s_ot + c[None, :], out.to(OUT.dtype.element_ty),
                 mask=tm[:, None] & cm[None, :])


def conv_prefill(x, conv_all, weight, slot: int):
    """See ref_conv_prefill (kernel width 4, T >= 3): one pass over the chunk instead of
    transpose + cat + conv1d + SiLU + transpose; the state update is one strided copy after it."""
    t, c = x.shape
    if not use_triton(x) or weight.shape[-1] != 4 or t < 3:
        return ref_conv_prefill(x, conv_all, weight, slot)
    assert x.stride(1) == 1 and conv_all.is_contiguous() and weight.is_contiguous()
    out = torch.empty(t, c, dtype=x.dtype, device=x.device)
    state = conv_all[slot]
    bt, bc = 32, 128
    _conv_prefill_kernel[(triton.cdiv(t, bt), triton.cdiv(c, bc))](
        x, state, weight, out, t, c, x.stride(0), out.stride(0), BT=bt, BC=bc, num_warps=4)
    state.copy_(x[t - 3:].t())  # after the kernel read the old state (same stream)
    return out


def conv_update(mixed, conv_all, weight, slots):
    """See ref_conv_update (kernel width 4). CUDA-graph safe; slots int64 contiguous."""
    if not use_triton(mixed) or weight.shape[-1] != 4:
        return ref_conv_update(mixed, conv_all, weight, slots)
    b, c = mixed.shape
    assert mixed.stride(1) == 1 and conv_all.is_contiguous() and weight.is_contiguous() and slots.is_contiguous()
    out = torch.empty(b, c, dtype=mixed.dtype, device=mixed.device)
    block = 1024
    _conv_update_kernel[(b, triton.cdiv(c, block))](mixed, conv_all, weight, slots, out, c, mixed.stride(0),
                                                    conv_all.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out


def qk_norm_rope(q, k, q_w, k_w, cos, sin, eps):
    """See ref_qk_norm_rope; q, k may be strided views (last dim contiguous)."""
    if not use_triton(q):
        return ref_qk_norm_rope(q, k, q_w, k_w, cos, sin, eps)
    n, h, d = q.shape
    kvh = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and cos.stride(0) == sin.stride(0)
    assert d == triton.next_power_of_2(d)
    qo = torch.empty(n, h, d, dtype=q.dtype, device=q.device)
    ko = torch.empty(n, kvh, d, dtype=k.dtype, device=k.device)
    _qk_norm_rope_kernel[(n, h + kvh)](
        q, k, q_w, k_w, cos, sin, qo, ko, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
        H=h, D=d, ROT=cos.shape[-1], num_warps=4,
    )
    return qo, ko
