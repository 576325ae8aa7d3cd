"""Decode GEMV / skinny GEMM for 1..8 activation rows: y = x @ W^T with W [N, K] row-major as a
torch Linear stores it, written to stream W at the read-only rate (issue 21).

Why a kernel of our own: cuBLAS reads decode-shaped weights at 3.2-4.3 TB/s on the H200 against a
4.68 TB/s read stream (issue 21), and a decode step is nothing but those reads. The kernel here:

- one program per (block of BLOCK_N weight rows, K split): it walks its K range in BLOCK_K steps
  of [BLOCK_N, BLOCK_K] tiles along W's contiguous dim (16-byte vector loads; no K mask when K is
  a multiple of BLOCK_K, so the compiler keeps them wide), fp32 accumulation;
- M = 1: the FMA path (elementwise products kept in a [BLOCK_N, BLOCK_K] fp32 accumulator, one
  reduction at the end); M >= 2: the tensor-core path, W's rows as the MMA's M side and x^T
  padded to 16 columns (the "swap AB" skinny GEMM), software-pipelined by Triton;
- split-K when W has too few row blocks to fill the chip: each program writes its fp32 partial,
  the last program of a row block to arrive (an atomic counter) sums the partials in split order
  (deterministic: the same bits whichever program is last) and runs the epilogue, then resets the
  counter, so one launch does it all and CUDA-Graph replays find the counters at zero;
- epilogues: optional bias, residual add (the linear's output rounded to the dtype, then added, as
  `res + F.linear(...)` rounds), SiLU(gate) * up for a fused [gate | up] weight (the roundings of
  `silu(linear) * linear` in bf16), fp32 output of a bf16-rounded result (logits).

Configs: a small candidate list per row bucket (1, 2, 4, 8); on CUDA the first call of a
(variant, N, K, bucket) times each candidate on rotating copies of W larger than the L2 cache (so
it is the DRAM stream) and keeps the fastest (`tuned()` lists them); during CUDA-Graph capture, under
the interpreter or with NINFER_GEMV_TUNE=0 the first candidate is used. Every launcher falls back to
the torch reference where Triton does not run on the tensors (CPU without TRITON_INTERPRET=1) or the
inputs are outside what the kernel handles (`supported`). Launches of one device share the split-K
counters: run them on one stream at a time (the decode step does).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ninfer_core.accel import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

log = logging.getLogger("ninfer.accel.gemv")

MAX_ROWS = 8  # the decode widths this kernel is for; wider batches go to cuBLAS
_HALF = (torch.bfloat16, torch.float16)


def enabled() -> bool:
    """NINFER_GEMV=0 turns the decode GEMV off (callers then use torch/cuBLAS): for A/B runs."""
    return os.environ.get("NINFER_GEMV", "1") != "0"


# ------------------------------------------------------------------------------------------------
# torch references
# ------------------------------------------------------------------------------------------------
def ref_gemv(x, w, bias=None, residual=None, out_dtype=None):
    """F.linear(x, w, bias) (+ residual), then cast to out_dtype (the dtype's rounding first)."""
    y = F.linear(x, w, bias)
    if residual is not None:
        y = residual + y
    return y if out_dtype is None else y.to(out_dtype)


def ref_gemv_silu_mul(x, w_gu):
    """w_gu [2I, K] = [gate | up] rows: silu(x @ gate^T) * (x @ up^T), each rounded as bf16 ops round."""
    gate, up = F.linear(x, w_gu).chunk(2, dim=-1)
    return F.silu(gate) * up


# ------------------------------------------------------------------------------------------------
# configs
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    dot: bool  # tensor-core path (x^T padded to 16 columns) or the FMA path (M = 1)
    block_n: int
    block_k: int
    warps: int
    stages: int
    waves: int  # programs wanted per SM; sets the K split
    split: int = 0  # 0: from `waves`; >0 forces it (tests)


# few candidates: each compiles once per variant on first use (the split count is a run-time
# argument, so it adds no compiles)
_FMA = [Config(False, 16, 512, 4, 1, 4), Config(False, 32, 256, 4, 1, 4), Config(False, 8, 512, 4, 1, 8)]
_DOT = [Config(True, 64, 128, 4, 4, 2), Config(True, 32, 256, 4, 3, 4), Config(True, 128, 128, 8, 3, 1)]


def bucket(m: int) -> int:
    return 1 if m <= 1 else 2 if m <= 2 else 4 if m <= 4 else 8


def candidates(m: int, dtype) -> list[Config]:
    """bf16/fp16: the tensor-core configs for every row count, so one (N, K) gets one config and one
    accumulation order whatever the batch: a lane's logits are then the same bits decoding alone or
    beside seven others (with the FMA path for one row and MMA for more, greedy output of 8
    concurrent requests differed from each alone on the H200, 2026-12-02)."""
    if dtype not in _HALF:  # fp32 (CPU-side tests): the exact dot, one config
        return [Config(True, 32, 64, 4, 2, 4)] if m > 1 else [_FMA[0]]
    return list(_DOT)


_SMS: dict = {}


def _sms(device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def split_for(cfg: Config, n_out: int, k: int, device) -> int:
    if cfg.split:
        return cfg.split
    tiles = -(-n_out // cfg.block_n)
    want = -(-cfg.waves * _sms(device) // tiles)
    return max(1, min(want, k // (2 * cfg.block_k), 16))


_COUNTERS: dict = {}
_TUNED: dict = {}  # (device, variant, N, K, bucket, dtype) -> Config
COUNTER_SLOTS = 1 << 16


def _counters(device) -> torch.Tensor:
    """The device's split-K counters: made once and never replaced (captured graphs point at them)."""
    c = _COUNTERS.get(device)
    if c is None:
        c = _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return c


def tuned() -> dict:
    """{(variant, N, K, rows bucket): Config} of the configs picked so far (the bench prints them)."""
    return {k[1:5]: v for k, v in _TUNED.items()}


def supported(x, w) -> bool:
    """Whether the kernel takes (x, w): 2-D, 1..MAX_ROWS rows, a plain tensor weight of x's dtype
    whose rows are contiguous, on a device where Triton runs."""
    return (isinstance(w, torch.Tensor) and type(w) in (torch.Tensor, torch.nn.Parameter) and w.dim() == 2
            and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] == w.shape[1] and w.stride(1) == 1
            and x.stride(1) == 1 and x.dtype == w.dtype and x.dtype in (*_HALF, torch.float32)
            and x.device == w.device and use_triton(x))


# ------------------------------------------------------------------------------------------------
# the kernel
# ------------------------------------------------------------------------------------------------
if HAVE_TRITON:

    @triton.jit
    def _finish(acc, acc_u, yoff, roff, nidx, mask, X, Y, B, R,
                GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROUND: tl.constexpr):
        DT = X.dtype.element_ty  # the activations' dtype: the roundings of the torch ops
        if GATED:
            g = acc.to(DT).to(tl.float32)
            u = acc_u.to(DT).to(tl.float32)
            s = (g * tl.sigmoid(g)).to(DT).to(tl.float32)
            out = s * u
        else:
            out = acc
            if HAS_BIAS:
                out = out + tl.load(B + nidx, mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:
                out = out.to(DT).to(tl.float32) + tl.load(R + roff, mask=mask, other=0.0).to(tl.float32)
        if ROUND:
            out = out.to(DT)
        tl.store(Y + yoff, out.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _reduce_finish(acc, acc_u, poff, yoff, roff, nidx, mask, pid_n, pid_k, X, Y, B, R, P, CNT, M, N, SPLIT_K,
                       SPLIT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                       HAS_RES: tl.constexpr, ROUND: tl.constexpr):
        if not SPLIT:
            _finish(acc, acc_u, yoff, roff, nidx, mask, X, Y, B, R, GATED, HAS_BIAS, HAS_RES, ROUND)
        else:
            mn = M * N
            tl.store(P + pid_k * mn + poff, acc, mask=mask)
            if GATED:
                tl.store(P + (SPLIT_K + pid_k) * mn + poff, acc_u, mask=mask)
            tl.debug_barrier()  # every thread's partial is issued before the release below
            arrived = tl.atomic_add(CNT + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:  # the last program of this row block: sum in split order
                tl.debug_barrier()
                tot = tl.zeros_like(acc)
                tot_u = tl.zeros_like(acc)
                for s in range(SPLIT_K):
                    tot += tl.load(P + s * mn + poff, mask=mask, other=0.0, cache_modifier=".cg")
                    if GATED:
                        tot_u += tl.load(P + (SPLIT_K + s) * mn + poff, mask=mask, other=0.0,
                                         cache_modifier=".cg")
                _finish(tot, tot_u, yoff, roff, nidx, mask, X, Y, B, R, GATED, HAS_BIAS, HAS_RES, ROUND)
                tl.atomic_xchg(CNT + pid_n, 0)  # ready for the next launch / graph replay

    @triton.jit
    def _gemv_kernel(X, W, Y, B, R, P, CNT, M, N, K, U_OFF, SPLIT_K, s_xm, s_wn, s_ym, s_rm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT: tl.constexpr, DOT: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                     GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROUND: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        rows = tl.where(n_mask, offs_n, 0).to(tl.int64)  # rows past N read row 0: no N mask on the loads
        offs_k = tl.arange(0, BLOCK_K)
        span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = pid_k * span
        k_hi = tl.minimum(k_lo + span, K)
        w_ptr = W + rows[:, None] * s_wn + offs_k[None, :]
        u_ptr = w_ptr + U_OFF * s_wn
        if DOT:
            offs_m = tl.arange(0, BLOCK_M)
            m_mask = offs_m < M
            x_ptr = X + offs_m[:, None] * s_xm + offs_k[None, :]
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                if EVEN_K:
                    xt = tl.load(x_ptr + k0, mask=m_mask[:, None], other=0.0)
                    w = tl.load(w_ptr + k0)
                else:
                    km = (k0 + offs_k) < K
                    xt = tl.load(x_ptr + k0, mask=m_mask[:, None] & km[None, :], other=0.0)
                    w = tl.load(w_ptr + k0, mask=km[None, :], other=0.0)
                if IEEE:  # fp32 operands (and the interpreter, whose bf16 dot is wrong): exact fp32 products
                    acc += tl.dot(w.to(tl.float32), tl.trans(xt).to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(w, tl.trans(xt))
                if GATED:
                    if EVEN_K:
                        wu = tl.load(u_ptr + k0)
                    else:
                        wu = tl.load(u_ptr + k0, mask=km[None, :], other=0.0)
                    if IEEE:
                        acc_u += tl.dot(wu.to(tl.float32), tl.trans(xt).to(tl.float32), input_precision="ieee")
                    else:
                        acc_u += tl.dot(wu, tl.trans(xt))
            mask = n_mask[:, None] & m_mask[None, :]
            poff = offs_m[None, :] * N + offs_n[:, None]
            yoff = offs_m[None, :].to(tl.int64) * s_ym + offs_n[:, None]
            roff = offs_m[None, :].to(tl.int64) * s_rm + offs_n[:, None]
            nidx = offs_n[:, None] + offs_m[None, :] * 0
        else:  # M = 1
            acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            acc2u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                if EVEN_K:
                    xv = tl.load(X + k0 + offs_k).to(tl.float32)
                    w = tl.load(w_ptr + k0)
                else:
                    km = (k0 + offs_k) < K
                    xv = tl.load(X + k0 + offs_k, mask=km, other=0.0).to(tl.float32)
                    w = tl.load(w_ptr + k0, mask=km[None, :], other=0.0)
                acc2 += w.to(tl.float32) * xv[None, :]
                if GATED:
                    if EVEN_K:
                        wu = tl.load(u_ptr + k0)
                    else:
                        wu = tl.load(u_ptr + k0, mask=km[None, :], other=0.0)
                    acc2u += wu.to(tl.float32) * xv[None, :]
            acc = tl.sum(acc2, 1)
            acc_u = tl.sum(acc2u, 1)
            mask = n_mask
            poff = offs_n
            yoff = offs_n
            roff = offs_n
            nidx = offs_n
        _reduce_finish(acc, acc_u, poff, yoff, roff, nidx, mask, pid_n, pid_k, X, Y, B, R, P, CNT, M, N, SPLIT_K,
                       SPLIT, GATED, HAS_BIAS, HAS_RES, ROUND)


def _launch(cfg: Config, x, w, y, bias, residual, gated: bool, n_out: int, round_out: bool):
    m, k = x.shape
    assert cfg.dot or m == 1, "the FMA path is for one row"
    assert y.shape == (m, n_out) and y.stride(1) == 1
    tiles = -(-n_out // cfg.block_n)
    split = split_for(cfg, n_out, k, x.device) if tiles <= COUNTER_SLOTS else 1
    cnt = _counters(x.device)
    part = (torch.empty((2 if gated else 1) * split, m, n_out, dtype=torch.float32, device=x.device)
            if split > 1 else cnt)
    r = residual if residual is not None else y
    _gemv_kernel[(tiles, split)](
        x, w, y, bias if bias is not None else w, r, part, cnt, m, n_out, k, n_out if gated else 0, split,
        x.stride(0), w.stride(0), y.stride(0), r.stride(0),
        BLOCK_M=16 if cfg.dot else 1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split > 1, DOT=cfg.dot,
        EVEN_K=k % cfg.block_k == 0, IEEE=x.dtype == torch.float32 or not x.is_cuda, GATED=gated, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, ROUND=round_out, num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return y


def _pick(variant: str, x, w, n_out: int, run) -> Config:
    """The config for this call: the tuned one, else (on CUDA, outside capture) tune now."""
    m, k = x.shape
    # half dtypes: one config per (variant, N, K) for every row count (batch invariance, `candidates`)
    key = (x.device, variant, n_out, k, 0 if x.dtype in _HALF else bucket(m), x.dtype)
    hit = _TUNED.get(key)
    if hit is not None:
        return hit
    cands = candidates(m, x.dtype)
    if (not x.is_cuda or os.environ.get("NINFER_GEMV_TUNE", "1") == "0"
            or torch.cuda.is_current_stream_capturing()):
        return cands[0]
    _TUNED[key] = best = _tune(cands, w, run)
    return best


def _tune(cands: list[Config], w, run) -> Config:
    """Time each candidate over rotating copies of w (together past 3x the L2 cache, so every call
    streams from DRAM); `run(cfg, w)` launches one call. The calls are timed as a CUDA-Graph replay:
    launched one by one from Python they would take longer on the host than a small matrix takes on
    the device, and every candidate would time the same. Candidates that fail to compile are skipped."""
    dev = w.device
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size or (50 << 20)
    one = w.numel() * w.element_size()
    n_copies = max(1, min(8, -(-3 * l2 // one)))
    try:
        ws = [w] + [torch.randn_like(w) for _ in range(n_copies - 1)]
    except torch.OutOfMemoryError:
        ws = [w]
    best, best_t = cands[0], float("inf")
    reps = max(2, min(16, int(4e9 // (one * len(ws)))))  # about 4 GB read per replay
    for cfg in cands:
        try:
            for wc in ws:
                run(cfg, wc)
            torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for this tile: not a candidate here
            log.debug("gemv config %s skipped: %s", cfg, e)
            continue
        t = _replay_time(lambda cfg=cfg, ws=ws: [run(cfg, wc) for _ in range(reps) for wc in ws], dev)
        if t < best_t:
            best, best_t = cfg, t
    del ws
    return best


def _replay_time(fn, dev) -> float:
    """Median ms of three replays of a graph of fn's launches (eager timing if capture fails)."""
    graph = torch.cuda.CUDAGraph()
    side, here = torch.cuda.Stream(dev), torch.cuda.current_stream(dev)
    side.wait_stream(here)
    try:  # capture_begin/end rather than torch.cuda.graph(), which collects garbage and empties the cache
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                fn()
            finally:
                graph.capture_end()
        replay = graph.replay
    except RuntimeError as e:
        log.debug("gemv tuning without a graph: %s", e)
        replay = fn
    here.wait_stream(side)
    replay()
    times = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return sorted(times)[1]


def _into(out, y):
    return y if out is None else out.copy_(y)


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------
def gemv(x, w, bias=None, residual=None, out_dtype=None, config: Config | None = None, out=None):
    """y = x @ w^T (+ bias) (+ residual) for 1..MAX_ROWS rows of x; `out_dtype` (e.g. float32 for
    logits) receives the result rounded to x's dtype first, as `F.linear(...).to(out_dtype)`.
    `out`: a [rows, N] tensor to write (contiguous rows), else a new one."""
    if not supported(x, w) or (bias is not None and (bias.dim() != 1 or not bias.is_contiguous())) or (
            residual is not None and (residual.shape != (x.shape[0], w.shape[0]) or residual.stride(1) != 1)):
        return _into(out, ref_gemv(x, w, bias, residual, out_dtype))
    n = w.shape[0]
    y = out if out is not None else torch.empty(x.shape[0], n, dtype=out_dtype or x.dtype, device=x.device)
    round_out = y.dtype != x.dtype

    def run(cfg, wc):
        return _launch(cfg, x, wc, y, bias, residual, False, n, round_out)

    cfg = config or _pick("res" if residual is not None else "bias" if bias is not None else "plain", x, w, n, run)
    return run(cfg, w)


def gemv_silu_mul(x, w_gu, config: Config | None = None, out=None):
    """silu(x @ gate^T) * (x @ up^T) for a fused w_gu [2I, K] = [gate | up]: both halves streamed
    by the same programs, the product in the epilogue (no [rows, 2I] intermediate)."""
    if not supported(x, w_gu) or w_gu.shape[0] % 2:
        return _into(out, ref_gemv_silu_mul(x, w_gu))
    i = w_gu.shape[0] // 2
    y = out if out is not None else torch.empty(x.shape[0], i, dtype=x.dtype, device=x.device)

    def run(cfg, wc):
        return _launch(cfg, x, wc, y, None, None, True, i, False)

    return run(config or _pick("gated", x, w_gu, i, run), w_gu)


# ------------------------------------------------------------------------------------------------
# a Linear that decodes through the GEMV (for families whose GPU path runs their torch modules)
# ------------------------------------------------------------------------------------------------
class GemvLinear(torch.nn.Linear):
    """An nn.Linear whose forward takes `gemv` for 1..MAX_ROWS rows where the kernel runs (CUDA, or
    the interpreter) and F.linear otherwise (prefill chunks, the CPU path). Modules become one by a
    class swap (`use_gemv`), so their parameters, names and state dict stay as they are."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if enabled() and x.dim() >= 2:
            rows = x.reshape(-1, x.shape[-1])
            b = self.bias
            if supported(rows, self.weight) and (b is None or (b.dim() == 1 and b.is_contiguous())):
                return gemv(rows, self.weight, b).view(*x.shape[:-1], self.weight.shape[0])
        return F.linear(x, self.weight, self.bias)


def use_gemv(module: torch.nn.Module) -> int:
    """Swap every plain nn.Linear under `module` (exactly that class: quantised or other subclasses
    are left alone) to GemvLinear; returns how many were swapped. NINFER_GEMV=0 is read per call."""
    n = 0
    for m in module.modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = GemvLinear
            n += 1
    return n
