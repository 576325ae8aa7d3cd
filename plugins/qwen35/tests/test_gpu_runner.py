"""The GPU runner's fast path (fused projections, flat prefill/decode bodies, packed decode
metadata, scratch page/slot) against the reference runner, on the CPU in fp32.

On the CPU the kernels fall back to their torch references (tests/test_gpu_kernels.py checks the
Triton kernels against those under the interpreter; tests/gpu/ runs everything on CUDA).
"""

import pytest
import torch
from ninfer_qwen35.family import Qwen35Family
from ninfer_qwen35.gpu.runner import GpuQwen35Runner
from qwen35_hf_reference import rel_err

from ninfer_core.engine.model_api import SeqView

TOL = 1e-4


def prompt(n, seed=0, vocab=500):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def both(art):
    ref = Qwen35Family().load(art)
    fast = GpuQwen35Runner.from_runner(Qwen35Family().load(art))
    for r in (ref, fast):
        r.allocate_cache(32, 4)
    return ref, fast


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fast_path_matches_reference_chunked_prefill_and_batched_decode(loaded, kind):
    art, _ = loaded[kind]
    ref, fast = both(art)
    lens, steps = [5, 70, 131], 5
    prompts = [prompt(n + steps, seed=20 + i) for i, n in enumerate(lens)]
    pages = [[2, 25], [6, 1, 26], [9, 3, 14, 27]]
    out = {}
    for name, r in (("ref", ref), ("fast", fast)):
        seqs, rows = [], []
        for i, n in enumerate(lens):
            s = SeqView(slot=i + 1, pages=pages[i], num_cached=0)
            for c in range(0, n, 48):  # chunked prefill over cached prefixes
                chunk = prompts[i][c : min(n, c + 48)]
                rows.append(r.prefill(s, chunk, all_logits=True))
                s.num_cached += len(chunk)
            seqs.append(s)
        for st in range(steps):
            rows.append(r.decode(seqs, [prompts[i][lens[i] + st] for i in range(3)]))
            for s in seqs:
                s.num_cached += 1
        out[name] = torch.cat(rows)
    assert out["fast"].dtype == torch.float32 and out["fast"].shape == out["ref"].shape
    err = rel_err(out["fast"], out["ref"])
    print(f"GPU-path vs reference ({kind}): {err:.2e}")
    assert err <= TOL


def test_fusion_shares_storage_and_keeps_reference_modules(loaded):
    art, _ = loaded["dense"]
    r = GpuQwen35Runner.from_runner(Qwen35Family().load(art))
    gdn = r.model.layers[0].linear_attn
    w = r.fused[0].w_in
    assert gdn.in_proj_qkv.weight.data_ptr() == w.data_ptr()
    assert gdn.in_proj_a.weight.data_ptr() == w[-gdn.hv :].data_ptr()
    attn_i = r.cfg.full_attention_layers[0]
    attn = r.model.layers[attn_i].self_attn
    assert attn.v_proj.weight.data_ptr() == r.fused[attn_i].w_qkv[-attn.v_proj.weight.shape[0] :].data_ptr()
    mlp = r.model.layers[0].mlp
    assert mlp.up_proj.weight.data_ptr() == r.fused[0].w_gu[mlp.gate_proj.weight.shape[0] :].data_ptr()


def test_scratch_page_and_slot_are_outside_the_engine_pool(loaded):
    art, _ = loaded["dense"]
    r = GpuQwen35Runner.from_runner(Qwen35Family().load(art))
    r.allocate_cache(8, 2)
    assert (r.num_pages, r.num_slots) == (8, 2)
    assert r.scratch_page == 8 and r.scratch_slot == 2
    k, _ = next(iter(r.cache.kv.values()))
    assert k.shape[0] == 9
    with pytest.raises(ValueError, match="outside"):
        r.decode([SeqView(slot=2, pages=[0], num_cached=0)], [1])
    with pytest.raises(ValueError, match="outside"):
        r.decode([SeqView(slot=0, pages=[8], num_cached=0)], [1])
    with pytest.raises(ValueError, match="same state slot"):
        r.decode([SeqView(slot=0, pages=[0], num_cached=0), SeqView(slot=0, pages=[1], num_cached=0)], [1, 2])
    with pytest.raises(ValueError, match="vocabulary"):
        r.decode([SeqView(slot=0, pages=[0], num_cached=0)], [10**6])


def test_configure_turns_graphs_off_and_cpu_never_uses_them(loaded):
    art, _ = loaded["dense"]
    r = GpuQwen35Runner.from_runner(Qwen35Family().load(art))
    assert not r.graphs_enabled  # CPU
    r.configure(cuda_graph=False)
    assert r.cuda_graph is False


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_random_artifact_and_transformers_model_share_the_runner_tensors(kind):
    """The bench's building blocks: random weights through the family loader, and a transformers
    model re-pointed at the same tensors (same logits, same storage)."""
    from ninfer_qwen35.testing import tiny_text_config

    cfg = tiny_text_config(kind=kind)
    fam = Qwen35Family()
    art = fam.random_artifact(cfg, device="cpu", seed=3)
    assert art.tensor_names() and all(art.get_tensor(n).abs().sum() > 0 for n in art.tensor_names()[:20])
    r = fam.load(art, device="cpu")
    fast = GpuQwen35Runner.from_runner(r)
    hf = fam.transformers_model(fast, cfg)
    assert hf.model.layers[0].linear_attn.in_proj_qkv.weight.data_ptr() == fast.fused[0].w_in.data_ptr()
    assert hf.lm_head.weight.data_ptr() == fast.model.lm_head.weight.data_ptr()
    ids = torch.randint(0, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=ids, use_cache=False).logits[0].float()
    fast.allocate_cache(8, 2)
    out = fast.prefill(SeqView(slot=0, pages=[3, 1], num_cached=0), ids[0].tolist(), all_logits=True)
    assert rel_err(out, ref) <= TOL


@pytest.mark.parametrize("at", [1, 2, 37, 69])
def test_prefill_with_snapshot_in_one_forward_equals_the_split_forwards(loaded, at):
    """GpuQwen35Runner.prefill_with_snapshot (one forward, each GDN layer split at `at`) leaves
    the same state in the snapshot slot and the lane, the same KV and the same logits as the
    ModelRunner default (two prefills around copy_slot)."""
    art, _ = loaded["dense"]
    ref, fast = both(art)
    toks = prompt(70 + 40, seed=5)
    res = {}
    for name, r in (("split", ref), ("fused", fast)):
        s = SeqView(slot=1, pages=[4, 7], num_cached=0)
        r.prefill(s, toks[:40])
        s.num_cached = 40
        logits = r.prefill_with_snapshot(s, toks[40:], at, 3)  # reference runner: the split default
        res[name] = (logits, {k: [t[1].clone(), t[3].clone()] for k, t in (
            *(("conv%d" % i, c) for i, c in r.cache.conv.items()), *(("ssm%d" % i, c) for i, c in r.cache.ssm.items()))},
            {i: (k[[4, 7]].clone(), v[[4, 7]].clone()) for i, (k, v) in r.cache.kv.items()})
    (l1, st1, kv1), (l2, st2, kv2) = res["split"], res["fused"]
    assert rel_err(l2, l1) <= TOL
    for key in st1:
        for a, b in zip(st1[key], st2[key]):
            assert rel_err(b, a) <= TOL, key
    for i in kv1:
        for a, b in zip(kv1[i], kv2[i]):
            assert rel_err(b, a) <= TOL
    # the snapshot is the state after 40 + at tokens: a fresh lane prefilled that far has it
    s = SeqView(slot=2, pages=[9, 10], num_cached=0)
    fast.prefill(s, toks[: 40 + at])
    for i, c in fast.cache.ssm.items():
        assert rel_err(c[3], c[2]) <= TOL
    with pytest.raises(ValueError):
        fast.prefill_with_snapshot(SeqView(slot=1, pages=[4, 7], num_cached=0), toks[:10], 10, 3)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_resume_warmup_at_allocation_leaves_no_trace(loaded, kind):
    """The allocation-time run of a resumed turn's forwards (pages 0.., the scratch slot, a capture
    into slot 0) leaves both slots zeroed, and a request then served on those pages and slot 0
    gets the reference runner's logits."""
    art, _ = loaded[kind]
    ref, fast = both(art)
    fast._warm_prefill(force=True)
    assert set(fast.info.extra["warmup_ms"]) == {"short", "short_after", "chunk_aligned", "chunk_unaligned",
                                                 "capture_in_chunk", "tail"}
    for t in (*fast.cache.conv.values(), *fast.cache.ssm.values()):
        assert not t[0].any() and not t[fast.scratch_slot].any()
    toks = prompt(131, seed=8)
    rows = {}
    for name, r in (("ref", ref), ("fast", fast)):
        s = SeqView(slot=0, pages=[0, 1, 2], num_cached=0)
        first = r.prefill(s, toks[:130], all_logits=True)
        s.num_cached = 130
        rows[name] = torch.cat([first, r.decode([s], [toks[130]])])
    assert rel_err(rows["fast"], rows["ref"]) <= TOL
