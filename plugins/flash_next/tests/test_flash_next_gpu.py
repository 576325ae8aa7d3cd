"""Flash-Next on CUDA (skipped without it): the runner in bf16 (GDN kernels, grouped-GEMM MoE)
against transformers at the real widths (the first 4 layers: 3 GDN with the PLE layer, one indexed
attention layer; 512 experts; a prompt past the indexer's dense threshold of 2051 keys), within
1e-2 of the fp32 truth or no further from it than transformers' own bf16 model; host-resident
experts through the device cache give the device-resident logits. scripts/gpu_check.py runs this
module (`--order flash_next`); each check prints one PARITY line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = 1e-2


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.fixture(scope="module")
def setup():
    from ninfer_flash_next.family import FlashNextFamily
    from ninfer_flash_next.shapes import bench_config

    cfg = bench_config(4)
    fam = FlashNextFamily()
    art = fam.random_artifact(cfg, device="cuda", seed=3)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 240000, (2200,), generator=g).tolist()
    return fam, cfg, art, toks


def test_bf16_parity_with_transformers_at_real_widths(setup):
    from ninfer_core.engine.model_api import SeqView

    fam, cfg, art, toks = setup
    r = fam.load(art, device="cuda")
    r.allocate_cache(40, 1)
    ours = r.prefill(SeqView(0, list(range(36)), 0), toks, all_logits=True)
    hf = fam.transformers_model(r, cfg)
    with torch.no_grad():
        hf_bf16 = hf(torch.tensor([toks], device="cuda")).logits[0].float()
        hf.float()  # the truth: the same weights in fp32 (a copy; the runner keeps its bf16 tensors)
        truth = hf(torch.tensor([toks], device="cuda")).logits[0]
    e_ours, e_hf = rel(ours, truth), rel(hf_bf16, truth)
    dense, sparse = rel(ours[:2051], truth[:2051]), rel(ours[2051:], truth[2051:])
    print(f"PARITY flash-next bf16 vs fp32 truth: ours {e_ours:.2e} (dense part {dense:.2e}, sparse part "
          f"{sparse:.2e}), transformers bf16 {e_hf:.2e}")
    assert e_ours <= max(TOL, 1.5 * e_hf)


def test_host_experts_give_the_device_logits(setup):
    from ninfer_core.engine.model_api import SeqView

    fam, _cfg, art, toks = setup
    outs = []
    for opts in (None, SimpleNamespace(expert_residency="host", expert_cache_mib=2048)):
        r = fam.load(art, device="cuda", options=opts)
        r.allocate_cache(8, 1)
        seq = SeqView(0, list(range(6)), 0)
        rows = [r.prefill(seq, toks[:200], all_logits=True)]
        seq.num_cached = 200
        for t in toks[200:208]:
            rows.append(r.decode([seq], [t]))
            seq.num_cached += 1
        outs.append(torch.cat(rows))
        if opts is not None:
            ex = r.counters()["experts"]
            print(f"PARITY flash-next host experts: {ex['slots']} slots, {ex['hits']}/{ex['routes']} hits, "
                  f"{ex['transferred_bytes'] / 1e9:.2f} GB moved, rel err vs device {rel(outs[1], outs[0]):.2e}")
        del r
        torch.cuda.empty_cache()
    assert rel(outs[1], outs[0]) <= TOL
