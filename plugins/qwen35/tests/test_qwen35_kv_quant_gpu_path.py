"""The GPU runner with a quantised --kv-dtype (its attention through ninfer_core.quant.kv_attention's
Triton kernels, interpreted on the CPU) against the reference runner with the same KV dtype."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CASE = r"""
import tempfile
import argparse
import torch
from ninfer_qwen35.family import Qwen35Family
from ninfer_qwen35.gpu.runner import GpuQwen35Runner
from ninfer_qwen35.testing import build_tiny_artifact
from ninfer_core.artifact import Artifact
from ninfer_core.engine.model_api import SeqView
from ninfer_core.quant.kv import BF16, FP8, INT8, K8V4

with tempfile.TemporaryDirectory() as d:
    art = Artifact.open(build_tiny_artifact(f"{d}/t.ninfer", kind="dense", seed=5, num_layers=4))
    plain = None
    for fmt in (INT8, FP8, K8V4, BF16):
        ref = Qwen35Family().load(art, options=argparse.Namespace(kv_dtype=fmt))
        fast = GpuQwen35Runner.from_runner(Qwen35Family().load(art, options=argparse.Namespace(kv_dtype=fmt)))
        assert fast.kv_format is fmt
        outs = []
        for r in (ref, fast):
            r.allocate_cache(12, 3)
            a = SeqView(slot=0, pages=[5, 2, 9], num_cached=0)
            b = SeqView(slot=2, pages=[7, 1], num_cached=0)
            g = torch.Generator().manual_seed(7)
            ta = torch.randint(0, 500, (100,), generator=g).tolist()
            tb = torch.randint(0, 500, (40,), generator=g).tolist()
            rows = [r.prefill(a, ta[:70], all_logits=True)]
            a.num_cached = 70
            rows.append(r.prefill(a, ta[70:90], all_logits=True))
            a.num_cached = 90
            rows.append(r.prefill(b, tb[:30], all_logits=True))
            b.num_cached = 30
            for i in range(2):
                rows.append(r.decode([a, b], [ta[90 + i], tb[30 + i]]))
                a.num_cached += 1
                b.num_cached += 1
            outs.append(torch.cat(rows))
            if r is fast and fmt.quantized:
                assert r.cache.kv_scale, "quantised pages"
        err = float((outs[1] - outs[0]).abs().max() / outs[0].abs().max())
        print(f"{fmt.name}: gpu path vs reference {err:.2e}")
        assert err < 1e-3, (fmt.name, err)
        if fmt is BF16:
            plain = outs[0]
        else:
            last = outs[0]
    drift = float((last - plain).abs().max() / plain.abs().max())
    assert drift > 0, "the bf16 run must differ from a quantised one"
print("kv gpu path ok")
"""


def test_gpu_runner_with_quantised_kv_matches_the_reference_runner():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", CASE], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "kv gpu path ok" in r.stdout
    print(r.stdout)

