"""The GPU runner's decode linears through ninfer_core.accel.gemv (issue 21): under the Triton
interpreter a tiny dense artifact decodes with the GEMV taking every projection, the fused gate/up
and the logits of <= 8 rows (counted), and its logits equal those of the same runner with the
GEMV off (NINFER_GEMV=0: torch linears) and of the reference runner; prefill chunks longer than
8 rows never reach it. A subprocess, since TRITON_INTERPRET must be set before triton is imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CASE = textwrap.dedent("""
    import tempfile, torch
    from ninfer_core.accel import gemv as GV
    from ninfer_core.artifact import Artifact
    from ninfer_core.engine.model_api import SeqView
    from ninfer_qwen35.family import Qwen35Family
    from ninfer_qwen35.gpu.runner import GpuQwen35Runner
    from ninfer_qwen35.testing import build_tiny_artifact

    calls = {"gemv": [], "gated": []}
    real_gemv, real_gated = GV.gemv, GV.gemv_silu_mul
    def gemv(x, w, *a, **k):
        calls["gemv"].append(x.shape[0]); return real_gemv(x, w, *a, **k)
    def gated(x, w, *a, **k):
        calls["gated"].append(x.shape[0]); return real_gated(x, w, *a, **k)
    GV.gemv, GV.gemv_silu_mul = gemv, gated

    with tempfile.TemporaryDirectory() as d:
        art = Artifact.open(build_tiny_artifact(f"{d}/t.ninfer", kind="dense", seed=5, num_layers=4))
        outs = {}
        for mode in ("ref", "off", "on"):
            r = Qwen35Family().load(art)
            if mode != "ref":
                r = GpuQwen35Runner.from_runner(r)
                r.gemv = mode == "on"
            r.allocate_cache(16, 3)
            a, b = SeqView(0, [5, 2, 9], 0), SeqView(2, [7, 1], 0)
            g = torch.Generator().manual_seed(7)
            ta = torch.randint(0, 500, (40,), generator=g).tolist()
            tb = torch.randint(0, 500, (30,), generator=g).tolist()
            before = len(calls["gemv"])
            rows = [r.prefill(a, ta[:20], all_logits=True)]
            a.num_cached = 20
            assert len(calls["gemv"]) == before, "a 20-row prefill went through the GEMV"
            rows.append(r.prefill(b, tb[:3], all_logits=True))  # 3 rows: the GEMV
            b.num_cached = 3
            for i in range(3):
                rows.append(r.decode([a, b], [ta[20 + i], tb[3 + i]]))
                a.num_cached += 1; b.num_cached += 1
            outs[mode] = torch.cat(rows)
            if mode == "off":
                assert not calls["gemv"] and not calls["gated"], calls
        # per decode round: 3 GDN layers x 2 + 1 attention x 2 projections + 4 down + logits; 4 gate/up
        assert calls["gated"].count(2) == 3 * 4, calls["gated"]
        assert calls["gemv"].count(2) == 3 * (3 * 2 + 2 + 4 + 1), calls["gemv"]
        assert max(calls["gemv"]) <= GV.MAX_ROWS
        e_off = float((outs["on"] - outs["off"]).abs().max() / outs["off"].abs().max())
        e_ref = float((outs["on"] - outs["ref"]).abs().max() / outs["ref"].abs().max())
        assert e_off < 1e-4 and e_ref < 1e-4, (e_off, e_ref)
        print("ok", e_off, e_ref)
""")


def test_gpu_runner_decode_through_the_gemv_matches_torch_linears():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", CASE], env=env, capture_output=True, text=True, timeout=900,
                       check=False)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


MOE_CASE = textwrap.dedent("""
    import torch
    from ninfer_core.accel import moe_kernels as MK
    g = torch.Generator().manual_seed(3)
    e, hidden, inter, k = 12, 96, 48, 4
    dt = torch.float16  # the interpreter rounds bf16 by truncation
    gate_up = torch.randn(e, 2 * inter, hidden, generator=g).to(dt)
    down = (torch.randn(e, hidden, inter, generator=g) / 4).to(dt)
    sh = (torch.randn(inter, hidden, generator=g).to(dt), torch.randn(inter, hidden, generator=g).to(dt),
          (torch.randn(hidden, inter, generator=g) / 4).to(dt), torch.randn(1, hidden, generator=g).to(dt))
    for n in (1, 5, 8):
        x = torch.randn(n, hidden, generator=g).to(dt)
        top_w, top_i = MK.ref_route_topk(torch.randn(n, e, generator=g).to(dt), k, True)
        for shared in (None, sh):
            ref = MK.ref_moe_decode(x, top_w, top_i, gate_up, down, shared)
            old = MK.moe_decode(x, top_w, top_i, gate_up, down, shared)
            new = MK.moe_decode(x, top_w, top_i, gate_up, down, shared, grouped=True)
            e1 = float((new.float() - ref.float()).norm() / ref.float().norm())
            e2 = float((new.float() - old.float()).norm() / old.float().norm())
            assert torch.isfinite(new).all() and e1 < 1e-2 and e2 < 1e-2, (n, e1, e2)
    print("ok")
""")


def test_moe_decode_grouped_experts_matches_the_per_pair_kernels_and_reference():
    """qwen35's MoE decode with the grouped-expert GEMVs (ninfer_core.accel.moe_gemv, the switch
    the runner sets from NINFER_GEMV) against the per-(token, slot) kernels and the torch reference."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", MOE_CASE], env=env, capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
