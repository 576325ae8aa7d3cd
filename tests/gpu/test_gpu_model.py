"""The GPU path at the Qwen3.5-9B shape (random bf16 weights made on the device):
- logits against transformers (same tensors, fla + SDPA) through chunked prefill and batched
  decode within bf16 tolerance;
- CUDA-Graph replay equals eager decode;
- greedy outputs of 8 concurrent engine requests equal each request run alone, and the engine
  returns to idle;
- a tiny artifact loaded on CUDA takes the GPU path and matches the CPU fp32 reference.
"""

import asyncio

import pytest
import torch

from ninfer_core.engine.model_api import SeqView

TOL = 2e-2  # ARCHITECTURE.md: bf16 on the GPU to ~1e-2


def rel_err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.fixture(scope="module")
def model9b():
    from ninfer_core.bench.shapes import SHAPES
    from ninfer_qwen35.family import Qwen35Family

    fam = Qwen35Family()
    cfg = SHAPES["qwen3.5-9b"]
    art = fam.random_artifact(cfg, device="cuda", seed=7)
    runner = fam.load(art, device="cuda")
    from ninfer_qwen35.gpu.runner import GpuQwen35Runner

    assert isinstance(runner, GpuQwen35Runner)
    yield fam, cfg, art, runner
    del runner
    torch.cuda.empty_cache()


def _prompt(n, seed):
    return torch.randint(0, 200000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_parity_with_transformers_chunked_prefill_and_batched_decode(model9b):
    fam, cfg, _, runner = model9b
    runner.allocate_cache(64, 4)
    lens, steps = [700, 130, 64], 4
    prompts = [_prompt(n + steps, 30 + i) for i, n in enumerate(lens)]
    seqs = [SeqView(slot=i, pages=list(range(20 * i + 3, 20 * i + 3 + 13)), num_cached=0) for i in range(3)]
    ours = {i: [] for i in range(3)}
    for i, n in enumerate(lens):
        runner.reset_slot(i)
        for c in range(0, n, 256):
            part = prompts[i][c : min(n, c + 256)]
            ours[i].append(runner.prefill(seqs[i], part, all_logits=True))
            seqs[i].num_cached += len(part)
    for s in range(steps):
        logits = runner.decode(seqs, [prompts[i][lens[i] + s] for i in range(3)])
        for i in range(3):
            ours[i].append(logits[i : i + 1])
            seqs[i].num_cached += 1
    hf = fam.transformers_model(runner, cfg)
    worst_pre = worst_dec = 0.0
    with torch.inference_mode():
        for i, n in enumerate(lens):
            ids = torch.tensor([prompts[i]], device="cuda")
            ref = hf(input_ids=ids, use_cache=False).logits[0].float()
            mine = torch.cat(ours[i])
            assert torch.isfinite(mine).all()
            worst_pre = max(worst_pre, rel_err(mine[:n], ref[:n]))
            worst_dec = max(worst_dec, rel_err(mine[n:], ref[n:]))
            agree = (mine.argmax(-1) == ref.argmax(-1)).float().mean().item()
            print(f"lane {i}: argmax agreement with transformers {agree:.3f}")
    del hf
    print(f"PARITY 9B bf16 vs transformers: chunked prefill {worst_pre:.2e}, batched decode {worst_dec:.2e}")
    assert worst_pre <= TOL and worst_dec <= TOL


def test_cuda_graph_replay_equals_eager(model9b):
    _, _, _, runner = model9b
    runner.allocate_cache(64, 8)
    out = {}
    for mode in (True, False):
        runner.configure(cuda_graph=mode)
        seqs = [SeqView(slot=i, pages=list(range(8 * i, 8 * i + 8)), num_cached=0) for i in range(5)]
        for i, s in enumerate(seqs):
            runner.reset_slot(i)
            runner.prefill(s, _prompt(60 + 37 * i, 50 + i))
            s.num_cached = 60 + 37 * i
        rows = []
        for step in range(6):
            width = 5 if step % 2 == 0 else 3  # two widths, two graphs
            part = seqs[:width]
            rows.append(runner.decode(part, [7 + step + i for i in range(width)]))
            for s in part:
                s.num_cached += 1
        out[mode] = rows
    runner.configure(cuda_graph=True)
    errs = [rel_err(a, b) for a, b in zip(out[True], out[False])]
    print(f"graph vs eager decode: worst rel err {max(errs):.2e}")
    assert max(errs) <= 1e-3
    for a, b in zip(out[True], out[False]):
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_engine_8_concurrent_greedy_equals_each_alone(model9b):
    from ninfer_core.config import EngineOptions
    from ninfer_core.engine.api import GenerationRequest, SamplingParams
    from ninfer_core.engine.engine import Engine
    from ninfer_core.tokenizer import Tokenizer

    fam, _, art, runner = model9b
    runner.configure(cuda_graph=True)
    with torch.no_grad():  # spread the logits so bf16 rounding cannot flip a random-weight argmax
        runner.model.lm_head.weight.mul_(8.0)
    tok = Tokenizer.from_section(art.tokenizer_section)
    engine = Engine(runner, tok, EngineOptions(max_context=512, kv_capacity=8 * 512, max_concurrency=8,
                                               prefill_chunk=256, device="cuda"))
    engine.start()
    prompts = [_prompt(40 + 25 * i, 70 + i) for i in range(8)]

    async def gen(ids):
        req = GenerationRequest(prompt_ids=ids, sampling=SamplingParams(greedy=True, temperature=0.0),
                                max_tokens=24, ignore_eos=True, request_id="t")
        got = []
        async for ev in engine.submit(req).events():
            assert ev.kind != "error", ev.error
            got.extend(ev.token_ids)
        return got

    peak = {"lanes": 0}

    async def together():
        async def watch():
            while True:
                peak["lanes"] = max(peak["lanes"], engine.snapshot()["lanes_active"])
                await asyncio.sleep(0.005)

        w = asyncio.ensure_future(watch())
        try:
            return await asyncio.gather(*(gen(p) for p in prompts))
        finally:
            w.cancel()

    try:
        batched = asyncio.run(together())
        alone = [asyncio.run(gen(p)) for p in prompts]
        snap = engine.snapshot()
    finally:
        engine.shutdown()
        with torch.no_grad():
            runner.model.lm_head.weight.div_(8.0)
    same = sum(a == b for a, b in zip(batched, alone))
    print(f"8 concurrent greedy vs alone: {same}/8 identical")
    print(f"peak active lanes while the 8 ran together: {peak['lanes']}")
    assert peak["lanes"] >= 4  # they really shared decode rounds
    assert all(len(b) == 24 for b in batched)
    assert batched == alone
    assert snap["lanes_active"] == 0 and snap["pages_free"] == snap["pages_total"]
    print("engine snapshot after:", {k: snap[k] for k in list(snap)[:8]})


def test_tiny_artifact_on_cuda_takes_gpu_path_and_matches_cpu(tmp_path):
    from ninfer_qwen35.family import Qwen35Family
    from ninfer_qwen35.gpu.runner import GpuQwen35Runner
    from ninfer_qwen35.testing import build_tiny_artifact

    from ninfer_core.artifact import Artifact

    art = Artifact.open(build_tiny_artifact(tmp_path / "t.ninfer", kind="dense", seed=3, num_layers=8))
    cpu = Qwen35Family().load(art)
    bf16 = Qwen35Family().load(art, device="cuda")
    assert isinstance(bf16, GpuQwen35Runner) and bf16.dtype == torch.bfloat16
    del bf16
    # fp32 on CUDA: the same kernels (tf32 dots), compared with the CPU fp32 reference; in bf16 this
    # tiny model's own reference path already moves 0.4 against fp32 on some rows (checked on CPU)
    gpu = Qwen35Family().load(art, device="cuda", dtype="float32")
    outs = []
    for r in (cpu, gpu):
        r.allocate_cache(16, 2)
        s = SeqView(slot=1, pages=[4, 9, 2], num_cached=0)
        toks = _prompt(150, 5)
        toks = [t % 500 for t in toks]
        rows = [r.prefill(s, toks[:100], all_logits=True).cpu()]
        s.num_cached = 100
        rows.append(r.prefill(s, toks[100:140], all_logits=True).cpu())
        s.num_cached = 140
        for i in range(5):
            rows.append(r.decode([s], [toks[140 + i]]).cpu())
            s.num_cached += 1
        outs.append(torch.cat(rows))
    err = rel_err(outs[1], outs[0])
    print(f"tiny artifact: CUDA fp32 GPU path vs CPU fp32 reference {err:.2e}")
    assert err <= 1e-2
