"""Cases of tests/test_accel_gemv.py, each run in a subprocess with TRITON_INTERPRET=1 (it must be set
before triton is imported). Fresh random inputs (never zeros), outputs poisoned with NaN first."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer_core.accel import gemv as G

BF16_TOL = 1e-2  # ‖out − ref‖ / ‖ref‖ for bf16 operands (fp32 accumulation)
# the interpreter rounds fp32 -> bf16 by truncation (one ulp off torch), which the gated epilogue's
# four roundings compound past 1e-2; those cases run in float16, which it rounds to nearest
HALF = torch.float16


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _nan(m, n, dtype=torch.bfloat16):
    return torch.full((m, n), float("nan"), dtype=dtype)


CONFIGS = [
    G.Config(False, 16, 32, 4, 1, 1, split=1),
    G.Config(False, 8, 32, 4, 1, 1, split=3),
    G.Config(True, 16, 32, 4, 2, 1, split=1),
    G.Config(True, 32, 32, 4, 2, 1, split=2),
]


def _cfgs(m):
    return [c for c in CONFIGS if c.dot or m == 1]


def plain():
    g = torch.Generator().manual_seed(1)
    for n, k in [(40, 96), (64, 128), (24, 200)]:
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        for m in (1, 2, 3, 8):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            exact = x.double() @ w.double().T
            want = G.ref_gemv(x, w)
            for cfg in _cfgs(m):
                y = G.gemv(x, w, config=cfg, out=_nan(m, n))
                assert torch.isfinite(y).all(), (n, k, m, cfg)
                e1, e2 = rel(y, exact), rel(y, want)
                assert e1 < BF16_TOL and e2 < BF16_TOL, (n, k, m, cfg, e1, e2)
    print("plain ok")


def gated():
    g = torch.Generator().manual_seed(2)
    for inter, k in [(24, 64), (40, 96)]:
        wg = torch.randn(2 * inter, k, generator=g).to(HALF)
        for m in (1, 4, 8):
            x = torch.randn(m, k, generator=g).to(HALF)
            gu = x.double() @ wg.double().T
            exact = F.silu(gu[:, :inter]) * gu[:, inter:]
            want = G.ref_gemv_silu_mul(x, wg)
            for cfg in _cfgs(m):
                y = G.gemv_silu_mul(x, wg, config=cfg, out=_nan(m, inter, HALF))
                assert torch.isfinite(y).all(), (inter, m, cfg)
                e1, e2 = rel(y, exact), rel(y, want)
                assert e1 < BF16_TOL and e2 < BF16_TOL, (inter, k, m, cfg, e1, e2)
    print("gated ok")


def epilogues():
    """Bias, residual, and a float32 output of the bf16-rounded result (logits)."""
    g = torch.Generator().manual_seed(3)
    n, k = 48, 64
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    for m in (1, 5):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        r = (4 * torch.randn(m, n, generator=g)).to(torch.bfloat16)
        for cfg in _cfgs(m):
            y = G.gemv(x, w, bias=b, config=cfg, out=_nan(m, n))
            assert rel(y, x.double() @ w.double().T + b.double()) < BF16_TOL, cfg
            y = G.gemv(x, w, residual=r, config=cfg, out=_nan(m, n))
            assert rel(y, r.double() + x.double() @ w.double().T) < BF16_TOL, cfg
            assert rel(y, G.ref_gemv(x, w, residual=r)) < BF16_TOL, cfg
            y = G.gemv(x, w, out_dtype=torch.float32, config=cfg, out=_nan(m, n, torch.float32))
            assert y.dtype == torch.float32
            # rounded to bf16 before the cast, as F.linear(...).float()
            assert torch.equal(y, y.to(torch.bfloat16).float()), cfg
            assert rel(y, F.linear(x, w).float()) < BF16_TOL, cfg
    print("epilogues ok")


def split_counters_and_determinism():
    """Split-K leaves its counters at zero (a graph replay finds them ready) and gives the same bits
    on every call."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 256, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    cfg = G.Config(True, 16, 32, 4, 2, 1, split=4)
    first = G.gemv(x, w, config=cfg)
    for _ in range(3):
        assert torch.equal(G.gemv(x, w, config=cfg), first)
    assert int(G._COUNTERS[x.device].abs().sum()) == 0
    print("split ok")


def fp32_and_default_pick():
    """fp32 operands take the exact dot (tight tolerance); config=None picks the first candidate here."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(36, 80, generator=g)
    for m in (1, 2, 7):
        x = torch.randn(m, 80, generator=g)
        y = G.gemv(x, w, out=_nan(m, 36, torch.float32))
        assert rel(y, x.double() @ w.double().T) < 1e-5, m
    wb = w.to(torch.bfloat16)
    for m in (1, 6):
        x = torch.randn(m, 80, generator=g).to(torch.bfloat16)
        assert rel(G.gemv(x, wb), x.double() @ wb.double().T) < BF16_TOL
        xh, wh = x.to(HALF), wb.to(HALF)
        assert rel(G.gemv_silu_mul(xh, wh), G.ref_gemv_silu_mul(xh, wh)) < BF16_TOL
    print("fp32 ok")


def moe_grouped():
    """Grouped-expert gate/up + SiLU and down against the torch references and float64: rounds of
    1..8 tokens whose experts repeat across tokens (each expert read once), with and without a
    shared expert; every (token, slot) row checked against float64 (an unwritten row fails)."""
    from ninfer_core.accel import moe_gemv as MG

    g = torch.Generator().manual_seed(6)
    e, inter, hidden, k = 6, 40, 72, 3
    gate_up = torch.randn(e, 2 * inter, hidden, generator=g).to(HALF)
    down = torch.randn(e, hidden, inter, generator=g).to(HALF) / 4
    sh = (torch.randn(inter, hidden, generator=g).to(HALF), torch.randn(inter, hidden, generator=g).to(HALF))
    sd = torch.randn(hidden, inter, generator=g).to(HALF) / 4
    for n in (1, 3, 8):
        x = torch.randn(n, hidden, generator=g).to(HALF)
        top_i = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
        if n > 1:
            top_i[1] = top_i[0].flip(0)  # the same experts in other slots
        for shared, shared_d in ((None, None), (sh, sd)):
            act = MG.grouped_gate_up_act(x, top_i, gate_up, shared)
            want = MG.ref_grouped_gate_up_act(x, top_i, gate_up, shared)
            assert act.shape == want.shape and torch.isfinite(act).all()
            assert rel(act, want) < BF16_TOL, (n, rel(act, want))
            y = MG.grouped_down(act, top_i, down, shared_d)
            ywant = MG.ref_grouped_down(act, top_i, down, shared_d)
            assert torch.isfinite(y).all() and rel(y, ywant) < BF16_TOL, (n, rel(y, ywant))
            # float64 of the whole chain, per (token, slot)
            slots = k + (shared is not None)
            for t in range(n):
                for j in range(slots):
                    if j < k:
                        wg, wu = gate_up[top_i[t, j], :inter].double(), gate_up[top_i[t, j], inter:].double()
                        wd = down[top_i[t, j]].double()
                    else:
                        wg, wu, wd = shared[0].double(), shared[1].double(), shared_d.double()
                    xv = x[t].double()
                    a = F.silu(wg @ xv) * (wu @ xv)
                    assert rel(act[t * slots + j], a) < BF16_TOL, (n, t, j)
                    assert rel(y[t * slots + j], wd @ act[t * slots + j].double()) < BF16_TOL, (n, t, j)
    print("moe grouped ok")


def linear_swap():
    """use_gemv swaps plain Linears only; the swapped module equals F.linear for decode rows (the
    kernel) and for a prefill-sized input (F.linear itself), and NINFER_GEMV=0 keeps F.linear."""
    import os

    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 192, bias=True), nn.GELU(), nn.Linear(192, 128, bias=False))
    ref = [m.weight.detach().clone() for m in net if isinstance(m, nn.Linear)]
    assert G.use_gemv(net) == 2 and all(type(m) is G.GemvLinear for m in net if isinstance(m, nn.Linear))
    assert G.use_gemv(net) == 0  # already swapped
    calls = {"n": 0}
    real = G.gemv

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    G.gemv = counting
    try:
        with torch.no_grad():
            for shape in ((1, 256), (3, 256), (2, 4, 256), (40, 256)):
                x = torch.randn(*shape)
                want = F.linear(F.gelu(F.linear(x, ref[0], net[0].bias)), ref[1])
                got = net(x)
                assert got.shape == want.shape and rel(got, want) < 1e-5, (shape, rel(got, want))
            assert calls["n"] == 6, calls  # 2 linears x the three decode-sized inputs; 40 rows take F.linear
            os.environ["NINFER_GEMV"] = "0"
            net(torch.randn(1, 256))
            assert calls["n"] == 6
    finally:
        G.gemv = real
        os.environ.pop("NINFER_GEMV", None)
    print("ok")

