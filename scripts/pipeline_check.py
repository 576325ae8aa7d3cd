#!/usr/bin/env python3
"""Pipeline stages on two GPUs against one GPU, in one call (issue 26; nvidia-h200-x2).

The Qwen3.5 27B shape with random weights (the same seed on every device: each stage draws its own
layers on its own GPU) runs whole on cuda:0 (CUDA Graph decode, then eager), then split over
cuda:0 and cuda:1 as two pipeline stages (NCCL, NVLink multicast off), with and without the
prefill cut into micro-batches. Each run prefills LANES prompts and decodes them together, greedy;
the table gives the prefill time, the decode time per round, and whether every lane's greedy
tokens equal the whole model's (and the largest logit difference of the first token).

    python3 scripts/pipeline_check.py [--prompt 512 --steps 32 --lanes 4 --stage-layers 32,32]

`--smoke` runs the same steps on the CPU at a tiny shape (gloo), to check the script itself.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

os.environ["NCCL_NVLS_ENABLE"] = "0"


def _sync():
    import torch

    if torch.cuda.is_available():
        _sync()


def run_greedy(runner, prompts, steps, pages_per_lane):
    import torch

    from ninfer_core.engine.model_api import SeqView

    views = [SeqView(i, list(range(i * pages_per_lane, (i + 1) * pages_per_lane)), 0) for i in range(len(prompts))]
    for v in views:
        runner.reset_slot(v.slot)
    _sync()
    t0 = time.perf_counter()
    first = []
    for v, p in zip(views, prompts):
        first.append(runner.prefill(v, p).float())
        v.num_cached = len(p)
    _sync()
    t_prefill = time.perf_counter() - t0
    out = [[int(f.argmax())] for f in first]
    t0 = time.perf_counter()
    for _ in range(steps - 1):
        logits = runner.decode(views, [o[-1] for o in out])
        for o, row in zip(out, logits.argmax(-1).tolist()):
            o.append(int(row))
        for v in views:
            v.num_cached += 1
    _sync()
    return out, torch.stack(first).cpu(), t_prefill, (time.perf_counter() - t0) / max(1, steps - 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per lane")
    ap.add_argument("--steps", type=int, default=32, help="greedy tokens per lane")
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--stage-layers", default=None, help="e.g. 32,32 (default: from free memory)")
    ap.add_argument("--shape", default="qwen3.5-27b")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU (checks the script)")
    a = ap.parse_args()

    import torch

    devices = ["cpu", "cpu"] if a.smoke else ["cuda:0", "cuda:1"]
    if not a.smoke and torch.cuda.device_count() < 2:
        print("pipeline check: skipped, it needs 2 CUDA devices (nvidia-h200-x2)")
        return 0
    from ninfer_qwen35.family import Qwen35Family
    from ninfer_qwen35.shapes import SHAPES

    from ninfer_core.engine.pipeline.runner import PipelineRunner
    from ninfer_core.engine.pipeline.split import parse_stage_layers

    if a.smoke:
        from ninfer_qwen35.testing import tiny_text_config

        hf = tiny_text_config("dense", 1024, 4, 64, False, False)
    else:
        hf = SHAPES[a.shape]
    fam = Qwen35Family()
    gen = torch.Generator().manual_seed(1)
    vocab = min(240000, hf["vocab_size"])
    prompts = [torch.randint(0, vocab, (a.prompt,), generator=gen).tolist() for _ in range(a.lanes)]
    pages_per_lane = -(-(a.prompt + a.steps) // 64)
    pages = pages_per_lane * a.lanes
    rows = []

    t0 = time.perf_counter()
    whole = fam.load(fam.random_artifact(hf, device=devices[0], seed=0), devices[0])
    whole.allocate_cache(pages, a.lanes)
    load_whole = time.perf_counter() - t0
    ref = None
    for graphs in ((True, False) if not a.smoke else (False,)):
        if not a.smoke:
            whole.configure(cuda_graph=graphs)
        toks, first, tp, td = run_greedy(whole, prompts, a.steps, pages_per_lane)
        if ref is None:
            ref = (toks, first)
        rows.append((f"1 GPU ({'graphs' if graphs else 'eager'})", tp, td, toks == ref[0],
                     float((first - ref[1]).abs().max())))
    del whole
    if not a.smoke:
        torch.cuda.empty_cache()

    t0 = time.perf_counter()
    layers = parse_stage_layers(a.stage_layers) if a.stage_layers else None
    source = functools.partial(fam.random_artifact, hf, seed=0)  # called with each stage's device
    pipe = PipelineRunner.start("ninfer_qwen35.family:Qwen35Family", source, devices, layers)
    load_pipe = time.perf_counter() - t0
    try:
        pipe.allocate_cache(pages, a.lanes)
        for label, mbt in (("2 stages, whole prefill", 1 << 30), ("2 stages, micro-batched", 256)):
            pipe.microbatch_tokens = mbt
            toks, first, tp, td = run_greedy(pipe, prompts, a.steps, pages_per_lane)
            same = sum(x == y for x, y in zip(toks, ref[0]))
            rows.append((label, tp, td, toks == ref[0] or f"{same}/{a.lanes} lanes",
                         float((first - ref[1]).abs().max())))
    finally:
        pipe.close()

    shape = "tiny (smoke, CPU)" if a.smoke else a.shape
    print(f"pipeline check {shape}: {a.lanes} lanes x {a.prompt} prompt tokens, {a.steps} greedy tokens; "
          f"stages {[len(r) for r in pipe.ranges]}; load 1 GPU {load_whole:.1f} s, 2 stages {load_pipe:.1f} s")
    print(f"{'run':<28} {'prefill ms':>10} {'decode ms/round':>16} {'greedy = 1 GPU':>15} {'max |dlogit|':>13}")
    for label, tp, td, same, diff in rows:
        print(f"{label:<28} {tp * 1e3:>10.1f} {td * 1e3:>16.2f} {same!s:>15} {diff:>13.4g}")
    exact = all(r[3] is True for r in rows[:-1])
    print("PIPELINE", "greedy identical" if exact else "greedy DIFFERS", "(1 GPU eager and 2 stages, whole prefill)")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
