#!/usr/bin/env python3
"""Pipeline stages on two GPUs against one GPU, in one call (issue 26; nvidia-h200-x2).

The Qwen3.5 27B shape with random weights and an MTP head (the same seed on every device: each
stage draws its own layers on its own GPU) runs whole on cuda:0, then split over cuda:0 and cuda:1
as two pipeline stages (NCCL, NVLink multicast off: NCCL_NVLS_ENABLE=0). Plain runs prefill LANES
prompts and decode them together, greedy, through the runner: one GPU with CUDA Graphs and eager,
two stages with whole prefill chunks and whole decode rounds, and with the prefill cut into
micro-batches and every round cut into one lane group per stage (the default). `--spec mtp` runs
go through the engine (MTP_LANES requests at once, K = 3): one GPU, then two stages (the MTP head
on the last). One table: prefill ms, decode ms per round, tokens/s, whether every lane's greedy
tokens equal the one-GPU run of the same kind (eager for plain, one-GPU MTP for MTP) and the
largest logit difference of the first token; the PIPELINE line last.

    python3 scripts/pipeline_check.py [--prompt 512 --steps 32 --lanes 4 --stage-layers 32,32]

`--smoke` runs the same steps on the CPU at a tiny shape (gloo), to check the script itself.
The two-stage MTP run verifies on the stages' reference path (the fast stage path serves plain
prefill and decode), so keep its prompt short (--mtp-prompt).
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
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


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


class _Tok:
    """Token ids only (the engine's detokenizer reads bytes; a random model's text is noise)."""

    eos_token_ids = ()

    def __init__(self, vocab):
        self.vocab_size = vocab

    def token_bytes(self, t):
        return b""

    def is_special(self, t):
        return False

    def decode(self, ids, skip_special=True):
        return ""


def run_mtp(runner, artifact, prompts, steps, k):
    """Greedy requests through the engine with --spec mtp at once; (tokens per request, tok/s, accepted/drafted)."""
    import argparse as ap

    from ninfer_spec_mtp.backend import MtpBackend

    from ninfer_core.config import EngineOptions
    from ninfer_core.engine.api import GenerationRequest, SamplingParams
    from ninfer_core.engine.engine import Engine
    from ninfer_core.testing import collect, run_async

    runner.free_cache()
    backend = MtpBackend.load(runner, artifact, ap.Namespace(draft_tokens=k))
    context = max(len(p) for p in prompts) + steps + 64

    async def go():
        eng = Engine(runner, _Tok(runner.info.vocab_size),
                     EngineOptions(max_context=context, prefill_chunk=512, max_concurrency=len(prompts)), spec=backend)
        eng.start()
        try:
            t0 = time.perf_counter()
            hs = [eng.submit(GenerationRequest(prompt_ids=p, sampling=SamplingParams(temperature=0.0), max_tokens=steps))
                  for p in prompts]
            outs = [(await collect(h)).token_ids for h in hs]
            dt = time.perf_counter() - t0
            c = eng.snapshot()["counters"]
            return outs, sum(map(len, outs)) / dt, (c["draft_accepted_tokens"], c["draft_tokens"])
        finally:
            eng.shutdown(timeout=120)

    return run_async(go(), timeout=1200)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per lane")
    ap.add_argument("--steps", type=int, default=32, help="greedy tokens per lane")
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--mtp-prompt", type=int, default=48, help="prompt tokens per --spec mtp request")
    ap.add_argument("--mtp-steps", type=int, default=16, help="greedy tokens per --spec mtp request")
    ap.add_argument("--mtp-lanes", type=int, default=2)
    ap.add_argument("--no-mtp", action="store_true", help="skip the --spec mtp runs")
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
    mtp = not a.no_mtp
    fam = Qwen35Family()
    gen = torch.Generator().manual_seed(1)
    vocab = min(240000, hf["vocab_size"])
    prompts = [torch.randint(0, vocab, (a.prompt,), generator=gen).tolist() for _ in range(a.lanes)]
    mtp_prompts = [torch.randint(0, vocab, (a.mtp_prompt,), generator=gen).tolist() for _ in range(a.mtp_lanes)]
    pages_per_lane = -(-(a.prompt + a.steps) // 64)
    pages = pages_per_lane * a.lanes
    rows = []  # (label, prefill s, decode s/round, tok/s, greedy same, max |dlogit|)

    def row(label, toks, ref_toks, tp=None, td=None, tps=None, diff=None):
        same = toks == ref_toks or f"{sum(x == y for x, y in zip(toks, ref_toks))}/{len(ref_toks)} lanes"
        rows.append((label, tp, td, tps, same, diff))

    t0 = time.perf_counter()
    whole_art = fam.random_artifact(hf, device=devices[0], seed=0, mtp=mtp)
    whole = fam.load(whole_art, devices[0])
    whole.allocate_cache(pages, a.lanes)
    load_whole = time.perf_counter() - t0
    ref = None
    for graphs in ((False, True) if not a.smoke else (False,)):
        if not a.smoke:
            whole.configure(cuda_graph=graphs)
        toks, first, tp, td = run_greedy(whole, prompts, a.steps, pages_per_lane)
        if ref is None:
            ref = (toks, first)
        row(f"1 GPU plain ({'graphs' if graphs else 'eager'})", toks, ref[0], tp, td,
            a.lanes / td, float((first - ref[1]).abs().max()))
    mtp_ref = None
    if mtp:
        toks, tps, (acc, drafted) = run_mtp(whole, whole_art, mtp_prompts, a.mtp_steps, 3)
        mtp_ref = toks
        row(f"1 GPU --spec mtp ({acc}/{drafted} acc)", toks, mtp_ref, tps=tps)
    del whole
    if not a.smoke:
        torch.cuda.empty_cache()

    t0 = time.perf_counter()
    layers = parse_stage_layers(a.stage_layers) if a.stage_layers else None
    source = functools.partial(fam.random_artifact, hf, seed=0, mtp=mtp)  # called with each stage's device
    pipe = PipelineRunner.start("ninfer_qwen35.family:Qwen35Family", source, devices, layers)
    load_pipe = time.perf_counter() - t0
    try:
        pipe.allocate_cache(pages, a.lanes)
        for label, mbt, groups in (("2 stages, whole", 1 << 30, 1), ("2 stages, micro-batched", 256, 2)):
            pipe.microbatch_tokens, pipe.round_groups = mbt, groups
            toks, first, tp, td = run_greedy(pipe, prompts, a.steps, pages_per_lane)
            row(label, toks, ref[0], tp, td, a.lanes / td, float((first - ref[1]).abs().max()))
        overlap = pipe.counters()["pipeline"]
        if mtp:
            toks, tps, (acc, drafted) = run_mtp(pipe, source(devices[0]), mtp_prompts, a.mtp_steps, 3)
            row(f"2 stages --spec mtp ({acc}/{drafted} acc)", toks, mtp_ref, tps=tps)
    finally:
        pipe.close()

    shape = "tiny (smoke, CPU)" if a.smoke else a.shape
    print(f"pipeline check {shape}: {a.lanes} lanes x {a.prompt} prompt tokens, {a.steps} greedy tokens"
          + (f"; --spec mtp K=3: {a.mtp_lanes} requests x {a.mtp_prompt} prompt, {a.mtp_steps} tokens" if mtp else "")
          + f"; stages {[len(r) for r in pipe.ranges]}; load 1 GPU {load_whole:.1f} s, 2 stages {load_pipe:.1f} s; "
          f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")

    def fmt(x, scale=1e3, spec=".1f"):
        return "-" if x is None else format(x * scale, spec)

    print(f"{'run':<36} {'prefill ms':>10} {'decode ms/round':>16} {'tok/s':>9} {'greedy same':>12} {'max |dlogit|':>13}")
    for label, tp, td, tps, same, diff in rows:
        print(f"{label:<36} {fmt(tp):>10} {fmt(td, spec='.2f'):>16} {fmt(tps, 1):>9} {same!s:>12} "
              f"{fmt(diff, 1, '.4g'):>13}")
    print(f"micro-batched run's stages: {overlap['cut_rounds']} rounds cut into lane groups, "
          f"{overlap['overlapped_pieces']} pieces overlapped, {overlap['overlap_seconds']:.3f} s with both stages "
          "busy (host spans)")
    plain_ok = all(r[4] is True for r in rows if "plain (eager)" in r[0] or r[0].startswith("2 stages,"))
    mtp_ok = all(r[4] is True for r in rows if "mtp" in r[0])
    print("PIPELINE", "greedy identical" if plain_ok else "greedy DIFFERS",
          "(1 GPU eager and 2 stages, whole and micro-batched)",
          "; --spec mtp " + ("identical" if mtp_ok else "DIFFERS (bf16: the stages verify on the reference path)")
          if mtp else "")
    return 0 if plain_ok else 1


if __name__ == "__main__":
    sys.exit(main())
