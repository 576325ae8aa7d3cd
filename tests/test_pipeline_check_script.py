"""scripts/pipeline_check.py (the lead's two-GPU check, issue 26) runs its whole sequence on the CPU
with --smoke: plain prefill and batched decode on one device and two gloo stages (whole and
micro-batched), --spec mtp through the engine on both, one table, greedy identical."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("ninfer_qwen35")
pytest.importorskip("ninfer_spec_mtp")

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "pipeline_check.py")


def test_pipeline_check_smoke_prints_one_table_with_identical_greedy():
    r = subprocess.run([sys.executable, SCRIPT, "--smoke", "--prompt", "80", "--steps", "6", "--lanes", "3",
                        "--mtp-prompt", "20", "--mtp-steps", "8"],
                       capture_output=True, text=True, timeout=300, check=False,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("run "))
    table = lines[header + 1: header + 6]
    assert [ln.split("  ")[0].split(" (")[0] for ln in table] == [
        "1 GPU plain", "1 GPU --spec mtp", "2 stages, whole", "2 stages, micro-batched", "2 stages --spec mtp"]
    assert all(" True " in ln for ln in table)
    assert "NCCL_NVLS_ENABLE=0" in lines[0]
    assert lines[-1].startswith("PIPELINE greedy identical") and "--spec mtp identical" in lines[-1]
