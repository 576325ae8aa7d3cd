#!/usr/bin/env python3
"""Device diagnostics behind the #4/#6 performance work (one call, short table at the end).

Parts (pick with --parts):
- gemv:    decode GEMVs of the 9B/27B shapes through cuBLAS (F.linear), each captured 20 times in
           a CUDA Graph (no launch cost), weights cycled so L2 never holds them, batch 1 and 2; plus
           the read bandwidth of one large GEMV and of a sum. (A Triton GEMV of ours was compared
           here on 2026-12-01 and lost on every shape but one; docs/bench.md.)
- decode:  9B shape, batch 1: the bench's step loop (graph replay + argmax + readback + host
           bookkeeping) against back-to-back graph replays, which leaves the host gap visible.
- prefill: 27B shape, a chunk of T tokens after a ~28k-token prefix (the context-cache warm
           turn): wall time, host time until the call returns, device-kernel sum, host syncs,
           and the top host-side ops of the T=281 chunk; then the in-chunk capture
           (prefill_with_snapshot of 298 tokens capturing at +281) twice, with the number of new
           Triton cache entries each time (a first-use compile shows as entries and seconds).

    python3 scripts/gpu_diag.py --out $OUT --parts gemv,decode,prefill
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "plugins", "qwen35")]

LINES: list[str] = []


def say(s: str) -> None:
    print(s, flush=True)
    LINES.append(s)


def ev_time(fn, iters: int) -> float:
    """Seconds per call, CUDA events around `iters` calls (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / iters


def graph_time(fn, reps: int = 20) -> float:
    """Seconds per call of fn, captured `reps` times in one CUDA Graph (no host launch cost)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return ev_time(g.replay, 5) / reps


def part_gemv(res: dict) -> None:
    from ninfer_core.accel.kernels import silu_mul

    dev = "cuda"
    big = torch.randn(248320, 4096, dtype=torch.bfloat16, device=dev)
    x1 = torch.randn(1, 4096, dtype=torch.bfloat16, device=dev)
    nbytes = big.numel() * 2
    t = ev_time(lambda: F.linear(x1, big), 20)
    say(f"read bw: cuBLAS GEMV over 2.03 GB {nbytes / t / 1e9:,.0f} GB/s")
    t = ev_time(lambda: big.sum(dtype=torch.float32), 20)
    say(f"read bw: sum over 2.03 GB {nbytes / t / 1e9:,.0f} GB/s")
    del big
    torch.cuda.empty_cache()
    shapes = {  # name: (N, K, SwiGLU input)
        "9b w_in": (12352, 4096, False), "9b qkv": (10240, 4096, False), "9b out": (4096, 4096, False),
        "9b gate_up": (24576, 4096, False), "9b down": (4096, 12288, True),
        "27b w_in": (16480, 5120, False), "27b out": (5120, 6144, False),
        "27b gate_up": (34816, 5120, False), "27b down": (5120, 17408, True),
    }
    rows = {}
    for name, (n, k, silu) in shapes.items():
        copies = max(2, int(400e6 // (n * k * 2)) + 1)
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) for _ in range(copies)]
        gb = n * k * 2 / 1e9
        for b in (1, 2):
            x = torch.randn(b, 2 * k if silu else k, dtype=torch.bfloat16, device=dev)
            it = iter(range(10**9))

            def cub():
                w = ws[next(it) % copies]
                return F.linear(silu_mul(x) if silu else x, w)

            t_cub = graph_time(cub)
            rows[f"{name} b={b}"] = dict(cublas_us=t_cub * 1e6, cublas_GBps=gb / t_cub)
            say(f"{name:12s} b={b}  cuBLAS{'+silu' if silu else ''} {t_cub * 1e6:7.1f} us {gb / t_cub:6,.0f} GB/s")
        del ws
        torch.cuda.empty_cache()
    res["gemv"] = rows


def build(shape: str):
    from ninfer_core.bench.shapes import SHAPES
    from ninfer_qwen35.family import Qwen35Family

    fam = Qwen35Family()
    art = fam.random_artifact(SHAPES[shape], device="cuda", seed=0)
    runner = fam.load(art, device="cuda")
    return runner


def part_decode(res: dict) -> None:
    from ninfer_core.bench.run import Lanes, _prefill, _prompt

    runner = build("qwen3.5-9b")
    runner.allocate_cache(64, 8)
    lanes = Lanes(runner, 16)
    (view,) = lanes.views(1)
    _prefill(runner, view, _prompt(torch, 512, 240000, 1))
    tok = [1]

    def step():
        nonlocal tok
        logits = runner.decode([view], tok)
        tok = logits.argmax(dim=-1).tolist()
        view.num_cached += 1

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(64):
        step()
    torch.cuda.synchronize()
    t_loop = (time.perf_counter() - t0) / 64
    graph = runner._graphs[1][0]
    t_replay = ev_time(graph.replay, 64)
    # host part of one step: build + copy meta, no replay
    segs = [runner._segment(view, 1, offset=0)]
    t0 = time.perf_counter()
    for _ in range(200):
        runner._fill_meta(segs, tok, runner.table_width)
    t_meta = (time.perf_counter() - t0) / 200
    res["decode"] = dict(loop_ms=t_loop * 1e3, replay_ms=t_replay * 1e3, meta_ms=t_meta * 1e3,
                         table_width=runner.table_width)
    say(f"9b decode b=1: step loop {t_loop * 1e3:.3f} ms, back-to-back graph replay {t_replay * 1e3:.3f} ms, "
        f"host meta fill {t_meta * 1e3:.3f} ms (table width {runner.table_width})")
    del runner, graph
    torch.cuda.empty_cache()


def part_prefill(res: dict, prefix: int, ts: list[int]) -> None:
    from ninfer_core.engine.model_api import SeqView
    from ninfer_core.bench.run import _prompt

    runner = build("qwen3.5-27b")
    pages_n = -(-(prefix + max(ts) + 64) // 64) + 2
    runner.allocate_cache(pages_n, 4)
    runner.reset_slot(0)
    pages = list(range(pages_n))
    toks = _prompt(torch, prefix + max(*ts, 298), 240000, 3)  # 298: the in-chunk capture below
    t0 = time.perf_counter()
    view = SeqView(slot=0, pages=pages, num_cached=0)
    for i in range(0, prefix, 1024):
        part = toks[i: min(prefix, i + 1024)]
        runner.prefill(view, part)
        view.num_cached += len(part)
    torch.cuda.synchronize()
    say(f"27b: {prefix}-token prefix in {time.perf_counter() - t0:.2f} s (1024-token chunks)")
    out = {}
    for t in ts:
        chunk = toks[prefix: prefix + t]

        def once():
            return runner.prefill(SeqView(slot=0, pages=pages, num_cached=prefix), chunk)

        for _ in range(2):
            once()
        torch.cuda.synchronize()
        walls, hosts = [], []
        for _ in range(4):
            torch.cuda.synchronize()
            a = time.perf_counter()
            once()
            b = time.perf_counter()
            torch.cuda.synchronize()
            c = time.perf_counter()
            hosts.append(b - a)
            walls.append(c - a)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                once()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = sum(1 for x in w if "synchroniz" in str(x.message))
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            once()
            torch.cuda.synchronize()
        kern = 0.0
        nk = 0
        cpu_rows = []
        for e in prof.key_averages():
            dt = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kern += dt
                nk += e.count
            else:
                cpu_rows.append((e.self_cpu_time_total, e.count, e.key[:60]))
        cpu_rows.sort(reverse=True)
        out[t] = dict(wall_ms=min(walls) * 1e3, host_ms=min(hosts) * 1e3, kernels_ms=kern / 1e3, kernels=nk,
                      syncs=syncs)
        say(f"27b chunk T={t:5d} at {prefix}: wall {min(walls) * 1e3:7.1f} ms  host-return {min(hosts) * 1e3:7.1f} ms  "
            f"kernels {kern / 1e3:7.1f} ms ({nk} launches)  host syncs {syncs}")
        if t in (17, 281):
            for st, cnt, key in cpu_rows[:22]:
                say(f"     cpu self {st / 1e3:7.2f} ms x{cnt:<5d} {key}")
    res["prefill"] = out
    # the in-chunk capture (a context-cache resume's turn closure): first and second use
    cache_dir = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")

    def entries() -> int:
        return sum(len(f) for _, _, f in os.walk(cache_dir)) if os.path.isdir(cache_dir) else 0

    chunk = toks[prefix: prefix + 298]
    fold = {}
    for rep in range(3):
        n0 = entries()
        torch.cuda.synchronize()
        a = time.perf_counter()
        runner.prefill_with_snapshot(SeqView(slot=0, pages=pages, num_cached=prefix), chunk, 281, 1)
        torch.cuda.synchronize()
        dt = time.perf_counter() - a
        fold[rep] = dict(ms=dt * 1e3, new_triton_cache_files=entries() - n0)
        say(f"27b in-chunk capture T=298 at +281 after {prefix}, use {rep + 1}: {dt * 1e3:7.1f} ms, "
            f"{entries() - n0} new Triton cache files")
    res["prefill_fold"] = fold


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "diag-out"))
    ap.add_argument("--parts", default="gemv,decode,prefill")
    ap.add_argument("--prefix", type=int, default=28000)
    ap.add_argument("--ts", default="17,96,281,298,1024")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(0)}
    for part in a.parts.split(","):
        t0 = time.perf_counter()
        try:
            if part == "gemv":
                part_gemv(res)
            elif part == "decode":
                part_decode(res)
            elif part == "prefill":
                part_prefill(res, a.prefix, [int(x) for x in a.ts.split(",")])
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            say(f"part {part} failed: {type(e).__name__}: {e}")
        say(f"== part {part} took {time.perf_counter() - t0:.0f} s")
    with open(os.path.join(a.out, "diag.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(os.path.join(a.out, "diag.txt"), "w") as f:
        f.write("\n".join(LINES) + "\n")
    print("\n==== summary\n" + "\n".join(LINES), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
