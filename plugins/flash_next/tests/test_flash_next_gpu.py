"""Flash-Next on CUDA (skipped without it), sized to run in about 90 s on the H200: the runner in
bf16 (GDN kernels, the indexed attention's Triton kernels, grouped-GEMM MoE) against transformers at
the real widths in two layers (shapes.parity_config: the PLE layer's GDN, one indexed attention
layer; 512 experts of width 640) on a prompt of 2112 tokens, past the indexer's dense threshold of
2051 keys (61 sparse queries), within 1e-2 of the fp32 truth or no further from it than
transformers' own bf16 model; host-resident experts through the device cache give the
device-resident logits and greedy tokens. scripts/gpu_check.py runs this module
(`--order flash_next`); each check prints one PARITY line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = 1e-2
PROMPT = 2112
DENSE = 2051  # budget 2048 + ratio 4 - 1: queries up to here keep every key


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.fixture(scope="module")
def setup():
    from ninfer_flash_next.family import FlashNextFamily
    from ninfer_flash_next.shapes import parity_config

    from ninfer_core.engine.model_api import SeqView

    cfg = parity_config()
    fam = FlashNextFamily()
    art = fam.random_artifact(cfg, device="cuda", seed=3)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 240000, (PROMPT,), generator=g).tolist()
    r = fam.load(art, device="cuda")
    r.allocate_cache(40, 1)
    ours = r.prefill(SeqView(0, list(range(36)), 0), toks, all_logits=True)
    yield fam, cfg, art, toks, r, ours
    del r
    torch.cuda.empty_cache()


def _decode_rows(r, toks):
    from ninfer_core.engine.model_api import SeqView

    r.reset_slot(0)
    seq = SeqView(0, list(range(6)), 0)
    rows = [r.prefill(seq, toks[:200], all_logits=True)]
    seq.num_cached = 200
    for t in toks[200:208]:
        rows.append(r.decode([seq], [t]))
        seq.num_cached += 1
    return torch.cat(rows)


def test_bf16_parity_with_transformers_at_real_widths(setup):
    fam, cfg, _art, toks, r, ours = setup
    hf = fam.transformers_model(r, cfg)
    with torch.no_grad():
        ids = torch.tensor([toks], device="cuda")
        hf_bf16 = hf(ids).logits[0].float()
        hf.float()  # the truth: the same weights in fp32 (transformers' copies; the runner keeps bf16)
        truth = hf(ids).logits[0]
    del hf
    torch.cuda.empty_cache()
    assert r.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    e_ours, e_hf, e_pair = rel(ours, truth), rel(hf_bf16, truth), rel(ours, hf_bf16)
    dense, sparse = rel(ours[:DENSE], truth[:DENSE]), rel(ours[DENSE:], truth[DENSE:])
    print(f"PARITY flash-next bf16 vs fp32 truth ({PROMPT} tokens, 2 layers): ours {e_ours:.2e} (dense part "
          f"{dense:.2e}, sparse part {sparse:.2e}), transformers bf16 {e_hf:.2e}; ours vs transformers bf16 "
          f"{e_pair:.2e}")
    assert e_ours <= max(TOL, 1.5 * e_hf)
    assert sparse <= max(TOL, 1.5 * rel(hf_bf16[DENSE:], truth[DENSE:]))


def test_host_experts_give_the_device_logits(setup):
    fam, _cfg, art, toks, r, _ours = setup
    want = _decode_rows(r, toks)
    h = fam.load(art, device="cuda", options=SimpleNamespace(expert_residency="host", expert_cache_mib=2048))
    h.allocate_cache(8, 1)
    got = _decode_rows(h, toks)
    ex = h.counters()["experts"]
    err = rel(got, want)
    same = bool((got.argmax(-1) == want.argmax(-1)).all())
    print(f"PARITY flash-next host experts: {ex['slots']} slots, {ex['hits']}/{ex['routes']} hits, "
          f"{ex['transferred_bytes'] / 1e9:.2f} GB moved, rel err vs device {err:.2e}, greedy equal {same}")
    del h
    torch.cuda.empty_cache()
    assert err <= TOL and same
