#!/usr/bin/env python3
"""Decode at the bandwidth limit (issue 21), on the device: one table per part, in one process.

1. kernels: for every decode weight shape of the named Qwen3.5 shapes and M in 1, 2, 4, 8 rows, the
   bytes per second our GEMV (ninfer_core.accel.gemv, the config it tunes) reads the weight at,
   against torch's linear (cuBLAS) on the same matrix, against the read-only stream measured in
   this run; both timed as CUDA-Graph replays of calls over rotating copies of the matrix (more
   than 3x the L2 cache together, so each call streams from DRAM; graphs, so Python's launch cost
   stays out, as in a decode step). Each cell is also checked against torch (rel err) and for
   identical bits on a second call (split-K's last-program reduction must be deterministic); for
   MoE shapes, the expert part of a round: the grouped-expert GEMVs against the per-pair kernels;
2. models: for each shape, the GPU runner (random bf16 weights, CUDA Graphs) decoding b = 1 and 8
   lanes with the GEMV on and off (the same runner, graphs dropped between), tok/s against the
   read-stream floor (`ninfer_core.bench.run.step_bytes`), and greedy tokens of the b = 8 round
   against the b = 1 rounds of the same prompts (argmax of the first 8 steps of each lane).

    python3 scripts/decode_bench.py --shapes qwen3.5-9b qwen3.5-27b qwen3.5-35b-a3b --budget 240

Prints the tables as it goes; `--json PATH` writes the numbers. `scripts/gpu_check.py --order decode`
runs it, then the engine's greedy check and `ninfer bench` with NINFER_GEMV on and off.
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

from ninfer_core.accel import gemv as GV
from ninfer_core.bench import ceilings


def decode_linears(cfg: dict) -> list[tuple[str, int, int, str]]:
    """(name, N, K, kind) of the weight matrices one decode step multiplies by (kind: plain,
    gated = a fused [gate | up] of 2N rows read by one GEMV, logits = fp32 out), from an HF config."""
    h = cfg["hidden_size"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    heads, kvh, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    out = [("gdn in [qkv|z|b|a]", 2 * hk * dk + 2 * hv * dv + 2 * hv, h, "plain"),
           ("gdn out", h, hv * dv, "plain"),
           ("attn qkv (q+gate|k|v)", heads * 2 * hd + 2 * kvh * hd, h, "plain"),
           ("attn o_proj", h, heads * hd, "plain")]
    if cfg.get("num_experts"):
        out.append(("moe router", cfg["num_experts"], h, "plain"))
    else:
        out += [("mlp gate|up + silu", cfg["intermediate_size"], h, "gated"),
                ("mlp down", h, cfg["intermediate_size"], "plain")]
    out.append(("lm_head", cfg["vocab_size"], h, "logits"))
    return out


def graph_time(fns, repeats: int = 5) -> float:
    """Median seconds of one replay of a CUDA Graph that calls every fn once (off CUDA, for the
    script's CPU smoke run: of one pass over them)."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for f in fns:
            f()
        return time.perf_counter() - t0
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    del g
    return sorted(out)[len(out) // 2]


def _copies(n_rows: int, k: int, l2: int, dev):
    one = n_rows * k * 2
    n = max(1, min(12, -(-3 * l2 // one)))
    return [torch.randn(n_rows, k, device=dev, dtype=torch.bfloat16) for _ in range(n)]


def kernel_table(cfgs: dict, rows=(1, 2, 4, 8), read_GBps: float = 0.0, budget: float = 1e9) -> list[dict]:
    t_end = time.monotonic() + budget
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if dev.type == "cuda" else 1 << 16
    seen, out = set(), []
    for shape, cfg in cfgs.items():
        for name, n, k, kind in decode_linears(cfg):
            if (n, k, kind) in seen:
                continue
            seen.add((n, k, kind))
            w_rows = 2 * n if kind == "gated" else n
            ws = _copies(w_rows, k, l2, dev)
            nbytes = w_rows * k * 2
            for m in rows:
                if time.monotonic() > t_end:
                    print(f"  (kernel table stopped at its budget: {shape} {name})", flush=True)
                    return out
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                if kind == "gated":
                    ours = [lambda w=w, x=x: GV.gemv_silu_mul(x, w) for w in ws]
                    theirs = [lambda w=w, x=x: F.linear(x, w) for w in ws]
                    want = GV.ref_gemv_silu_mul(x, ws[0])
                elif kind == "logits":
                    ours = [lambda w=w, x=x: GV.gemv(x, w, out_dtype=torch.float32) for w in ws]
                    theirs = [lambda w=w, x=x: F.linear(x, w).float() for w in ws]
                    want = F.linear(x, ws[0]).float()
                else:
                    ours = [lambda w=w, x=x: GV.gemv(x, w) for w in ws]
                    theirs = [lambda w=w, x=x: F.linear(x, w) for w in ws]
                    want = F.linear(x, ws[0])
                got = ours[0]()  # tunes this (shape, rows bucket)
                again = ours[0]()
                err = float((got.float() - want.float()).norm() / want.float().norm())
                same = bool(torch.equal(got, again))
                reps = max(1, min(16, int(2e-3 * 4e12 / (nbytes * len(ws)))))
                t_ours = graph_time(ours * reps) / (reps * len(ws))
                t_torch = graph_time(theirs * reps) / (reps * len(ws))
                key = ("gated" if kind == "gated" else "plain", n, k, GV.bucket(m))
                cfg_used = GV.tuned().get(key)
                row = {"shape": shape, "name": name, "N": n, "K": k, "kind": kind, "M": m, "MiB": nbytes / 2**20,
                       "ours_GBps": nbytes / t_ours / 1e9, "torch_GBps": nbytes / t_torch / 1e9,
                       "rel_err": err, "deterministic": same,
                       "config": None if cfg_used is None else (
                           f"{'dot' if cfg_used.dot else 'fma'} n{cfg_used.block_n} k{cfg_used.block_k} "
                           f"w{cfg_used.warps} s{cfg_used.stages} "
                           f"split{GV.split_for(cfg_used, n, k, x.device)}")}
                if read_GBps:
                    row["ours_vs_read"] = row["ours_GBps"] / read_GBps
                    row["torch_vs_read"] = row["torch_GBps"] / read_GBps
                out.append(row)
                print(f"  {name:22} {k:>6}->{w_rows:<7} M={m}  ours {row['ours_GBps']:6,.0f} GB/s "
                      f"({row.get('ours_vs_read', 0):.2f})  torch {row['torch_GBps']:6,.0f} GB/s "
                      f"({row.get('torch_vs_read', 0):.2f})  err {err:.1e}{'' if same else ' NONDETERMINISTIC'}"
                      f"  [{row['config']}]", flush=True)
            del ws
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return out


def moe_table(shape: str, cfg: dict, rows=(1, 2, 4, 8), read_GBps: float = 0.0) -> list[dict]:
    """The MoE block of a decode round (router ids given): qwen35's per-(token, slot) expert kernels
    against the grouped-expert GEMVs (each chosen expert read once), bytes = the distinct experts'
    rows + the shared expert's; 16 routings per row count rotate, so the experts come from DRAM."""
    from ninfer_core.accel import moe_kernels as MK

    e, inter, h, k = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"], cfg["num_experts_per_tok"]
    si = cfg.get("shared_expert_intermediate_size") or inter
    bf = {"device": "cuda", "dtype": torch.bfloat16}
    gu, dn = torch.randn(e, 2 * inter, h, **bf), torch.randn(e, h, inter, **bf) / 16
    sh = (torch.randn(si, h, **bf), torch.randn(si, h, **bf), torch.randn(h, si, **bf) / 16, torch.randn(1, h, **bf))
    g = torch.Generator().manual_seed(0)
    out = []
    for m in rows:
        x = torch.randn(m, h, **bf)
        tops = [torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).cuda() for _ in range(16)]
        tw = torch.softmax(torch.randn(m, k, device="cuda"), -1).to(torch.bfloat16)
        nbytes = sum(len(set(t.flatten().tolist())) for t in tops) / len(tops) * 3 * inter * h * 2 + 3 * si * h * 2
        old = [lambda t=t, x=x, tw=tw: MK.moe_decode(x, tw, t, gu, dn, sh) for t in tops]  # noqa: F821
        new = [lambda t=t, x=x, tw=tw: MK.moe_decode(x, tw, t, gu, dn, sh, grouped=True) for t in tops]  # noqa: F821
        a, b = old[0](), new[0]()
        err = float((b.float() - a.float()).norm() / a.float().norm())
        t_old, t_new = graph_time(old * 4) / (4 * len(tops)), graph_time(new * 4) / (4 * len(tops))
        row = {"shape": shape, "M": m, "MiB": nbytes / 2**20, "grouped_GBps": nbytes / t_new / 1e9,
               "per_pair_GBps": nbytes / t_old / 1e9, "rel_err": err, "deterministic": True}
        out.append(row)
        share = f"({row['grouped_GBps'] / read_GBps:.2f})  per-pair {row['per_pair_GBps']:6,.0f} GB/s " \
                f"({row['per_pair_GBps'] / read_GBps:.2f})" if read_GBps else ""
        print(f"  moe experts {shape} M={m} {row['MiB']:6.1f} MiB  grouped {row['grouped_GBps']:6,.0f} GB/s {share}  "
              f"err vs per-pair {err:.1e}  ({t_new * 1e6:.1f} us vs {t_old * 1e6:.1f} us)", flush=True)
    del gu, dn
    torch.cuda.empty_cache()
    return out


def model_ab(shape: str, cfg: dict, batches=(1, 8), steps: int = 32, prompt: int = 256,
             read_GBps: float = 0.0) -> dict:
    """One runner of `shape`: decode with the GEMV on and off at each batch width; greedy tokens of
    the widest batch against each lane decoded alone (with the GEMV on)."""
    from ninfer_qwen35.family import Qwen35Family

    from ninfer_core.bench.run import Lanes, ninfer_decode, step_bytes, weight_facts
    from ninfer_core.config import EngineOptions
    from ninfer_core.engine.model_api import RunnerOptions

    fam = Qwen35Family()
    art = fam.random_artifact(cfg, device="cuda", seed=0)
    runner = fam.load(art, device="cuda")
    runner.configure(RunnerOptions(cuda_graph=True, max_lanes=max(batches),
                                   max_segment_tokens=EngineOptions().prefill_chunk))
    ppl = -(-(prompt + steps + 16) // 64)
    runner.allocate_cache(max(batches) * ppl + 1, max(8, max(batches)))
    lanes = Lanes(runner, ppl)
    facts, spec = weight_facts(runner), runner.cache_spec()
    vocab = min(runner.info.vocab_size, 240000)
    res = {"shape": shape, "decode": {}}
    for mode in (True, False):
        runner.gemv = mode
        runner._drop_graphs()
        for b in batches:
            d = ninfer_decode(torch, runner, lanes, b, prompt, steps, vocab, 0)
            floor = b * read_GBps * 1e9 / step_bytes(facts, spec, b, d["context"], runner) if read_GBps else 0
            d["floor_total_tok_s"] = floor
            d["vs_floor"] = d["total_tok_s"] / floor if floor else 0
            res["decode"][f"{'on' if mode else 'off'}_b{b}"] = d
            print(f"  {shape} GEMV {'on ' if mode else 'off'} b={b}: {d['total_tok_s']:8,.1f} tok/s total "
                  f"({d['step_ms']:.2f} ms/step)  floor {floor:8,.1f}  x{d['vs_floor']:.2f}", flush=True)
    runner.gemv = True
    runner._drop_graphs()
    res["greedy_batch_equals_alone"] = greedy_check(runner, lanes, max(batches), prompt, vocab)
    print(f"  {shape} greedy b={max(batches)} vs each alone (GEMV on, 8 steps): "
          f"{res['greedy_batch_equals_alone']}/{max(batches)} lanes identical", flush=True)
    del runner, art
    torch.cuda.empty_cache()
    return res


def greedy_check(runner, lanes, b: int, prompt: int, vocab: int, steps: int = 8) -> int:
    from ninfer_core.bench.run import _prefill, _prompt

    def run(idx: list[int]) -> list[list[int]]:
        views = lanes.views(max(idx) + 1)
        views = [views[i] for i in idx]
        for i, v in zip(idx, views):
            v.num_cached = 0
            runner.reset_slot(v.slot)
            _prefill(runner, v, _prompt(torch, prompt, vocab, 500 + i))
        toks = [7 + i for i in idx]
        got = [[] for _ in idx]
        for _ in range(steps):
            toks = runner.decode(views, toks).argmax(-1).tolist()
            for g, t in zip(got, toks):
                g.append(t)
            for v in views:
                v.num_cached += 1
        return got

    together = run(list(range(b)))
    alone = [run([i])[0] for i in range(b)]
    return sum(x == y for x, y in zip(together, alone))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=["qwen3.5-9b", "qwen3.5-27b", "qwen3.5-35b-a3b"])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--no-models", action="store_true")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--budget", type=float, default=240, help="seconds for the whole script")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    t0 = time.monotonic()
    from ninfer_qwen35.shapes import SHAPES

    cfgs = {s: SHAPES[s] for s in a.shapes}
    read = ceilings._read_rate(torch, torch.device("cuda"), 2 << 30) / 1e9
    print(f"decode bench  device={torch.cuda.get_device_name(0)}  torch={torch.__version__}  read stream "
          f"{read:,.0f} GB/s  NINFER_GEMV_TUNE={os.environ.get('NINFER_GEMV_TUNE', '1')}", flush=True)
    res = {"read_GBps": read, "kernels": [], "models": []}
    if not a.no_kernels:
        print("kernels: GB/s reading the weight (share of the read stream); graph replays, rotating copies",
              flush=True)
        rows = [int(r) for r in a.rows.split(",")]
        res["kernels"] = kernel_table(cfgs, rows, read, a.budget * 0.7)
        for s, c in cfgs.items():
            if c.get("num_experts") and time.monotonic() - t0 < a.budget - 20:
                res["kernels"] += moe_table(s, c, rows, read)
    if not a.no_models:
        print("models: runner decode, GEMV on / off (CUDA Graphs)", flush=True)
        for s in a.shapes:
            left = a.budget - (time.monotonic() - t0)
            if left < 45:
                print(f"  {s}: skipped, {left:.0f} s left", flush=True)
                continue
            res["models"].append(model_ab(s, cfgs[s], steps=a.steps, read_GBps=read))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    bad = [r for r in res["kernels"] if r["rel_err"] > 2e-2 or not r["deterministic"]]
    print(f"DECODE kernels {len(res['kernels'])} cells, {len(bad)} wrong or nondeterministic; "
          f"done in {time.monotonic() - t0:.0f} s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
