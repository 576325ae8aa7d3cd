"""Fused small kernels of a Gemma 4 layer on the GPU path, each beside the torch form it replaces
(the reference the CPU path runs and the tests compare against).

- `norm_rope`: a head's RMSNorm (scaled or not) and its rotary embedding in one launch, optionally
  scattered straight into the paged KV cache at the forward's write rows. In torch a query's norm
  and RoPE are about seven kernels (norm, two slices, negate, concatenate, two multiplies, add) and a
  key's write two index-puts more; a decode step at batch 1 is launch-bound on such kernels
  (docs/gemma4.md), so q, k and v take one launch each here.
- `add_rms_norm`: (base + RMSNorm(y) * w) * scale, the post-attention and post-feed-forward
  residual adds with the layer scalar folded in: one launch instead of three.

Both compute in fp32 and round once to the output dtype; the torch forms round after each op, so
the two agree to bf16 rounding (the tests bound it) and exactly up to fp32 rounding in fp32.
"""

from __future__ import annotations

import torch

from ninfer_gemma4.gpu.attention import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, page_ptr, row_ptr, D,
                          stride_xt, stride_xh, stride_c, stride_yt, stride_yh, stride_yp, stride_yr, eps,
                          HAS_W: tl.constexpr, ROPE: tl.constexpr, SCATTER: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        src = x_ptr + t * stride_xt + h * stride_xh
        x = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        y = x * inv
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        if ROPE:  # rotate_half: the partner of column i is i + D/2 (negated) or i - D/2
            half = D // 2
            lo = cols < half
            partner = tl.where(lo, cols + half, cols - half)
            xp = tl.load(src + partner, mask=ok, other=0.0).to(tl.float32) * inv
            if HAS_W:
                xp = xp * tl.load(w_ptr + partner, mask=ok, other=0.0).to(tl.float32)
            xp = tl.where(lo, -xp, xp)
            c = tl.load(cos_ptr + t * stride_c + cols, mask=ok, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + t * stride_c + cols, mask=ok, other=0.0).to(tl.float32)
            y = y * c + xp * s
        if SCATTER:
            p = tl.load(page_ptr + t).to(tl.int64)
            r = tl.load(row_ptr + t).to(tl.int64)
            dst = y_ptr + p * stride_yp + r * stride_yr + h * stride_yh
        else:
            dst = y_ptr + t * stride_yt + h * stride_yh
        tl.store(dst + cols, y.to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _add_rms_norm_kernel(b_ptr, y_ptr, w_ptr, s_ptr, o_ptr, D, stride_b, stride_y, stride_o, eps,
                             HAS_S: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        y = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(y * y, axis=0) / D + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        out = tl.load(b_ptr + row * stride_b + cols, mask=ok, other=0.0).to(tl.float32) + y * inv * w
        if HAS_S:
            out = out * tl.load(s_ptr).to(tl.float32)
        tl.store(o_ptr + row * stride_o + cols, out.to(o_ptr.dtype.element_ty), mask=ok)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


def ref_norm_rope(x, weight, eps, cos=None, sin=None):
    """RMSNorm over the last dim of x [N, H, d] (times weight when given), then RoPE when cos/sin
    [N, d] are given, in the torch form of layers.RMSNorm and layers.apply_rotary."""
    xf = x.float()
    y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    y = y.type_as(x)
    return y if cos is None else _rotate(y, cos, sin)


def norm_rope(x, weight, eps, cos=None, sin=None, out=None, page=None, row=None):
    """See `ref_norm_rope`. x [N, H, d] with unit stride in d (a view of a projection's output is
    fine). With `out` a KV cache [pages, page_size, H, d] and `page`/`row` [N] the result is written
    to out[page[i], row[i]] and nothing is returned; otherwise a new [N, H, d] tensor."""
    scatter = out is not None
    if not use_triton(x) or x.stride(-1) != 1 or (scatter and out.stride(-1) != 1):
        y = ref_norm_rope(x, weight, eps, cos, sin)
        if scatter:
            out[page, row] = y.to(out.dtype)
            return None
        return y
    n, h, d = x.shape
    rope = cos is not None
    if rope:
        cos, sin = cos.contiguous(), sin.contiguous()
    if scatter:  # the kernel reads page[i] and row[i] at unit stride (a no-op for the runner's rows)
        page, row = page.reshape(-1).contiguous(), row.reshape(-1).contiguous()
    else:
        out = torch.empty(n, h, d, dtype=x.dtype, device=x.device)
    if n:
        block = triton.next_power_of_2(d)
        # (token, head, page, row) strides of the destination: a cache [pages, page_size, H, d] or [N, H, d]
        y_strides = (0, out.stride(2), out.stride(0), out.stride(1)) if scatter else (out.stride(0), out.stride(1), 0, 0)
        _norm_rope_kernel[(n, h)](
            x, weight if weight is not None else x, cos if rope else x, sin if rope else x, out,
            page if scatter else x, row if scatter else x, d, x.stride(0), x.stride(1),
            cos.stride(0) if rope else 0, *y_strides, float(eps),
            HAS_W=weight is not None, ROPE=rope, SCATTER=scatter, BLOCK=block, num_warps=4 if block <= 256 else 8)
    return None if scatter else out


def ref_add_rms_norm(base, y, weight, eps, scale=None):
    """(base + RMSNorm(y) * weight) * scale in the torch form of the decoder layer."""
    yf = y.float()
    normed = (yf * torch.pow(yf.pow(2).mean(-1, keepdim=True) + eps, -0.5) * weight.float()).type_as(y)
    out = base + normed
    return out if scale is None else out * scale


def add_rms_norm(base, y, weight, eps, scale=None):
    """See `ref_add_rms_norm`; base and y [N, D] of one dtype, scale a one-element tensor or None."""
    if not use_triton(y) or base.stride(-1) != 1 or y.stride(-1) != 1:
        return ref_add_rms_norm(base, y, weight, eps, scale)
    d = y.shape[-1]
    b2, y2 = base.reshape(-1, d), y.reshape(-1, d)
    out = torch.empty(b2.shape, dtype=base.dtype, device=base.device)
    if b2.shape[0]:
        block = triton.next_power_of_2(d)
        _add_rms_norm_kernel[(b2.shape[0],)](b2, y2, weight, scale if scale is not None else weight, out, d,
                                             b2.stride(0), y2.stride(0), out.stride(0), float(eps),
                                             HAS_S=scale is not None, BLOCK=block,
                                             num_warps=4 if block <= 2048 else 8)
    return out.view(base.shape)
