"""The GPU path's Triton kernels against their torch references, on random inputs (never zeros),
on the CPU under TRITON_INTERPRET=1 (set before triton is imported, so this module runs in its own
process through conftest's environment or is skipped). Outputs are poisoned with NaN first so an
unwritten element fails. tests/gpu/ runs the same checks at the real shapes on CUDA.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

HERE = os.path.dirname(__file__)


def _run(case: str):
    """Each case runs in a subprocess with TRITON_INTERPRET=1 (it must be set before import)."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p))
    code = f"import gpu_kernel_cases as c; c.{case}()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(r.stdout)


def test_paged_decode_attention_matches_reference():
    _run("decode_attention")


def test_paged_prefill_attention_matches_reference():
    _run("prefill_attention")


def test_gdn_decode_inplace_matches_reference():
    _run("gdn_decode")


def test_gdn_prefill_recurrent_matches_per_token_and_chunked_reference():
    _run("gdn_prefill_recurrent")


def test_gpu_runner_with_interpreted_kernels_matches_reference():
    _run("runner_interpret")


def test_fused_elementwise_kernels_match_reference():
    _run("fused_elementwise")


def test_conv_update_and_qk_norm_rope_kernels_match_reference():
    _run("conv_and_qk")


def test_attention_decode_fused_kv_write_and_gate_match_chain_and_reference():
    _run("attn_decode_fused")


def test_decode_attention_from_key_one_matches_reference():
    _run("decode_attention_key_start")


def test_verify_and_commit_kernels_match_reference_and_decode_steps():
    _run("verify_kernels")


def test_gpu_runner_verify_commit_and_draft_head_with_interpreted_kernels():
    _run("runner_interpret_verify")
