"""Gemma 4's sliding-window paged attention: the torch reference against plain attention, on the
CPU; the Triton kernel against the reference under TRITON_INTERPRET=1 (set before triton is
imported, so it runs in a subprocess). Pages behind a sliding window hold NaN, so a kernel that
reads one fails."""

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)


def test_reference_matches_plain_attention_and_skips_pages_behind_the_window():
    from gemma4_kernel_cases import SHAPES, build, dense_attention
    from ninfer_gemma4.gpu.attention import ref_paged_attention

    for i, (starts, qlens, h, kvh, d, window, page) in enumerate(SHAPES):
        q, kc, vc, tables, dk, dv = build(starts, qlens, h, kvh, d, window, page, seed=i)
        out = ref_paged_attention(q, kc, vc, tables, starts, qlens, window, 1.0)
        assert torch.isfinite(out).all()
        off = 0
        for b, (s, n) in enumerate(zip(starts, qlens)):
            want = dense_attention(q[off: off + n], dk[b], dv[b], torch.arange(s, s + n), window, 1.0)
            assert torch.allclose(out[off: off + n].double(), want, atol=1e-5)
            off += n


def test_reference_matches_the_model_attention():
    """The kernel's reference and the CPU model's attention (ninfer_gemma4.attention) agree."""
    from gemma4_kernel_cases import build
    from ninfer_gemma4.attention import grouped_attention
    from ninfer_gemma4.gpu.attention import ref_paged_attention

    starts, qlens, window = [30], [20], 16
    q, kc, vc, tables, dk, dv = build(starts, qlens, 4, 2, 32, window, 16, seed=7)
    kpos, qpos = torch.arange(50), torch.arange(30, 50)
    mask = (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - window)
    want = grouped_attention(q, dk[0], dv[0], mask)
    got = ref_paged_attention(q, kc, vc, tables, starts, qlens, window, 1.0)
    assert torch.allclose(got, want, atol=1e-5)


def interpreted(case: str) -> str:
    """Run `gemma4_kernel_cases.<case>()` with TRITON_INTERPRET=1 (set before triton is imported,
    hence a subprocess); its stdout."""
    pytest.importorskip("triton")
    path = os.pathsep.join([HERE, *sys.path])
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=path)
    code = f"import gemma4_kernel_cases as c; c.{case}()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(r.stdout)
    return r.stdout


def test_triton_kernel_matches_reference_under_the_interpreter():
    out = interpreted("interpreted")
    assert "gemma4 paged attention: worst" in out and "gemma4 ring attention: worst" in out
    assert "gemma4 split decode attention: worst" in out
    assert "gemma4 expert GEMV" in out and "gemma4 rms norm: worst" in out
    assert "gemma4 fused norm/rope/residual kernels: worst" in out


def test_runner_with_the_interpreted_kernel_matches_its_torch_path():
    assert "worst max relative logits error" in interpreted("runner_interpret")


def test_graph_decode_body_matches_the_eager_decode_under_the_interpreter():
    assert "graph decode body under the interpreter: worst" in interpreted("graph_body_interpret")


def test_runner_with_the_fused_kernels_matches_its_torch_forms_under_the_interpreter():
    assert "runner with the fused kernels: worst" in interpreted("fused_runner_interpret")


def test_fused_step_kernels_match_their_torch_forms_under_the_interpreter():
    assert "gemma4 fused-step kernels: worst" in interpreted("check_step_kernels")


def test_runner_with_the_fused_forward_matches_its_torch_path_under_the_interpreter():
    assert "gemma4 runner with the fused forward: worst" in interpreted("step_runner_interpret")


def test_decode_step_launch_counts_under_the_interpreter():
    assert "gemma4 decode step launch counts: ok" in interpreted("launch_counts")
