"""Kernels against their torch references at the real Qwen3.5 shapes, bf16 on CUDA, random
inputs (never zeros), outputs poisoned before each run (shared cases with the CPU interpreter
tests), and the in-place GDN decode cross-checked against fla's fused recurrent kernel."""

import pytest
import torch

cases = pytest.importorskip("gpu_kernel_cases")


def test_paged_decode_attention_9b_and_27b_heads():
    cases.decode_attention("cuda", heads=16, kvh=4, d=256, lens=(1, 63, 64, 65, 700, 1500, 3000, 129))
    cases.decode_attention("cuda", heads=24, kvh=4, d=256, lens=(5, 1000, 64, 3001))


def test_paged_prefill_attention_real_heads():
    cases.prefill_attention("cuda", heads=16, kvh=4, d=256)
    cases.prefill_attention("cuda", heads=24, kvh=4, d=256)


def test_gdn_decode_inplace_real_heads():
    cases.gdn_decode("cuda", hk=16, hv=32, dk=128, dv=128, batch=3, tol=1e-4)
    cases.gdn_decode("cuda", hk=16, hv=48, dk=128, dv=128, batch=3, tol=1e-4)


def test_gdn_prefill_recurrent_real_heads():
    cases.gdn_prefill_recurrent("cuda", hk=16, hv=32, dk=128, dv=128)
    cases.gdn_prefill_recurrent("cuda", hk=16, hv=48, dk=128, dv=128)


def test_gdn_decode_matches_fla_fused_recurrent():
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    from ninfer_core.accel import kernels as K

    g = torch.Generator(device="cuda").manual_seed(11)
    b, hk, hv, dk, dv = 4, 16, 32, 128, 128
    mixed = torch.randn(b, 2 * hk * dk + hv * dv, generator=g, device="cuda").bfloat16()
    a_raw = torch.randn(b, hv, generator=g, device="cuda").bfloat16()
    b_raw = torch.randn(b, hv, generator=g, device="cuda").bfloat16()
    A_log = torch.rand(hv, generator=g, device="cuda") * 2
    dt_bias = torch.randn(hv, generator=g, device="cuda")
    state = torch.randn(6, hv, dk, dv, generator=g, device="cuda")
    slots = torch.tensor([5, 1, 3, 0], device="cuda")
    init = state[slots].clone()
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    gg = -A_log.exp() * torch.nn.functional.softplus(a_raw.float() + dt_bias)
    o_ref, s_ref = fla.fused_recurrent_gated_delta_rule(
        q.reshape(b, 1, hk, dk).contiguous(), k.reshape(b, 1, hk, dk).contiguous(),
        v.reshape(b, 1, hv, dv).contiguous(), g=gg[:, None].contiguous(),
        beta=torch.sigmoid(b_raw.float())[:, None].bfloat16().contiguous(), scale=dk**-0.5,
        initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out = K.gdn_decode_inplace(mixed, a_raw, b_raw, A_log, dt_bias, state, slots, hk, dk, dv, dk**-0.5)
    e_o = cases.rel(out, o_ref[:, 0])
    e_s = cases.rel(state[slots], s_ref)
    print(f"in-place GDN decode vs fla fused_recurrent: out {e_o:.2e}, state {e_s:.2e}")
    assert e_o < 2e-2 and e_s < 2e-2


def test_fla_prefill_matches_reference_with_initial_state():
    from ninfer_qwen35.config import Qwen35Config
    from ninfer_core.nn.gdn import GatedDeltaNet
    from ninfer_core.accel import fla_glue
    from ninfer_qwen35.gpu.random_model import RandomArtifact  # noqa: F401 (import check)

    if fla_glue.fla_chunk() is None:
        pytest.skip("fla not installed")
    from ninfer_core.bench.shapes import SHAPES

    cfg = Qwen35Config.from_hf(SHAPES["qwen3.5-9b"])
    mod = GatedDeltaNet(cfg, 0)
    g = torch.Generator(device="cuda").manual_seed(12)
    mod.A_log.data = (torch.rand(mod.hv, generator=g, device="cuda") * 2)
    mod.dt_bias.data = torch.randn(mod.hv, generator=g, device="cuda")
    t = 300
    conv_out = torch.randn(t, mod.conv_dim, generator=g, device="cuda").bfloat16()
    a_raw = torch.randn(t, mod.hv, generator=g, device="cuda").bfloat16()
    b_raw = torch.randn(t, mod.hv, generator=g, device="cuda").bfloat16()
    ssm = torch.randn(3, mod.hv, mod.dk, mod.dv, generator=g, device="cuda") * 0.1
    ssm_ref = ssm.clone()
    out = fla_glue.gdn_prefill(mod, conv_out, a_raw, b_raw, ssm, 2)
    # reference: the plugin's torch chunk rule in fp32
    from ninfer_core.nn import gdn as ref

    q, k, v = mod._qkv_heads(conv_out)
    gg, beta = fla_glue.gdn_gates(a_raw, b_raw, mod.A_log, mod.dt_bias)
    o_ref, s_ref = ref.chunk_gated_delta_rule(q, k, v, gg, torch.sigmoid(b_raw).float(), ssm_ref[2])
    e_o, e_s = cases.rel(out, o_ref), cases.rel(ssm[2], s_ref)
    print(f"fla chunk prefill vs reference: out {e_o:.2e}, final state {e_s:.2e}")
    assert e_o < 2e-2 and e_s < 2e-2
    assert torch.equal(ssm[0], ssm_ref[0]) and torch.equal(ssm[1], ssm_ref[1])


def test_fused_elementwise_and_glue_kernels_bf16():
    cases.fused_elementwise("cuda", rows=9, hidden=5120)
    cases.conv_and_qk("cuda")


def test_fla_prefill_graphs_match_eager():
    """GdnPrefillGraphs (one CUDA Graph per bucket, chunk padded at its end) against the eager fla
    call, over chunks that reuse a bucket with a stale longer tail, on the 27B GDN geometry."""
    from ninfer_qwen35.config import Qwen35Config
    from ninfer_core.nn.gdn import GatedDeltaNet
    from ninfer_core.accel import fla_glue

    if fla_glue.fla_chunk() is None:
        pytest.skip("fla not installed")
    from ninfer_core.bench.shapes import SHAPES

    cfg = Qwen35Config.from_hf(SHAPES["qwen3.5-27b"])
    g = torch.Generator(device="cuda").manual_seed(5)
    mods = []
    for i in range(2):  # two layers share each bucket's graph
        mod = GatedDeltaNet(cfg, i)
        mod.A_log.data = torch.rand(mod.hv, generator=g, device="cuda") * 2
        mod.dt_bias.data = torch.randn(mod.hv, generator=g, device="cuda")
        mods.append(mod)
    graphs = fla_glue.GdnPrefillGraphs()
    ssm = torch.randn(3, mods[0].hv, mods[0].dk, mods[0].dv, generator=g, device="cuda") * 0.1
    ssm_ref = ssm.clone()
    worst = 0.0
    for t, li in ((300, 0), (290, 1), (70, 0), (127, 1), (513, 0), (1024, 1)):
        mod = mods[li]
        conv_out = torch.randn(t, mod.conv_dim, generator=g, device="cuda").bfloat16()
        a_raw = torch.randn(t, mod.hv, generator=g, device="cuda").bfloat16()
        b_raw = torch.randn(t, mod.hv, generator=g, device="cuda").bfloat16()
        out = graphs.run(mod, conv_out, a_raw, b_raw, ssm, 1)
        ref = fla_glue.gdn_prefill(mod, conv_out, a_raw, b_raw, ssm_ref, 1)
        assert out is not None and out.shape == ref.shape
        worst = max(worst, cases.rel(out, ref), cases.rel(ssm[1], ssm_ref[1]))
    print(f"fla prefill graphs vs eager: worst rel err {worst:.2e} over 6 chunks, {len(graphs)} graphs")
    assert worst < 5e-3
    assert len(graphs) == 4  # buckets 384, 128, 768, 1024
    assert torch.equal(ssm[0], ssm_ref[0]) and torch.equal(ssm[2], ssm_ref[2])
    assert graphs.run(mods[0], conv_out[:1].expand(1100, -1).contiguous(), a_raw[:1].expand(1100, -1),
                      b_raw[:1].expand(1100, -1), ssm, 1) is None  # past the largest bucket: eager


def test_attention_decode_fused_9b_and_27b_heads():
    cases.attn_decode_fused("cuda", heads=16, kvh=4, d=256, rot=64, lens=(1, 63, 64, 65, 700, 1500, 3000, 129))
    cases.attn_decode_fused("cuda", heads=24, kvh=4, d=256, rot=64, lens=(5, 1000, 64, 3001))


def test_runner_fused_decode_equals_unfused_chain_in_cuda_graphs():
    """GpuQwen35Runner at the 9B layer geometry (4 layers: 3 GDN + 1 attention), 3 lanes, decode
    rounds replayed from CUDA Graphs with decode_fusion on against the unfused kernel chain."""
    from ninfer_qwen35.family import Qwen35Family

    from ninfer_core.bench.shapes import SHAPES
    from ninfer_core.engine.model_api import SeqView

    cfg = dict(SHAPES["qwen3.5-9b"], num_hidden_layers=4)
    cfg["layer_types"] = cfg["layer_types"][:4]
    fam = Qwen35Family()
    runner = fam.load(fam.random_artifact(cfg, device="cuda", seed=3), device="cuda")
    runner.allocate_cache(32, 3)
    gen = torch.Generator().manual_seed(4)
    lens, steps = (70, 130, 5), 4
    prompts = [torch.randint(0, 200000, (n + steps,), generator=gen).tolist() for n in lens]
    runs = {}
    for fusion in (False, True):
        runner.decode_fusion = fusion
        runner._drop_graphs()
        seqs = [SeqView(slot=i, pages=[3 + 10 * i + j for j in range(4)], num_cached=0) for i in range(3)]
        for i, n in enumerate(lens):
            runner.reset_slot(i)
            runner.prefill(seqs[i], prompts[i][:n])
            seqs[i].num_cached = n
        rows = []
        for s in range(steps):
            rows.append(runner.decode(seqs, [prompts[i][lens[i] + s] for i in range(3)]).float())
            for sq in seqs:
                sq.num_cached += 1
        runs[fusion] = torch.stack(rows)
    assert runner.graphs_enabled and len(runner._graphs) == 1
    err = cases.rel(runs[True], runs[False])
    worst = float((runs[True] - runs[False]).abs().max() / runs[False].abs().max())
    print(f"runner decode, fused vs unfused chain (CUDA graphs, 3 lanes x {steps} steps): rel {err:.2e}, "
          f"max abs / max {worst:.2e}")
    assert err < 1e-2 and worst < 2e-2
