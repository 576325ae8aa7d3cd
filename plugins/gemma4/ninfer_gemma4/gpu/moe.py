"""Routed experts of Gemma 4's MoE block on the GPU, each path with the torch reference it is tested
against (`layers.Experts.forward`, the expert loop).

Decode (a few tokens, `experts_decode`): no host synchronisation, so it runs inside a CUDA Graph.
`_expert_gemv_kernel` computes out[p] = W[expert[p]] @ x[p // div] for every token-expert pair p,
one program per (pair, block of output rows), reading only the chosen experts' rows of the fused
tensors (gate_up_proj [E, 2I, H], then down_proj [E, H, I]); the GeGLU between them and the
weighted sum over the k pairs of a token are two torch ops.

Prefill (`experts_grouped`): the pairs sorted by expert on the device and two grouped GEMMs
(`torch._grouped_mm`, bf16 on sm90) over the sorted rows; None where the grouped GEMM is missing or
refuses the input, and the caller runs the loop.

Roundings follow the reference: each GEMM's output in the weight dtype, the activation in it too,
the routing weight applied in fp32 per pair and each pair's row rounded before the sum.
"""

from __future__ import annotations

import logging

import torch

from ninfer_gemma4.gpu.attention import HAVE_TRITON, use_triton
from ninfer_gemma4.layers import act

if HAVE_TRITON:
    import triton
    import triton.language as tl

log = logging.getLogger("ninfer.gemma4")


def ref_expert_gemv(x, w, experts, div: int):
    """out[p] = x[p // div] @ w[experts[p]].T in fp32, rounded to w's dtype. x [R, K], w [E, N, K]."""
    rows = x[torch.arange(experts.numel(), device=x.device) // div]
    return torch.einsum("pk,pnk->pn", rows.float(), w[experts].float()).to(w.dtype)


if HAVE_TRITON:

    @triton.jit
    def _expert_gemv_kernel(x_ptr, w_ptr, e_ptr, o_ptr, N, K, stride_xr, stride_we, stride_wn, stride_or,
                            DIV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pair = tl.program_id(0)
        nb = tl.program_id(1)
        e = tl.load(e_ptr + pair).to(tl.int64)
        row = pair // DIV
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(x_ptr + row * stride_xr + k, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + e * stride_we + n[:, None].to(tl.int64) * stride_wn + k[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        tl.store(o_ptr + pair * stride_or + n, acc.to(o_ptr.dtype.element_ty), mask=n_ok)


def expert_gemv(x, w, experts, div: int):
    """See `ref_expert_gemv`; one Triton launch on CUDA (or under TRITON_INTERPRET=1)."""
    if not use_triton(x) or x.stride(-1) != 1 or w.stride(-1) != 1:
        return ref_expert_gemv(x, w, experts, div)
    p = experts.numel()
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(p, n, dtype=w.dtype, device=x.device)
    block_n, block_k = 16, min(512, triton.next_power_of_2(k))
    _expert_gemv_kernel[(p, triton.cdiv(n, block_n))](
        x, w, experts.reshape(-1).contiguous(), out, n, k, x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        DIV=div, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


def experts_decode(x, weights, index, gate_up, down, activation: str):
    """The routed experts for a few tokens, sync-free. x [T, H]; weights, index [T, k]."""
    t, k = index.shape
    flat = index.reshape(-1)
    gu = expert_gemv(x.contiguous(), gate_up, flat, k)  # [T*k, 2I]
    gate, up = gu.chunk(2, dim=-1)
    h = (act(activation, gate) * up).contiguous()
    y = expert_gemv(h, down, flat, 1)  # [T*k, H]
    rows = (y.float() * weights.reshape(-1, 1).float()).to(x.dtype)
    return rows.view(t, k, -1).sum(1, dtype=torch.float32).to(x.dtype) if k > 1 else rows.view(t, -1)


_REFUSED: set = set()


def experts_grouped(x, weights, index, gate_up, down, activation: str):
    """The routed experts for a prefill chunk through torch._grouped_mm, or None (use the loop)."""
    gmm = getattr(torch, "_grouped_mm", None)
    key = (x.device.type, x.dtype)
    if gmm is None or not x.is_cuda or key in _REFUSED:
        return None
    t, k = index.shape
    flat = index.reshape(-1)
    ids, order = torch.sort(flat, stable=True)
    offs = torch.searchsorted(ids, torch.arange(gate_up.shape[0], device=x.device, dtype=ids.dtype), right=True,
                              out_int32=True)
    try:
        xs = x.index_select(0, order // k)
        gu = gmm(xs, gate_up.transpose(1, 2), offs=offs)
        gate, up = gu.chunk(2, dim=-1)
        y = gmm((act(activation, gate) * up).contiguous(), down.transpose(1, 2), offs=offs)
    except (RuntimeError, TypeError, ValueError) as e:  # this build or dtype refuses it: loop from now on
        _REFUSED.add(key)
        log.warning("torch._grouped_mm refused the Gemma 4 experts (%s); using the expert loop", str(e)[:200])
        return None
    # Back to pair order by a gather with the inverse permutation, then the k rows of a token summed
    # in fp32: the index_add_ this replaces ran fp32 atomics over the chunk (18 ms of a 190 ms
    # 26B-A4B prefill of 4096 tokens on the H200) where the gather is a plain copy.
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=x.device, dtype=order.dtype)
    rows = (y[inv].float() * weights.reshape(-1, 1).float()).to(x.dtype)
    return rows.view(t, k, -1).sum(1, dtype=torch.float32).to(x.dtype)
