"""The decode GEMV (ninfer_core.accel.gemv) and the grouped-expert GEMVs (accel.moe_gemv) on CUDA at
the real decode shapes, bf16: against torch / float64 for M = 1..8 (the tuned config and every
candidate, forced, including split-K), the same bits on a repeated call and inside a CUDA Graph,
outputs poisoned first; no host synchronisation inside capture."""

import pytest
import torch
import torch.nn.functional as F

from ninfer_core.accel import gemv as GV
from ninfer_core.accel import moe_gemv as MG

TOL = 1e-2


def rel(a, b):
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm())


def _nan(m, n, dt=torch.bfloat16):
    return torch.full((m, n), float("nan"), dtype=dt, device="cuda")


@pytest.mark.parametrize("n,k", [(4096, 4096), (12352, 4096), (4096, 12288), (5120, 17408), (256, 2048)])
def test_gemv_real_shapes_every_candidate(n, k):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    worst = 0.0
    for m in (1, 2, 3, 8):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        exact = x.double() @ w.double().T
        for cfg in [None, *GV.candidates(m, torch.bfloat16)]:
            y = GV.gemv(x, w, config=cfg, out=_nan(m, n))
            e = rel(y, exact)
            worst = max(worst, e)
            assert e < TOL, (m, cfg, e)
            assert torch.equal(GV.gemv(x, w, config=cfg), y), (m, cfg)  # deterministic split-K
    print(f"gemv {k}->{n}: worst rel err {worst:.2e}")
    assert int(GV._COUNTERS[w.device].abs().sum()) == 0


@pytest.mark.parametrize("n,k", [(4096, 4096), (12352, 2048), (4096, 12288), (248320, 4096)])
def test_a_row_gets_the_same_bits_alone_and_in_a_batch(n, k):
    """Batch invariance: row i of an 8-row call equals the 1-row call on that row, bit for bit,
    for the plain and the gated variant (greedy output of 8 lanes together equals each alone)."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
    many = GV.gemv(x, w)
    for m in (1, 3):
        part = GV.gemv(x[:m].contiguous(), w)
        assert torch.equal(part, many[:m]), (n, k, m)
    if n % 2 == 0 and n <= 24576:
        g8 = GV.gemv_silu_mul(x, w)
        assert torch.equal(GV.gemv_silu_mul(x[:1].contiguous(), w), g8[:1]), (n, k)


def test_gemv_gated_residual_logits_and_graph_replay():
    k, inter = 4096, 12288
    wgu = torch.randn(2 * inter, k, device="cuda", dtype=torch.bfloat16)
    wd = torch.randn(k, inter, device="cuda", dtype=torch.bfloat16) / 64
    lm = torch.randn(248320, k, device="cuda", dtype=torch.bfloat16)
    for m in (1, 4, 8):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        act = GV.gemv_silu_mul(x, wgu, out=_nan(m, inter))
        assert rel(act, GV.ref_gemv_silu_mul(x, wgu)) < TOL
        y = GV.gemv(act, wd, residual=r, out=_nan(m, k))
        assert rel(y, r + F.linear(act, wd)) < TOL
        lg = GV.gemv(x, lm, out_dtype=torch.float32, out=_nan(m, lm.shape[0], torch.float32))
        assert rel(lg, F.linear(x, lm).float()) < TOL
        # the same launches captured in a graph and replayed give the same bits
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ga = GV.gemv_silu_mul(x, wgu)
            gy = GV.gemv(ga, wd, residual=r)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        assert torch.equal(ga, act) and torch.equal(gy, y), m


def test_grouped_experts_at_the_35b_a3b_shape():
    e, inter, h, k = 256, 512, 2048, 8
    gu = torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16)
    dn = torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16) / 16
    sh = (torch.randn(inter, h, device="cuda", dtype=torch.bfloat16),
          torch.randn(inter, h, device="cuda", dtype=torch.bfloat16))
    sd = torch.randn(h, inter, device="cuda", dtype=torch.bfloat16) / 16
    for m in (1, 3, 8):
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        top_i = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(m)])
        if m > 1:
            top_i[1, :4] = top_i[0, 4:]  # shared experts across tokens
        act = MG.grouped_gate_up_act(x, top_i, gu, sh)
        assert rel(act, MG.ref_grouped_gate_up_act(x, top_i, gu, sh)) < TOL, m
        y = MG.grouped_down(act, top_i, dn, sd)
        assert rel(y, MG.ref_grouped_down(act, top_i, dn, sd)) < TOL, m
    print("grouped experts at the 35B-A3B shape: ok")
