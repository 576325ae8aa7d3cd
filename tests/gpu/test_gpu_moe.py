"""The MoE decode path on CUDA at the Qwen3.5-35B-A3B layer shape (4 layers, random bf16 weights):
the gathered-expert round equals the reference expert loop, and CUDA-Graph replay (now used for
MoE models too) equals eager decode."""

import pytest
import torch

from ninfer_core.engine.model_api import SeqView


def rel(a, b):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def moe():
    from ninfer_qwen35.family import Qwen35Family

    from ninfer_core.bench.shapes import SHAPES

    cfg = dict(SHAPES["qwen3.5-35b-a3b"])
    cfg["num_hidden_layers"] = 4
    cfg["layer_types"] = cfg["layer_types"][:4]
    fam = Qwen35Family()
    runner = fam.load(fam.random_artifact(cfg, device="cuda", seed=3), device="cuda")
    yield runner
    del runner
    torch.cuda.empty_cache()


def test_gathered_experts_equal_the_expert_loop(moe):
    mlp = moe.model.layers[0].mlp
    g = torch.Generator(device="cuda").manual_seed(5)
    for n in (1, 3, 8):
        h = torch.randn(n, moe.cfg.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
        with torch.inference_mode():
            err = rel(moe._moe_few_tokens(mlp, h), mlp(h))
        print(f"MoE gathered experts vs loop, {n} tokens: rel err {err:.2e}")
        assert err < 1e-2


def test_moe_graph_replay_equals_eager(moe):
    moe.allocate_cache(64, 8)
    out = {}
    for mode in (True, False):
        moe.configure(cuda_graph=mode)
        seqs = [SeqView(slot=i, pages=list(range(8 * i, 8 * i + 8)), num_cached=0) for i in range(3)]
        for i, s in enumerate(seqs):
            moe.reset_slot(i)
            toks = torch.randint(0, 200000, (40 + 9 * i,), generator=torch.Generator().manual_seed(i)).tolist()
            moe.prefill(s, toks)
            s.num_cached = len(toks)
        rows = []
        for step in range(4):
            rows.append(moe.decode(seqs, [11 + step + i for i in range(3)]))
            for s in seqs:
                s.num_cached += 1
        out[mode] = rows
    moe.configure(cuda_graph=True)
    errs = [rel(a, b) for a, b in zip(out[True], out[False])]
    print(f"MoE graph vs eager decode: worst rel err {max(errs):.2e}")
    assert max(errs) <= 1e-3
