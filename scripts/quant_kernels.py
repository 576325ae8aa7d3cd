#!/usr/bin/env python3
"""Kernel table of the quantised linears (issue 22), on the device, in one process:

1. decode: for every layer weight of the named Qwen3.5 shapes (the fused projections a decode step
   multiplies by; lm_head stays bf16 and is left out) in int8 and int4 (groups of --group-size), at
   M = 1 and 8 rows, the GB/s of packed bytes (values + scales) the GEMV (ninfer_core.quant.qgemv)
   reads, best of its candidates and the spread over them, against the read-only stream measured in
   this run; each timed as CUDA-Graph replays over rotating copies of the weight (more than 3x the L2
   cache together, so each call streams from DRAM), each checked against the torch reference;
2. prefill: the first shape's largest layer weight at 1024 rows (the engine's prefill chunk) through
   the dequantise-to-scratch + cuBLAS path and the tiled Triton GEMM, against bf16 cuBLAS.

    python3 scripts/quant_kernels.py --shapes qwen3.5-9b qwen3.5-27b --budget 90

`scripts/gpu_check.py --order quant` runs it first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ninfer_core.bench import ceilings
from ninfer_core.quant import qgemv as QG
from ninfer_core.quant.encodings import parse_encoding
from ninfer_core.quant.kernels import triton_linear
from ninfer_core.quant.weight import QuantizedWeight, reference_linear


def layer_linears(cfg: dict) -> list[tuple[str, int, int]]:
    """(name, N, K) of a dense Qwen3.5 layer's weights as the GPU runner fuses them."""
    h = cfg["hidden_size"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    heads, kvh, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    return [("gdn in [qkv|z|b|a]", 2 * hk * dk + 2 * hv * dv + 2 * hv, h), ("gdn out", h, hv * dv),
            ("attn qkv", heads * 2 * hd + 2 * kvh * hd, h), ("attn o_proj", h, heads * hd),
            ("mlp [gate|up]", 2 * cfg["intermediate_size"], h), ("mlp down", h, cfg["intermediate_size"])]


def graph_ms(fn, repeats: int = 5) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    del g
    return sorted(out)[len(out) // 2]


def cfg_str(c) -> str:
    return f"{'grp ' if c.group else ''}n{c.block_n} k{c.block_k} w{c.warps} s{c.stages} v{c.waves}"


def decode_table(cfgs: dict, encs: list[str], rows, read: float, t_end: float) -> list[dict]:
    dev = torch.device("cuda")
    out, seen = [], set()
    for shape, cfg in cfgs.items():
        for name, n, k in layer_linears(cfg):
            if (n, k) in seen:
                continue
            seen.add((n, k))
            w = torch.randn(n, k, device=dev) * 0.02
            for enc_name in encs:
                qw = QuantizedWeight.from_float(w, parse_encoding(enc_name), dtype=torch.bfloat16)
                q, s = qw.kernel_operands
                nbytes = qw.nbytes
                for m in rows:
                    if time.monotonic() > t_end:
                        print(f"  (decode table stopped at its budget: {shape} {name})", flush=True)
                        return out
                    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
                    y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
                    best, times = QG.tune(list(dict.fromkeys(QG.candidates(qw.enc) + QG.CANDIDATES)), lambda c, qc, sc, x=x, y=y, enc=qw.enc, k=k: QG.launch(c, x, qc, sc, enc, k, y),
                                          q, s)
                    got = triton_linear(x, qw, best)
                    ref = reference_linear(x.float(), qw.to(dtype=torch.float32))
                    err = float((got.float() - ref).norm() / ref.norm())
                    gbs = {c: nbytes / (t * 1e-3) / 1e9 for c, t in times.items()}
                    row = {"shape": shape, "name": name, "N": n, "K": k, "enc": enc_name, "M": m,
                           "MiB": nbytes / 2**20, "GBps": gbs[best], "vs_read": gbs[best] / read,
                           "worst_GBps": min(gbs.values()), "rel_err": err,
                           "config": f"{cfg_str(best)} split{QG.split_for(best, n, k, dev)}",
                           "all": {cfg_str(c): round(v) for c, v in gbs.items()}}
                    out.append(row)
                    print(f"  {shape:12} {name:19} {k:>6}->{n:<6} {enc_name:10} M={m}  {row['GBps']:6,.0f} GB/s "
                          f"x{row['vs_read']:.2f} of read (worst cand. {row['worst_GBps']:5,.0f})  err {err:.1e}  "
                          f"[{row['config']}]", flush=True)
            del w
            torch.cuda.empty_cache()
    return out


def prefill_table(cfg: dict, encs: list[str], m: int = 1024) -> list[dict]:
    dev = torch.device("cuda")
    name, n, k = max(layer_linears(cfg), key=lambda t: t[1] * t[2])
    w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    t_bf16 = graph_ms(lambda: F.linear(x, w))
    out = []
    print(f"  prefill {name} {k}->{n} M={m}: bf16 cuBLAS {t_bf16 * 1e3:7.1f} us", flush=True)
    for enc_name in encs:
        qw = QuantizedWeight.from_float(w.float(), parse_encoding(enc_name), dtype=torch.bfloat16)
        ref = F.linear(x.float(), qw.dequantize(torch.float32))
        import ninfer_core.quant.kernels as QK

        default = QK.DEQUANT_CFG
        scratch = torch.empty(n, k, dtype=torch.bfloat16, device=dev)
        for dcfg in QK.DEQUANT_CANDIDATES:  # the dequantiser alone, each program shape
            QK.DEQUANT_CFG = dcfg
            try:
                t = graph_ms(lambda qw=qw: QK.dequantize_rows(qw, torch.bfloat16, out=scratch))
            except Exception as e:  # noqa: BLE001 - a shape that does not compile is not a candidate
                print(f"    {enc_name:10} dequant {dcfg}: {type(e).__name__}", flush=True)
                continue
            gbs = (qw.nbytes + scratch.numel() * 2) / (t * 1e-3) / 1e9
            print(f"    {enc_name:10} dequant rows {dcfg[0]} cols {dcfg[1]} warps {dcfg[2]}: "
                  f"{t * 1e3:7.1f} us "
                  f"({gbs:,.0f} GB/s read + written)", flush=True)
            out.append({"enc": enc_name, "path": f"dequant {dcfg}", "us": t * 1e3, "GBps": gbs})
        QK.DEQUANT_CFG = default
        del scratch
        for path in ("scratch", "gemm"):
            cfg = ("scratch",) if path == "scratch" else None
            if path == "gemm":
                os.environ["NINFER_QGEMM"] = "triton"
            try:
                err = float((triton_linear(x, qw, cfg).float() - ref).norm() / ref.norm())
                t = graph_ms(lambda qw=qw, cfg=cfg: triton_linear(x, qw, cfg))
            finally:
                os.environ.pop("NINFER_QGEMM", None)
            row = {"enc": enc_name, "path": path, "M": m, "us": t * 1e3, "vs_bf16": t_bf16 / t, "rel_err": err}
            out.append(row)
            print(f"    {enc_name:10} {path:8} {t * 1e3:7.1f} us  x{t_bf16 / t:.2f} of bf16's rate  err {err:.1e}",
                  flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=["qwen3.5-9b", "qwen3.5-27b"])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--budget", type=float, default=90, help="seconds for the decode table")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("quant kernels: needs CUDA")
        return 1
    from ninfer_qwen35.shapes import SHAPES

    t0 = time.monotonic()
    read = ceilings.measure_ceilings(torch, torch.device("cuda"))["read_bandwidth_GBps"]
    encs = [f"int8-g{a.group_size}", f"int4-g{a.group_size}"]
    cfgs = {s: SHAPES[s] for s in a.shapes}
    print(f"quant kernels: read stream {read:,.0f} GB/s; decode GEMV, GB/s of packed bytes (values + scales)",
          flush=True)
    dec = decode_table(cfgs, encs, [int(r) for r in a.rows.split(",")], read, t0 + a.budget)
    print("quant kernels: prefill of one chunk (target >= 0.8 of bf16)", flush=True)
    pre = prefill_table(cfgs[a.shapes[0]], encs)
    print(f"quant kernels done in {time.monotonic() - t0:.0f} s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"read_GBps": read, "decode": dec, "prefill": pre}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
