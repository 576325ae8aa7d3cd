"""Triton dequantising linear kernels for `ninfer_core.quant.weight.QuantizedWeight`.

Decode (few rows): a GEMV that streams each weight row's packed bytes once and dequantises in
registers, one program per block of output rows and input row. Prefill (many rows): a tiled GEMM
that dequantises a [BLOCK_N, BLOCK_K] weight tile into the activation dtype and uses tl.dot.
Both read the packed layout of `ninfer_core.quant.encodings` directly (the torch reference there
is what the tests compare against, under TRITON_INTERPRET=1 on the CPU).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

SCHEME_IDS = {"int8": 0, "int4": 1, "q4": 1, "q6": 2, "fp8_e4m3": 3}
GEMV_MAX_ROWS = 8
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _load_w(q_ptr, s_ptr, rn, rk, N, K, stride_q, stride_s, G: tl.constexpr, SCHEME: tl.constexpr):
    """fp32 weight tile [len(rn), len(rk)] from the packed rows (zeros outside N x K)."""
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    row = q_ptr + rn[:, None].to(tl.int64) * stride_q
    if SCHEME == 0:
        v = tl.load(row + rk[None, :], mask=mask, other=0).to(tl.float32)
    elif SCHEME == 1:
        b = tl.load(row + rk[None, :] // 2, mask=mask, other=0).to(tl.int32)
        v = (((b >> ((rk[None, :] % 2) * 4)) & 15) - 8).to(tl.float32)
    elif SCHEME == 2:
        bit = (rk[None, :] % 4) * 6
        idx = (rk[None, :] // 4) * 3 + bit // 8
        b0 = tl.load(row + idx, mask=mask, other=0).to(tl.int32)
        b1 = tl.load(row + idx + 1, mask=mask & (rk[None, :] % 4 != 3), other=0).to(tl.int32)
        v = ((((b0 | (b1 << 8)) >> (bit % 8)) & 63) - 32).to(tl.float32)
    else:
        raw = tl.load(row + rk[None, :], mask=mask, other=0)
        v = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    s = tl.load(s_ptr + rn[:, None].to(tl.int64) * stride_s + rk[None, :] // G, mask=mask, other=0).to(tl.float32)
    return v * s


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, s_ptr, out_ptr, N, K, stride_xm, stride_q, stride_s, stride_om,
                 G: tl.constexpr, SCHEME: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * stride_xm + rk, mask=rk < K, other=0).to(tl.float32)
        w = _load_w(q_ptr, s_ptr, rn, rk, N, K, stride_q, stride_s, G, SCHEME)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + m * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _gemm_kernel(x_ptr, q_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_q, stride_s, stride_om,
                 G: tl.constexpr, SCHEME: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0)
        w = _load_w(q_ptr, s_ptr, rn, rk, N, K, stride_q, stride_s, G, SCHEME).to(a.dtype)
        if IEEE:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


def _gemv_blocks(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): enough programs to fill the device, wide loads per row."""
    if _INTERPRET:
        return 16, 32, 1
    bk = 512 if k >= 4096 else 256
    bn = 8 if n <= 8192 else 16
    return bn, bk, 4


def triton_linear(x: torch.Tensor, w, config: tuple | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(w).T -> [M, N] in x's dtype; GEMV up to GEMV_MAX_ROWS rows, else GEMM.

    `config` (tests, tuning): ("gemv", BLOCK_N, BLOCK_K) or ("gemm", BLOCK_M, BLOCK_N, BLOCK_K)."""
    x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    q, s = w.qdata, w.scale
    if q.stride(-1) != 1 or s.stride(-1) != 1:
        q, s = q.contiguous(), s.contiguous()
    if w.enc.scheme == "fp8_e4m3":
        q = q.view(torch.uint8)
    g = w.enc.group_for(k)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    scheme = SCHEME_IDS[w.enc.scheme]
    kind = config[0] if config else ("gemv" if m <= GEMV_MAX_ROWS else "gemm")
    if kind == "gemv":
        bn, bk, warps = (config[1], config[2], 1) if config else _gemv_blocks(n, k)
        _gemv_kernel[(triton.cdiv(n, bn), m)](x, q, s, out, n, k, x.stride(0), q.stride(0), s.stride(0),
                                              out.stride(0), G=g, SCHEME=scheme, BLOCK_N=bn, BLOCK_K=bk,
                                              num_warps=warps)
        return out
    if config:
        bm, bn, bk, warps = config[1], config[2], config[3], 1
    elif _INTERPRET:
        bm, bn, bk, warps = 16, 16, 32, 1
    else:
        bm, bn, bk, warps = (64 if m <= 64 else 128), 128, 64, 8
    _gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, q, s, out, m, n, k, x.stride(0), q.stride(0), s.stride(0), out.stride(0), G=g, SCHEME=scheme,
        IEEE=x.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return out
