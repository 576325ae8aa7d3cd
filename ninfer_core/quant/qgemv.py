"""Decode GEMV for encoded weights (int8 / int4 / fp8, groupwise or per row): y = x @ dequant(W)^T
for 1..8 activation rows, written to stream the packed bytes at the read rate (issue 22).

What the earlier kernel did wrong, and what this one does instead:

- it ran one program per (block of rows, activation row), so at 8 rows every weight byte was read
  8 times; here one program covers all rows of x (the tensor-core "swap AB" skinny GEMM: W's rows
  are the MMA's M side, x^T padded to 16 columns is the N side), so W is read once per call;
- it loaded one scale per element (a gather the compiler cannot vectorise); here a weight tile is a
  3-D block [BLOCK_N, GPI, GC] (GPI groups of GC columns, each inside one scale group) whose scales
  are one [BLOCK_N, GPI] load broadcast over the group's columns, and the packed bytes along the
  last axis are contiguous, so they load as 16-byte vectors (int4: whole bytes, unpacked in
  registers and interleaved back into column order);
- it converted every value with an int-to-float instruction (a quarter-rate conversion unit on the
  H200, about the stream rate of int8 elements by itself); here the packed integer goes into the
  mantissa of 2^23 and one subtraction removes the bias (integer and fp32 pipes, full rate);
- it had too few programs for narrow outputs; here the K range is split so about `waves` programs
  per SM run, and the last program of a row block to finish (an atomic counter) sums the fp32
  partials in split order (deterministic) and writes the output, then resets the counter, so one
  launch does it all and CUDA-Graph replays find the counters at zero (the scheme of
  ninfer_core.accel.gemv, which this module only reads; it keeps its own counters).

One config per (encoding, N, K) serves every row count (the dot path for all of them), so a lane's
logits are the same bits alone or beside seven others. The config is the fastest of a few
candidates, timed on first use on CUDA (outside graph capture; NINFER_QGEMV_TUNE=0 takes the first)
over rotating copies of the packed weight larger than the L2 cache, as CUDA-Graph replays.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from ninfer_core.accel import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ninfer_core.accel.gemv import _reduce_finish

log = logging.getLogger("ninfer.quant.gemv")

MAX_ROWS = 8
SCHEME_IDS = {"int8": 0, "int4": 1, "q4": 1, "fp8_e4m3": 3}  # q6 keeps the generic kernel
COUNTER_SLOTS = 1 << 16


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int  # weight columns per iteration (int4: half as many bytes)
    warps: int
    stages: int
    waves: int  # programs wanted per SM; sets the K split
    dot: bool = True  # False: the fp32 FMA path (one row; fp32 tests)
    split: int = 0  # >0 forces the K split (tests)
    group: bool = False  # the scale-after-dot kernel (_qgemv_group_kernel): see its comment


def _g(bn, bk, warps, stages, waves):
    return Config(bn, bk, warps, stages, waves, group=True)


# The candidates `pick` times per weight, by scheme. On the H200 (2026-12-03) the scale-after-dot
# kernel read int8 at 0.42-0.64 of the stream (grp n64 k128 w4 s3 v2 the best everywhere) against
# 0.21-0.31 for the per-element-scale kernel; int4 stayed at 0.05-0.06 in both, which the SASS
# (compiled here for sm_90a) explains: the packed bytes were addressed as col // 2 and loaded one
# byte at a time (LDG.E.U8); addressed as k0 // 2 + e they load as 8-16 byte cp.async, as int8's.
# With that, int4 read at 0.19-0.35 (nibbles joined back into column order, the fastest of three
# ways to pair them with x).
CANDIDATES_BY_SCHEME = {
    "int8": [_g(64, 128, 4, 3, 2), _g(32, 128, 4, 3, 4), _g(64, 128, 4, 4, 2), _g(64, 64, 4, 4, 2),
             _g(128, 128, 4, 3, 1), _g(32, 256, 4, 3, 4)],
    "int4": [_g(64, 128, 4, 3, 2), _g(64, 256, 4, 3, 2), _g(32, 256, 4, 3, 4), _g(16, 512, 4, 2, 8),
             Config(16, 512, 4, 2, 8)],
}
CANDIDATES_BY_SCHEME["fp8_e4m3"] = CANDIDATES_BY_SCHEME["int8"]
CANDIDATES_BY_SCHEME["q4"] = CANDIDATES_BY_SCHEME["int4"]
# the kernel table (scripts/quant_kernels.py) times these too: the per-element-scale kernel's set
CANDIDATES = [Config(64, 128, 4, 3, 2), Config(32, 256, 4, 3, 4), Config(128, 128, 8, 3, 1),
              Config(32, 512, 4, 2, 4), Config(16, 512, 4, 2, 8)]


def candidates(enc) -> list:
    return CANDIDATES_BY_SCHEME.get(enc.scheme, CANDIDATES)

_FP32 = Config(16, 64, 4, 1, 4, dot=False)  # fp32 activations (CPU-side tests): exact products
_FP32_ROWS = Config(16, 64, 4, 1, 4)
_INTERP = Config(16, 64, 1, 1, 4)

_COUNTERS: dict = {}
_TUNED: dict = {}
_SMS: dict = {}


def tuned() -> dict:
    """{(encoding, N, K): Config} picked so far (the kernel table prints them)."""
    return {k[1:4]: v for k, v in _TUNED.items()}


def supports(enc) -> bool:
    return HAVE_TRITON and enc.scheme in SCHEME_IDS


def _sms(device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def _counters(device) -> torch.Tensor:
    c = _COUNTERS.get(device)
    if c is None:  # made once and never replaced: captured graphs point at it
        c = _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return c


if HAVE_TRITON:

    @triton.jit
    def dequant_tile(q_ptr, s_ptr, rows, k0, K, SG, stride_q, stride_s, SCHEME: tl.constexpr,
                     GPI: tl.constexpr, GC: tl.constexpr, MASK_K: tl.constexpr):
        """fp32 [len(rows), GPI, GC]: weight columns k0 .. k0 + GPI*GC of `rows` (int64), each run of
        GC columns inside one scale group of SG columns (zeros past K when MASK_K)."""
        gi = tl.arange(0, GPI)
        if SCHEME == 1:  # int4: byte j holds columns 2j (low nibble) and 2j + 1
            e = tl.arange(0, GC // 2)
            col = k0 + gi[None, :, None] * GC + 2 * e[None, None, :]
            # the byte offset written as (k0 // 2) + ... + e, not col // 2: through the division
            # Triton loses the contiguity and loads every byte on its own (int4 read at 0.06 of the
            # stream on the H200 with col // 2)
            ptr = q_ptr + rows[:, None, None] * stride_q + (k0 // 2 + gi[None, :, None] * (GC // 2) + e[None, None, :])
        else:
            e = tl.arange(0, GC)
            col = k0 + gi[None, :, None] * GC + e[None, None, :]
            ptr = q_ptr + rows[:, None, None] * stride_q + col
        g0 = k0 + gi * GC
        sptr = s_ptr + rows[:, None, None] * stride_s + (g0 // SG)[None, :, None]
        if MASK_K:
            raw = tl.load(ptr, mask=col < K, other=0)
            s = tl.load(sptr, mask=(g0 < K)[None, :, None], other=0).to(tl.float32)
        else:
            raw = tl.load(ptr)
            s = tl.load(sptr).to(tl.float32)
        # integers into the mantissa of 2^23 (exact), minus the bias: no int-to-float conversion
        if SCHEME == 0:
            v = (raw.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
            out = v * s
        elif SCHEME == 1:
            b = raw.to(tl.int32)
            lo = ((b & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
            hi = ((b >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
            out = tl.interleave(lo * s, hi * s)
        else:
            out = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s
        return out

    @triton.jit
    def _qgemv_kernel(X, Q, S, Y, P, CNT, M, N, K, SG, SPLIT_K, s_xm, s_q, s_s, s_ym,
                      SCHEME: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GPI: tl.constexpr,
                      GC: tl.constexpr, DOT: tl.constexpr, SPLIT: tl.constexpr, MASK_K: tl.constexpr,
                      IEEE: tl.constexpr, STAGES: tl.constexpr):
        BK: tl.constexpr = GPI * GC
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        rows = tl.where(n_mask, offs_n, 0).to(tl.int64)  # rows past N read row 0: no N mask on loads
        span = tl.cdiv(tl.cdiv(K, SPLIT_K), BK) * BK
        k_lo = pid_k * span
        k_hi = tl.minimum(k_lo + span, K)
        if DOT:
            offs_m = tl.arange(0, BLOCK_M)
            m_mask = offs_m < M
            offs_k = tl.arange(0, BK)
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
                w = tl.reshape(dequant_tile(Q, S, rows, k0, K, SG, s_q, s_s, SCHEME, GPI, GC, MASK_K),
                               [BLOCK_N, BK])
                kk = k0 + offs_k
                if MASK_K:
                    xt = tl.load(X + offs_m[None, :] * s_xm + kk[:, None], mask=m_mask[None, :] & (kk < K)[:, None],
                                 other=0.0)
                else:
                    xt = tl.load(X + offs_m[None, :] * s_xm + kk[:, None], mask=m_mask[None, :], other=0.0)
                if IEEE:
                    acc += tl.dot(w, xt.to(tl.float32), input_precision="ieee")
                else:  # the dequantised weight rounded to the activations' dtype, as the reference
                    acc += tl.dot(w.to(xt.dtype), xt)
            mask = n_mask[:, None] & m_mask[None, :]
            poff = offs_m[None, :] * N + offs_n[:, None]
            yoff = offs_m[None, :].to(tl.int64) * s_ym + offs_n[:, None]
        else:  # one fp32 row: elementwise products, one reduction at the end
            gi = tl.arange(0, GPI)
            e = tl.arange(0, GC)
            acc3 = tl.zeros([BLOCK_N, GPI, GC], tl.float32)
            for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
                w = dequant_tile(Q, S, rows, k0, K, SG, s_q, s_s, SCHEME, GPI, GC, MASK_K)
                kk = k0 + gi[:, None] * GC + e[None, :]
                if MASK_K:
                    xv = tl.load(X + kk, mask=kk < K, other=0.0).to(tl.float32)
                else:
                    xv = tl.load(X + kk).to(tl.float32)
                acc3 += w * xv[None, :, :]
            acc = tl.sum(tl.sum(acc3, 2), 1)
            mask = n_mask
            poff = offs_n
            yoff = offs_n
        # the split-K sum (last program of a row block, in split order) and the store: accel.gemv's
        # epilogue with none of its options
        _reduce_finish(acc, acc, poff, yoff, poff, poff, mask, pid_n, pid_k, X, Y, Y, Y, P, CNT, M, N, SPLIT_K,
                       SPLIT, False, False, False, False)


    @triton.jit
    def _run_dot(Q, S, X, rows, col0, K, SG, s_q, s_s, s_xm, offs_m, m_mask, SCHEME: tl.constexpr,
                 GC: tl.constexpr, MASK_K: tl.constexpr, IEEE: tl.constexpr):
        """fp32 [len(rows), BLOCK_M]: the integer (fp8: unscaled) weight values of columns col0 ..
        col0 + GC (one scale group's run) dotted with x's columns there; the caller scales it."""
        cc = col0 + tl.arange(0, GC)
        if SCHEME == 1:  # int4: byte j holds columns 2j (low nibble) and 2j + 1
            e = tl.arange(0, GC // 2)
            bptr = Q + rows[:, None] * s_q + (col0 // 2 + e)[None, :]  # not col // 2: see dequant_tile
            if MASK_K:
                raw = tl.load(bptr, mask=(col0 + 2 * e < K)[None, :], other=0)
            else:
                raw = tl.load(bptr)
            b = raw.to(tl.int32)
            # nibbles into the mantissa of 2^23, minus 2^23 + 8: exact small integers, no conversion
            # unit; joined back into column order (on the H200 this beat x split into its even and odd
            # columns, in registers or by stride-2 reads, on every weight of the 9B and 27B shapes)
            lo = ((b & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
            hi = ((b >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
            v = tl.reshape(tl.join(lo, hi), [lo.shape[0], GC])
        else:
            if MASK_K:
                raw = tl.load(Q + rows[:, None] * s_q + cc[None, :], mask=(cc < K)[None, :], other=0)
            else:
                raw = tl.load(Q + rows[:, None] * s_q + cc[None, :])
            if SCHEME == 0:
                v = (raw.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
            else:  # fp8 e4m3: every value is exact in bf16
                v = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if MASK_K:
            xt = tl.load(X + offs_m[None, :] * s_xm + cc[:, None], mask=m_mask[None, :] & (cc < K)[:, None], other=0.0)
        else:
            xt = tl.load(X + offs_m[None, :] * s_xm + cc[:, None], mask=m_mask[None, :], other=0.0)
        if IEEE:
            part = tl.dot(v, xt.to(tl.float32), input_precision="ieee")
        else:  # small integers (and fp8 values) are exact in bf16 / fp16
            part = tl.dot(v.to(xt.dtype), xt)
        return part

    @triton.jit
    def _qgemv_group_kernel(X, Q, S, Y, P, CNT, M, N, K, SG, SPLIT_K, s_xm, s_q, s_s, s_ym,
                            SCHEME: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            GPI: tl.constexpr, GC: tl.constexpr, PER_ROW: tl.constexpr, SPLIT: tl.constexpr,
                            MASK_K: tl.constexpr, IEEE: tl.constexpr, STAGES: tl.constexpr):
        """The scale-after-dot GEMV: each run of GC columns inside one scale group is dotted as raw
        integers (exact in bf16) with x, and the fp32 [BLOCK_N, BLOCK_M] result is scaled by that
        group's [BLOCK_N] scales. Against _qgemv_kernel this drops the per-element scale multiply and
        the [BLOCK_N, GPI, GC] -> [BLOCK_N, BK] reshape (the tile still goes global -> shared ->
        registers -> shared for the wgmma, per the sm_90a SASS). The products are
        exact rather than rounded to bf16 first (closer to the fp32 reference, not the same bits as
        the other kernel: one kernel per weight, picked once, serves every row count)."""
        BK: tl.constexpr = GPI * GC
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        rows = tl.where(n_mask, offs_n, 0).to(tl.int64)
        span = tl.cdiv(tl.cdiv(K, SPLIT_K), BK) * BK
        k_lo = pid_k * span
        k_hi = tl.minimum(k_lo + span, K)
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
            for gi in tl.static_range(GPI):
                c0 = k0 + gi * GC
                part = _run_dot(Q, S, X, rows, c0, K, SG, s_q, s_s, s_xm, offs_m, m_mask, SCHEME, GC, MASK_K, IEEE)
                if PER_ROW:
                    acc += part
                else:
                    if MASK_K:
                        sc = tl.load(S + rows * s_s + c0 // SG, mask=n_mask & ((offs_n * 0 + c0) < K), other=0).to(tl.float32)
                    else:
                        sc = tl.load(S + rows * s_s + c0 // SG).to(tl.float32)
                    acc += part * sc[:, None]
        if PER_ROW:
            acc = acc * tl.load(S + rows * s_s).to(tl.float32)[:, None]
        mask = n_mask[:, None] & m_mask[None, :]
        poff = offs_m[None, :] * N + offs_n[:, None]
        yoff = offs_m[None, :].to(tl.int64) * s_ym + offs_n[:, None]
        # the split-K sum (last program of a row block, in split order) and the store: accel.gemv's
        # epilogue with none of its options
        _reduce_finish(acc, acc, poff, yoff, poff, poff, mask, pid_n, pid_k, X, Y, Y, Y, P, CNT, M, N, SPLIT_K,
                       SPLIT, False, False, False, False)


def tile_shape(enc, k: int, block_k: int) -> tuple[int, int, int]:
    """(SG, GPI, GC): the scale group, and a block_k tile as GPI runs of GC columns each inside one
    group (per-row scales: one run)."""
    sg = enc.group_for(k)
    if enc.group_size is None or sg >= block_k:
        return sg, 1, block_k
    return sg, block_k // sg, sg


def split_for(cfg: Config, n: int, k: int, device) -> int:
    if cfg.split:
        return cfg.split
    tiles = -(-n // cfg.block_n)
    want = -(-cfg.waves * _sms(device) // tiles)
    return max(1, min(want, k // (2 * cfg.block_k), 32))


def launch(cfg: Config, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, enc, k: int, y: torch.Tensor):
    """One call of the kernel: x [M, K] (rows contiguous), q/s the packed rows and scales, y [M, N]."""
    m = x.shape[0]
    assert cfg.dot or m == 1, "the FMA path is for one row"
    assert cfg.dot or not cfg.group, "the scale-after-dot kernel has no FMA path"
    n = q.shape[0]
    sg, gpi, gc = tile_shape(enc, k, cfg.block_k)
    tiles = -(-n // cfg.block_n)
    split = split_for(cfg, n, k, x.device) if tiles <= COUNTER_SLOTS else 1
    cnt = _counters(x.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else cnt
    if cfg.group:
        _qgemv_group_kernel[(tiles, split)](
            x, q, s, y, part, cnt, m, n, k, sg, split, x.stride(0), q.stride(0), s.stride(0), y.stride(0),
            SCHEME=SCHEME_IDS[enc.scheme], BLOCK_M=16, BLOCK_N=cfg.block_n, GPI=gpi, GC=gc,
            PER_ROW=sg >= k, SPLIT=split > 1, MASK_K=k % cfg.block_k != 0,
            IEEE=x.dtype == torch.float32 or not x.is_cuda, STAGES=cfg.stages, num_warps=cfg.warps)
        return y
    _qgemv_kernel[(tiles, split)](
        x, q, s, y, part, cnt, m, n, k, sg, split, x.stride(0), q.stride(0), s.stride(0), y.stride(0),
        SCHEME=SCHEME_IDS[enc.scheme], BLOCK_M=16 if cfg.dot else 1, BLOCK_N=cfg.block_n, GPI=gpi, GC=gc,
        DOT=cfg.dot, SPLIT=split > 1, MASK_K=k % cfg.block_k != 0,
        IEEE=x.dtype == torch.float32 or not x.is_cuda, STAGES=cfg.stages, num_warps=cfg.warps)
    return y


def pick(x, q, s, enc, k: int, y) -> Config:
    """The tuned config for this (encoding, N, K, dtype), tuning it now on CUDA outside capture."""
    if x.dtype == torch.float32:
        return _FP32 if x.shape[0] == 1 else _FP32_ROWS
    if not x.is_cuda:
        return _INTERP
    key = (x.device, enc.name, q.shape[0], k, x.dtype)
    hit = _TUNED.get(key)
    if hit is not None:
        return hit
    if os.environ.get("NINFER_QGEMV_TUNE", "1") == "0" or torch.cuda.is_current_stream_capturing():
        return candidates(enc)[0]
    _TUNED[key] = best = tune(candidates(enc), lambda cfg, qc, sc: launch(cfg, x, qc, sc, enc, k, y), q, s)[0]
    return best


def rotating_copies(q: torch.Tensor, s: torch.Tensor, factor: int = 3) -> list:
    """(q, s) and random copies of them, together past `factor` x the L2 cache (DRAM reads)."""
    dev = q.device
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size or (50 << 20)
    one = q.numel() * q.element_size() + s.numel() * s.element_size()
    n_copies = max(1, min(8, -(-factor * l2 // one)))
    out = [(q, s)]
    try:
        for _ in range(n_copies - 1):
            qc = torch.empty_like(q)
            qc.view(torch.uint8).copy_(torch.randint(0, 256, qc.shape, dtype=torch.uint8, device=dev))
            out.append((qc, s.clone()))
    except torch.OutOfMemoryError:
        pass
    return out


def tune(cands: list, run, q, s) -> tuple:
    """(best config, {config: ms per call}) over the candidates, each timed as a CUDA-Graph replay
    of calls over rotating copies of the weight (eager launches from Python would take longer on the
    host than a small weight takes on the device). Candidates that fail to compile are skipped."""
    ws = rotating_copies(q, s)
    one = q.numel() * q.element_size()
    reps = max(2, min(16, int(4e9 // (one * len(ws)))))
    times = {}
    for cfg in cands:
        try:
            for qc, sc in ws:
                run(cfg, qc, sc)
            torch.cuda.synchronize(q.device)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for this tile: not a candidate
            log.debug("quant gemv config %s skipped: %s", cfg, e)
            continue
        times[cfg] = replay_ms(lambda cfg=cfg, ws=ws: [run(cfg, qc, sc) for _ in range(reps) for qc, sc in ws],
                               q.device) / (reps * len(ws))
    del ws
    best = min(times, key=times.get) if times else cands[0]
    return best, times


def replay_ms(fn, dev) -> float:
    """Median ms of three replays of a graph of fn's launches (eager if capture fails)."""
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
        log.debug("quant gemv timing without a graph: %s", e)
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


def qgemv(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, enc, k: int, config: Config | None = None,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= 8, K] @ dequant(q, s)^T -> [M, N] in x's dtype (q: int8 / uint8 rows, fp8 as uint8)."""
    y = out if out is not None else torch.empty(x.shape[0], q.shape[0], dtype=x.dtype, device=x.device)
    cfg = config or pick(x, q, s, enc, k, y)
    return launch(cfg, x, q, s, enc, k, y)
