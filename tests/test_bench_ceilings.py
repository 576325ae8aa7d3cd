"""`ninfer bench`'s ceilings (ninfer_core/bench/ceilings.py): the read-only stream's kernel sums what
torch sums (under the Triton interpreter, as it runs on CUDA), and the decode-GEMV shapes are the
model's distinct weight matrices with the embedding table left out unless lm_head is tied to it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ninfer_core.bench.ceilings import linear_rates, linear_shapes, measure_ceilings, read_sum


def test_read_sum_torch_path_partials_sum_to_the_total():
    x = torch.randn(3 * 4096 * 16 + 777, dtype=torch.bfloat16)
    parts = read_sum(torch, x)
    assert parts.shape == (4,)
    assert float(parts.sum()) == pytest.approx(float(x.float().sum()), rel=1e-4, abs=1e-2)


def test_read_sum_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch
        from ninfer_core.bench.ceilings import read_sum
        x = torch.randn(5 * 64 * 4 + 33, dtype=torch.bfloat16)
        parts = read_sum(torch, x, block=64, iters=4)
        assert parts.shape == (6,), parts.shape
        want = torch.nn.functional.pad(x.float(), (0, 6 * 256 - x.numel())).view(6, -1).sum(1)
        err = float((parts - want).abs().max())
        assert err < 1e-3, err
        print("ok", err)
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-2000:]


class _Toy(torch.nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(50, 8)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 16, bias=False) for _ in range(3)])
        self.down = torch.nn.Linear(16, 8, bias=False)
        self.lm_head = torch.nn.Linear(8, 50, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


@pytest.mark.parametrize("tied", [False, True])
def test_linear_shapes_count_each_matrix_once(tied):
    shapes = {(n, k): c for n, k, c in linear_shapes(_Toy(tied))}
    assert shapes[(16, 8)] == 3 and shapes[(8, 16)] == 1 and shapes[(50, 8)] == 1
    assert sum(shapes.values()) == 5  # the untied embedding table is gathered, not multiplied


def test_linear_rates_and_ceilings_on_the_cpu():
    rows = linear_rates(torch, _Toy(False), torch.device("cpu"), torch.float32, batches=(1, 2), read_GBps=10.0,
                        repeats=1)
    assert [(r["out"], r["in"]) for r in rows] == [(n, k) for n, k, _ in linear_shapes(_Toy(False))]
    assert all(r["b1_GBps"] > 0 and r["b2_vs_read"] == pytest.approx(r["b2_GBps"] / 10.0) for r in rows)
    c = measure_ceilings(torch, torch.device("cpu"))
    assert c["read_bandwidth_GBps"] > 0 and c["copy_bandwidth_GBps"] > 0 and c["matmul_TFLOPs"] > 0
