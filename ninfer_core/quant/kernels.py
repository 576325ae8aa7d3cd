"""Triton dequantising linears for `ninfer_core.quant.weight.QuantizedWeight`, and the dispatch.

Rows of x (the activations) decide the path:

- 1..8 rows (decode): `ninfer_core.quant.qgemv`, the GEMV that reads the packed bytes once for all
  rows at close to the read stream (its module doc says how).
- more rows (prefill chunks): two ways, by NINFER_QGEMM (auto | triton | scratch):
  * "scratch": dequantise the weight (a block of rows at a time, at most _SCRATCH_ELEMS elements)
    into a bf16 scratch with one streaming kernel, then cuBLAS (F.linear). At 1024 rows (the
    engine's prefill chunk) a 4096 x 4096 int8 weight costs 3 bytes per element to dequantise
    (~10 us at the copy stream) against ~50 us of matmul, so this reaches about 0.8-0.85 of the bf16
    prefill whatever the encoding, and it is cuBLAS's tuned GEMM that does the work;
  * "triton": a tiled GEMM that dequantises each [BLOCK_N, BLOCK_K] weight tile in registers and
    feeds tl.dot: no scratch traffic, but every weight tile is dequantised once per BLOCK_M rows
    of x, so it wins only for short chunks.
  "auto" (the default) takes the Triton GEMM below SCRATCH_MIN_ROWS rows and the scratch at or
  above it (scripts/gpu_check.py --order quant measures both against bf16 cuBLAS).
- q6 (the --lm-head-q6 / --embedding-q6 layout, four values in three bytes) keeps the generic
  kernels at the end of this file (one scale load per element: slow but small use).

The torch reference (`ninfer_core.quant.encodings.dequantize`) is what the tests compare against,
under TRITON_INTERPRET=1 on the CPU and on CUDA.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ninfer_core.quant import qgemv as QG
from ninfer_core.quant.qgemv import dequant_tile, tile_shape

SCHEME_IDS = {"int8": 0, "int4": 1, "q4": 1, "q6": 2, "fp8_e4m3": 3}
GEMV_MAX_ROWS = QG.MAX_ROWS
SCRATCH_MIN_ROWS = int(os.environ.get("NINFER_QGEMM_SCRATCH_ROWS", "256"))
_SCRATCH_ELEMS = 1 << 26  # rows of a larger weight are dequantised and multiplied a block at a time
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def gemm_mode() -> str:
    mode = os.environ.get("NINFER_QGEMM", "auto")
    if mode not in ("auto", "triton", "scratch"):
        raise ValueError(f"NINFER_QGEMM={mode!r}: choose auto, triton or scratch")
    return mode


@triton.jit
def _qgemm_kernel(X, Q, S, Y, M, N, K, SG, s_xm, s_q, s_s, s_ym, SCHEME: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, GPI: tl.constexpr, GC: tl.constexpr, GROUP_M: tl.constexpr,
                  MASK_K: tl.constexpr, IEEE: tl.constexpr, STAGES: tl.constexpr):
    BK: tl.constexpr = GPI * GC
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row blocks of x walk the weight's column blocks together (L2 reuse)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    gsize = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsize
    pid_n = (pid % width) // gsize
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(rn < N, rn, 0).to(tl.int64)
    xrows = tl.where(rm < M, rm, 0).to(tl.int64)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        kk = k0 + rk
        if MASK_K:
            a = tl.load(X + xrows[:, None] * s_xm + kk[None, :], mask=(kk < K)[None, :], other=0.0)
        else:
            a = tl.load(X + xrows[:, None] * s_xm + kk[None, :])
        w = tl.reshape(dequant_tile(Q, S, rows, k0, K, SG, s_q, s_s, SCHEME, GPI, GC, MASK_K), [BLOCK_N, BK])
        if IEEE:
            acc += tl.dot(a.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w.to(a.dtype)))
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(Y + rm[:, None].to(tl.int64) * s_ym + rn[None, :], acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(Q, S, W, N, K, SG, s_q, s_s, s_w, SCHEME: tl.constexpr, BLOCK_R: tl.constexpr,
                    GPI: tl.constexpr, GC: tl.constexpr, MASK_K: tl.constexpr):
    BK: tl.constexpr = GPI * GC
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < N
    rows = tl.where(r_mask, offs_r, 0).to(tl.int64)
    k0 = tl.program_id(1) * BK
    w = tl.reshape(dequant_tile(Q, S, rows, k0, K, SG, s_q, s_s, SCHEME, GPI, GC, MASK_K), [BLOCK_R, BK])
    kk = k0 + tl.arange(0, BK)
    tl.store(W + rows[:, None] * s_w + kk[None, :], w.to(W.dtype.element_ty),
             mask=r_mask[:, None] & (kk < K)[None, :])


def kernel_operands(w):
    """(packed rows as the kernels read them, scales): fp8 values as their bytes, rows contiguous."""
    q, s = w.qdata, w.scale
    if q.stride(-1) != 1 or s.stride(-1) != 1:
        q, s = q.contiguous(), s.contiguous()
    if w.enc.scheme == "fp8_e4m3":
        q = q.view(torch.uint8)
    return q, s


def dequantize_rows(w, dtype: torch.dtype, rows: slice | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """dequant(w)[rows] as a [n, K] tensor of `dtype` by the streaming kernel (the scratch path)."""
    q, s = getattr(w, "kernel_operands", None) or kernel_operands(w)
    if rows is not None:
        q, s = q[rows], s[rows]
    n, k = q.shape[0], w.in_features
    out = out if out is not None else torch.empty(n, k, dtype=dtype, device=q.device)
    br, bk, warps = (16, 64, 1) if _INTERPRET else DEQUANT_CFG
    sg, gpi, gc = tile_shape(w.enc, k, bk)
    _dequant_kernel[(triton.cdiv(n, br), triton.cdiv(k, bk))](
        q, s, out, n, k, sg, q.stride(0), s.stride(0), out.stride(0), SCHEME=SCHEME_IDS[w.enc.scheme], BLOCK_R=br,
        GPI=gpi, GC=gc, MASK_K=k % bk != 0, num_warps=warps)
    return out


# (rows, columns, warps) of one program of the scratch dequantiser on CUDA. On the H200 (2026-12-03,
# 24576 x 4096) int8 ran at 3.4-3.6 TB/s read + written with every shape tried; int4 at 1.0-1.1 TB/s
# except 16 x 1024 (2.0 TB/s; its nibbles stored as two stride-2 writes instead: 0.16 TB/s).
# scripts/quant_kernels.py times DEQUANT_CANDIDATES.
DEQUANT_CFG = (16, 1024, 8)
DEQUANT_CANDIDATES = [(16, 1024, 8), (64, 256, 8), (8, 2048, 8), (16, 2048, 8), (32, 1024, 8), (8, 1024, 4)]


def _scratch_linear(x: torch.Tensor, w) -> torch.Tensor:
    n, k = w.shape[0], w.in_features
    # whole multiples of 256 rows: a block's output [M, step] is cuBLAS's leading dimension, and
    # an unaligned one (13107 at the 27B's K = 5120) sent it to sm75 fallback GEMMs that took 1.3 s
    # of a 1.56 s 27B prefill on the H200 (x0.16 of matmul-only against the 9B's x0.62)
    step = max(256, _SCRATCH_ELEMS // k // 256 * 256)
    if n <= step:
        return F.linear(x, dequantize_rows(w, x.dtype))
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    scratch = torch.empty(step, k, dtype=x.dtype, device=x.device)
    for a in range(0, n, step):
        b = min(n, a + step)
        wb = dequantize_rows(w, x.dtype, slice(a, b), out=scratch[: b - a])
        out[:, a:b] = F.linear(x, wb)
    return out


def _qgemm(x: torch.Tensor, w, q, s, cfg: tuple | None) -> torch.Tensor:
    m, k = x.shape
    n = q.shape[0]
    if cfg:
        bm, bn, bk, warps, stages = cfg[1], cfg[2], cfg[3], 1, 1
    elif _INTERPRET:
        bm, bn, bk, warps, stages = 16, 16, 64, 1, 1
    else:
        bm, bn, bk, warps, stages = (64 if m <= 64 else 128), 128, 64, (4 if m <= 64 else 8), 3
    sg, gpi, gc = tile_shape(w.enc, k, bk)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _qgemm_kernel[grid](x, q, s, out, m, n, k, sg, x.stride(0), q.stride(0), s.stride(0), out.stride(0),
                        SCHEME=SCHEME_IDS[w.enc.scheme], BLOCK_M=bm, BLOCK_N=bn, GPI=gpi, GC=gc, GROUP_M=8,
                        MASK_K=k % bk != 0, IEEE=x.dtype == torch.float32 or not x.is_cuda, STAGES=stages,
                        num_warps=warps)
    return out


def triton_linear(x: torch.Tensor, w, config: tuple | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(w).T -> [M, N] in x's dtype: the decode GEMV up to GEMV_MAX_ROWS rows, else
    the Triton GEMM or dequantise-to-scratch + cuBLAS (the module doc says which when).

    `config` (tests, tuning): ("gemv", BLOCK_N, BLOCK_K), a `qgemv.Config`, ("gemm", BLOCK_M,
    BLOCK_N, BLOCK_K) or ("scratch",)."""
    if not x.is_contiguous():
        x = x.contiguous()
    m, k = x.shape
    q, s = getattr(w, "kernel_operands", None) or kernel_operands(w)
    fast = w.enc.scheme in QG.SCHEME_IDS
    if isinstance(config, QG.Config):
        return QG.qgemv(x, q, s, w.enc, k, config)
    kind = config[0] if config else ("gemv" if m <= GEMV_MAX_ROWS else None)
    if kind is None:
        mode = gemm_mode()
        kind = "scratch" if mode == "scratch" or (mode == "auto" and m >= SCRATCH_MIN_ROWS) else "gemm"
    if kind == "gemv" and fast:
        cfg = None
        if config:
            cfg = QG.Config(config[1], config[2], 1, 1, 4, dot=x.dtype != torch.float32 or m > 1)
        return QG.qgemv(x, q, s, w.enc, k, cfg)
    if kind == "scratch" and fast:
        return _scratch_linear(x, w)
    if kind == "gemm" and fast:
        return _qgemm(x, w, q, s, config)
    return _generic_linear(x, w, q, s, kind, config)


# ------------------------------------------------------------------------------------------------
# the generic kernels (q6; one scale load per element)
# ------------------------------------------------------------------------------------------------
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


def _generic_linear(x, w, q, s, kind: str, config) -> torch.Tensor:
    m, k = x.shape
    n = q.shape[0]
    g = w.enc.group_for(k)
    scheme = SCHEME_IDS[w.enc.scheme]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if kind == "gemv":
        bn, bk, warps = (config[1], config[2], 1) if config else ((16, 32, 1) if _INTERPRET else (8, 512, 4))
        _gemv_kernel[(triton.cdiv(n, bn), m)](x, q, s, out, n, k, x.stride(0), q.stride(0), s.stride(0),
                                              out.stride(0), G=g, SCHEME=scheme, BLOCK_N=bn, BLOCK_K=bk,
                                              num_warps=warps)
        return out
    if config and config[0] == "gemm":
        bm, bn, bk, warps = config[1], config[2], config[3], 1
    elif _INTERPRET:
        bm, bn, bk, warps = 16, 16, 32, 1
    else:
        bm, bn, bk, warps = (64 if m <= 64 else 128), 128, 64, 8
    _gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, q, s, out, m, n, k, x.stride(0), q.stride(0), s.stride(0), out.stride(0), G=g, SCHEME=scheme,
        IEEE=x.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return out
