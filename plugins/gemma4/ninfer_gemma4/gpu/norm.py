"""Gemma 4's RMSNorm in one Triton launch (the torch form in layers.RMSNorm is its reference).

y = x * (mean(x^2) + eps)^-1/2 [* w], computed in fp32 and rounded once to x's dtype, over the last
dimension of any [..., D] input (q_norm and k_norm run over [tokens, heads, head_dim] as rows).
A decode step has seven norms per layer; in torch each is about eight kernels, which at batch 1 cost
more than the layer's weight reads, so the GPU path runs this one instead.
"""

from __future__ import annotations

import torch

from ninfer_gemma4.gpu.attention import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, stride_x, stride_y, eps,
                         HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        y = x * inv
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row.to(tl.int64) * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.type_as(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if not use_triton(x):
        return ref_rms_norm(x, weight, eps)
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight if weight is not None else rows, out, d, rows.stride(0),
                                           out.stride(0), float(eps), HAS_W=weight is not None, BLOCK=block,
                                           num_warps=4 if block <= 2048 else 8)
    return out.view(x.shape)
