"""ninfer_core.accel.gemv, the decode GEMV: the Triton kernel against torch / float64 under the
interpreter (tests/accel_gemv_cases.py, one subprocess per case since TRITON_INTERPRET must be set
before triton is imported) for the FMA and tensor-core paths, split-K, the gated and residual
epilogues, the grouped-expert MoE GEMVs (ninfer_core.accel.moe_gemv); and the dispatch rules (what falls back to the reference) in this process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ninfer_core.accel import gemv as G

HERE = os.path.dirname(__file__)


def _run(case: str):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", f"import accel_gemv_cases as c; c.{case}()"], env=env,
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.parametrize("case", ["plain", "gated", "epilogues", "split_counters_and_determinism",
                                  "fp32_and_default_pick", "moe_grouped", "linear_swap"])
def test_gemv_kernel_under_the_interpreter(case):
    pytest.importorskip("triton")
    _run(case)


def test_falls_back_to_the_reference_where_the_kernel_does_not_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    w = torch.randn(16, 32, dtype=torch.bfloat16)
    assert not G.supported(x, w)  # a CPU tensor without the interpreter
    r = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(G.gemv(x, w, residual=r), r + torch.nn.functional.linear(x, w))
    assert torch.equal(G.gemv_silu_mul(x, w), G.ref_gemv_silu_mul(x, w))
    out = torch.full((3, 16), float("nan"), dtype=torch.bfloat16)
    assert G.gemv(x, w, out=out) is out and torch.isfinite(out).all()


def test_supported_rules(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not G.HAVE_TRITON:
        pytest.skip("triton is not installed")
    w = torch.randn(16, 32, dtype=torch.bfloat16)
    assert G.supported(torch.randn(8, 32, dtype=torch.bfloat16), w)
    assert not G.supported(torch.randn(9, 32, dtype=torch.bfloat16), w)  # past MAX_ROWS: cuBLAS
    assert not G.supported(torch.randn(2, 32), w)  # dtypes differ
    assert not G.supported(torch.randn(2, 32, dtype=torch.bfloat16), w.t().contiguous().t()[:, :32])  # strided rows
    assert not G.supported(torch.randn(2, 31, dtype=torch.bfloat16), w)


def test_config_buckets_and_split():
    assert [G.bucket(m) for m in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    # one candidate list (tensor-core path) for every row count in bf16/fp16: a lane's rows then
    # reduce in the same order alone or in a batch of 8 (batch invariance of greedy output)
    for dt in (torch.bfloat16, torch.float16):
        assert all(G.candidates(m, dt) == G.candidates(1, dt) for m in range(1, 9))
        assert all(c.dot for c in G.candidates(1, dt))
    cpu = torch.device("cpu")  # 4 "SMs" off CUDA
    cfg = G.Config(True, 64, 128, 4, 4, 2)
    assert G.split_for(cfg, 64, 4096, cpu) == 8  # one row block, 8 programs wanted
    assert G.split_for(cfg, 64 * 100, 4096, cpu) == 1  # enough row blocks
    assert G.split_for(cfg, 64, 256, cpu) == 1  # K too short to split


def test_enabled_switch(monkeypatch):
    monkeypatch.setenv("NINFER_GEMV", "0")
    assert not G.enabled()
    monkeypatch.setenv("NINFER_GEMV", "1")
    assert G.enabled()


def test_one_tuned_config_per_shape_for_every_row_count(monkeypatch):
    """The tuned config is keyed by (variant, N, K), not the row bucket, in half precision: the
    choice made for a batch of 8 is the one a lone lane uses."""
    monkeypatch.setattr(G, "_TUNED", {})
    picked = G.Config(True, 32, 256, 4, 3, 4)
    G._TUNED[(torch.device("cpu"), "plain", 64, 128, 0, torch.bfloat16)] = picked
    w = torch.randn(64, 128, dtype=torch.bfloat16)
    for m in (1, 2, 5, 8):
        x = torch.randn(m, 128, dtype=torch.bfloat16)
        assert G._pick("plain", x, w, 64, lambda cfg, wc: None) is picked

