"""The MoE paths on CUDA at the Qwen3.5-35B-A3B layer shape (4 layers, random bf16 weights): the
decode kernels (gpu/moe_kernels.py) against the gathered-expert reference and the expert loop, the
grouped-GEMM prefill path (torch._grouped_mm over expert-sorted pairs) against the expert loop,
neither synchronising with the host, and CUDA-Graph replay equal to eager decode."""

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


def _loop_block(mlp, h, route=None):
    """The MoE block through the reference expert loop (with the given routing, else the Router's)."""
    top_w, top_i = route if route is not None else mlp.gate(h)
    routed = mlp.experts.forward_loop(h, top_w, top_i)
    return routed + torch.sigmoid(mlp.shared_expert_gate(h)) * mlp.shared_expert(h)


def test_moe_decode_kernels_real_shape():
    cases = pytest.importorskip("gpu_kernel_cases")
    cases.moe_decode("cuda", e=256, hidden=2048, inter=512, k=8, ns=(1, 2, 3, 8))
    cases.moe_route("cuda", e=256, k=8, ns=(1, 3, 8, 64))


def test_decode_experts_equal_the_expert_loop(moe):
    from ninfer_core.accel import moe_kernels as MK

    mlp = moe.model.layers[0].mlp
    g = torch.Generator(device="cuda").manual_seed(5)
    for n in (1, 3, 8):
        h = torch.randn(n, moe.cfg.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
        with torch.inference_mode():
            out = moe._moe_few_tokens(mlp, h)
            # the same routing as the kernel's (torch.topk may order equal bf16 logits otherwise)
            top_w, top_i = MK.route_topk(torch.nn.functional.linear(h, mlp.gate.weight), mlp.gate.top_k,
                                         mlp.gate.normalize)
            err = rel(out, _loop_block(mlp, h, (top_w, top_i)))
            se = mlp.shared_expert
            ref = MK.ref_moe_decode(h, top_w, top_i, mlp.experts.gate_up_proj, mlp.experts.down_proj,
                                    (se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight,
                                     mlp.shared_expert_gate.weight))
            err_ref = rel(out, ref)
        print(f"MoE decode kernels, {n} tokens: rel err vs loop {err:.2e}, vs gathered reference {err_ref:.2e}")
        assert err < 1e-2 and err_ref < 5e-3


def test_grouped_mm_experts_equal_the_expert_loop(moe):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm (the expert loop runs)")
    from ninfer_core.accel import moe_kernels as MK

    cases = pytest.importorskip("gpu_kernel_cases")
    cases.moe_grouped("cuda", e=256, hidden=2048, inter=512, k=8, n=1000, gmm=torch._grouped_mm)
    mlp = moe.model.layers[0].mlp
    g = torch.Generator(device="cuda").manual_seed(6)
    for n in (9, 300, 4096):
        h = torch.randn(n, moe.cfg.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
        with torch.inference_mode():
            top_w, top_i = mlp.gate(h)
            grouped = MK.grouped_experts(h, top_w, top_i, mlp.experts.gate_up_proj, mlp.experts.down_proj)
            assert grouped is not None, f"torch._grouped_mm refused the input: {MK._GMM_REFUSED}"
            err = rel(grouped, mlp.experts.forward_loop(h, top_w, top_i))
            err_block = rel(mlp(h), _loop_block(mlp, h))
        print(f"MoE grouped_mm vs loop, {n} tokens: experts {err:.2e}, block {err_block:.2e}")
        assert err < 1e-2 and err_block < 1e-2


def test_moe_paths_do_not_synchronise(moe):
    """Neither the decode kernels nor the grouped prefill path read anything back to the host."""
    from ninfer_core.accel import moe_kernels as MK

    mlp = moe.model.layers[1].mlp
    g = torch.Generator(device="cuda").manual_seed(8)
    hs = {n: torch.randn(n, moe.cfg.hidden_size, generator=g, device="cuda").to(torch.bfloat16) for n in (4, 512)}
    with torch.inference_mode():
        top_w, top_i = mlp.gate(hs[512])
        warm = [moe._moe_few_tokens(mlp, hs[4]), MK.grouped_experts(hs[512], top_w, top_i,
                mlp.experts.gate_up_proj, mlp.experts.down_proj)]  # compile/warm outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            moe._moe_few_tokens(mlp, hs[4])
            if warm[1] is not None:  # (a refusal is test_grouped_mm_experts_equal_the_expert_loop's)
                out = MK.grouped_experts(hs[512], top_w, top_i, mlp.experts.gate_up_proj, mlp.experts.down_proj)
                assert out is not None, f"the grouped path failed under sync checking: {MK._GMM_REFUSED}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


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


def _cuda_ms(fn, reps=20):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def test_moe_layer_timings_printed(moe):
    """Figures for the log only (no timed assertion): one MoE layer's decode (kernels vs the old
    gathered-copy bmm reference) and a 4096-token chunk (grouped GEMMs vs the expert loop)."""
    from ninfer_core.accel import moe_kernels as MK

    mlp = moe.model.layers[2].mlp
    ex, se = mlp.experts, mlp.shared_expert
    shared = (se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight, mlp.shared_expert_gate.weight)
    g = torch.Generator(device="cuda").manual_seed(9)
    expert_bytes = (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel()) * 2
    with torch.inference_mode():
        for n in (1, 8):
            h = torch.randn(n, moe.cfg.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
            top_w, top_i = mlp.gate(h)
            t_new = _cuda_ms(lambda: moe._moe_few_tokens(mlp, h))
            t_kern = _cuda_ms(lambda: MK.moe_decode(h, top_w, top_i, ex.gate_up_proj, ex.down_proj, shared))
            t_old = _cuda_ms(lambda: MK.ref_moe_decode(h, top_w, top_i, ex.gate_up_proj, ex.down_proj, shared))
            moved = n * (top_i.shape[1] + 1) * expert_bytes
            print(f"MoE decode layer n={n}: with router {t_new * 1e3:.1f} us, expert kernels {t_kern * 1e3:.1f} us "
                  f"({moved / t_kern / 1e6:.0f} GB/s of weight rows), gathered bmm reference {t_old * 1e3:.1f} us")
        h = torch.randn(4096, moe.cfg.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
        top_w, top_i = mlp.gate(h)
        t_grp = _cuda_ms(lambda: ex(h, top_w, top_i), reps=5)
        t_loop = _cuda_ms(lambda: ex.forward_loop(h, top_w, top_i), reps=5)
        flops = 2 * h.shape[0] * top_i.shape[1] * expert_bytes / 2
        print(f"MoE experts, 4096-token chunk: grouped {t_grp:.2f} ms ({flops / t_grp / 1e9:.0f} TFLOP/s), "
              f"expert loop {t_loop:.2f} ms, grouped path refused: {sorted(MK._GMM_REFUSED) or 'no'}")
