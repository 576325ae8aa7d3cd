"""The MoE expert kernels on the CPU: the decode kernels (Triton, interpreted) against the
gathered-expert reference and the router's math, the grouped prefill bookkeeping (sort by expert, device offsets,
un-sorting and the weighted combine) with a loop stand-in for torch._grouped_mm against the expert
loop, and the module dispatch (CPU runs the loop). tests/gpu/test_gpu_moe.py runs them on CUDA."""

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)


def _run_interpreted(case: str):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p))
    code = f"import gpu_kernel_cases as c; c.{case}()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(r.stdout)


def test_moe_decode_kernels_match_reference():
    _run_interpreted("moe_decode")


def test_route_topk_kernel_matches_router_math():
    _run_interpreted("moe_route")


def test_gpu_runner_on_moe_artifact_with_interpreted_kernels_matches_reference():
    _run_interpreted("runner_interpret_moe")


def test_grouped_path_with_interpreted_combine_kernel():
    _run_interpreted("moe_grouped")


def test_grouped_bookkeeping_with_loop_stand_in_matches_expert_loop():
    import gpu_kernel_cases as c

    c.moe_grouped("cpu", tol=1e-2)
    c.moe_grouped("cpu", n=1, k=2, tol=1e-2)


def test_grouped_with_torch_grouped_mm_on_cpu_if_present():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("no torch._grouped_mm")
    import gpu_kernel_cases as c

    try:
        torch._grouped_mm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(1, 8, 8, dtype=torch.bfloat16),
                          offs=torch.tensor([2], dtype=torch.int32))
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm has no CPU kernel here: {e}")
    c.moe_grouped("cpu", gmm=torch._grouped_mm, tol=2e-2)


def test_cpu_experts_run_the_loop_and_grouped_refuses_cpu():
    from ninfer_core.accel import moe_kernels as MK

    x = torch.randn(5, 16, dtype=torch.bfloat16)
    top_w = torch.full((5, 2), 0.5, dtype=torch.bfloat16)
    top_i = torch.randint(0, 4, (5, 2))
    assert MK.grouped_experts(x, top_w, top_i, torch.randn(4, 8, 16).bfloat16(), torch.randn(4, 16, 4).bfloat16()) is None


def test_moe_block_forward_unchanged_on_cpu():
    """SparseMoeBlock on the CPU still equals its explicit math through the expert loop."""
    from types import SimpleNamespace

    from ninfer_core.nn.moe import SparseMoeBlock

    cfg = SimpleNamespace(hidden_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=16, norm_topk_prob=True)
    blk = SparseMoeBlock(cfg)
    g = torch.Generator().manual_seed(1)
    for p in blk.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.2
    x = torch.randn(6, 32, generator=g)
    top_w, top_i = blk.gate(x)
    want = blk.experts.forward_loop(x, top_w, top_i) + torch.sigmoid(blk.shared_expert_gate(x)) * blk.shared_expert(x)
    assert torch.equal(blk(x), want)


def test_grouped_falls_back_once_refused_and_never_on_out_of_memory():
    from ninfer_core.accel import moe_kernels as MK

    x = torch.randn(5, 16, dtype=torch.bfloat16)
    top_w = torch.full((5, 2), 0.5, dtype=torch.bfloat16)
    top_i = torch.randint(0, 4, (5, 2), generator=torch.Generator().manual_seed(0))
    gu, dn = torch.randn(4, 8, 16).bfloat16(), torch.randn(4, 16, 4).bfloat16()
    calls = []

    def oom(*a):
        raise torch.OutOfMemoryError("out of memory")

    def refuse(*a):
        calls.append(1)
        raise RuntimeError("grouped gemm: unsupported layout\ndetails")

    MK._GMM_REFUSED.clear()
    try:
        with pytest.raises(torch.OutOfMemoryError):
            MK.grouped_experts(x, top_w, top_i, gu, dn, gmm=oom)
        assert not MK._GMM_REFUSED
        assert MK.grouped_experts(x, top_w, top_i, gu, dn, gmm=refuse) is None
        assert MK.grouped_experts(x, top_w, top_i, gu, dn, gmm=refuse) is None
        assert len(calls) == 1 and len(MK._GMM_REFUSED) == 1
        ((key, why),) = MK._GMM_REFUSED
        assert key == ("cpu", torch.bfloat16) and "unsupported layout" in why and "details" not in why
    finally:
        MK._GMM_REFUSED.clear()
    out = MK.grouped_experts(x, top_w, top_i, gu, dn, gmm=MK.loop_grouped_mm)
    import gpu_kernel_cases as c

    assert c.rel(out, c._expert_loop(x, top_w, top_i, gu, dn)) < 1e-2
