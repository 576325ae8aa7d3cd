#!/usr/bin/env python3
"""One device call: environment facts, the GPU tests, then `ninfer bench` for each shape asked;
logs and JSON under --out, a short summary printed last.

Run on the device from the repository root (the wheels of the packages missing there installed
into PYTHONPATH first; see docs/bench.md):

    python3 scripts/gpu_check.py --out $OUT --bench qwen3.5-9b qwen3.5-27b

Vision (issue 20): `--order vision --tests --bench` runs scripts/vision_bench.py (encode time per
512x512 image and per video second for the resident, overlay and cpu residencies at the Qwen3.5-27B
tower shape, the device memory each holds, bf16 against transformers' fp32) and the tower's
parity tests.

Gemma 4 (issue 16): `--order gemma4 --bench` runs plugins/gemma4's CUDA checks (the Triton
sliding-window attention in bf16 at the real head geometry; the runner in bf16 against
transformers at the 31B and 26B-A4B widths, within 1e-2).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd: list[str], log_path: str, timeout: float) -> tuple[int, float, str]:
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        try:
            p = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    with open(log_path) as f:
        text = f.read()
    return rc, time.monotonic() - t0, text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    ap.add_argument("--tests", nargs="*", default=["tests/gpu"], help="pytest paths (none: skip)")
    ap.add_argument("--bench", nargs="*", default=["qwen3.5-9b"], help="shapes to bench (none: skip)")
    ap.add_argument("--bench-args", default="", help="extra arguments for every ninfer bench run")
    ap.add_argument("--shape-args", nargs=2, action="append", default=[], metavar=("SHAPE", "ARGS"),
                    help="extra bench arguments for one shape only (after --bench-args)")
    ap.add_argument("--replay", nargs="*", default=[], help="shapes for the context-cache replay (none: skip)")
    ap.add_argument("--replay-args", default="--turns 2 --system-tokens 28000 --reply-tokens 16 --profile-replay",
                    help="extra arguments for every replay run")
    ap.add_argument("--gemma4-tests", nargs="*", default=["plugins/gemma4/tests/test_gemma4_gpu.py",
                                                          "plugins/gemma4/tests/test_gemma4_serve.py"],
                    help="pytest paths of the Gemma 4 part (--order ...,gemma4)")
    ap.add_argument("--vision-args", default="--shape 27b", help="arguments of scripts/vision_bench.py "
                    "(--order ...,vision)")
    ap.add_argument("--order", default="tests,replay,bench", help="order of the parts (comma-separated)")
    ap.add_argument("--tests-timeout", type=float, default=240, help="seconds at most for the GPU tests")
    ap.add_argument("--budget", type=float, default=560, help="seconds for the whole call")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t_start = time.monotonic()
    summary = []

    env_cmd = [sys.executable, "-c", (
        "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, "
        "torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA');\n"
        "import importlib.util as u; print('fla', bool(u.find_spec('fla')), 'fastapi', bool(u.find_spec('fastapi')))\n"
        "import transformers; print('transformers', transformers.__version__)")]
    rc, _, text = run(env_cmd, os.path.join(a.out, "env.log"), 120)
    print(text.strip(), flush=True)

    def part_tests():
        if not a.tests:
            return
        left = a.budget - (time.monotonic() - t_start)
        rc, dt, text = run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                            *a.tests], os.path.join(a.out, "pytest.log"),
                            min(a.tests_timeout, max(60, left - 30)))
        lines = [ln for ln in text.splitlines() if ln.startswith(("PARITY", "graph vs", "8 concurrent", "tiny artifact",
                                                                  "in-place GDN", "fla chunk", "lane ", "MoE "))
                 or "rel err" in ln]
        tail = [ln for ln in text.splitlines() if " passed" in ln or " failed" in ln or "error" in ln.lower()][-3:]
        summary.append(f"== GPU tests rc={rc} in {dt:.0f} s")
        summary.extend(lines[-30:])
        summary.extend(tail)
        if rc != 0:
            summary.append(text[-4000:])

    def part_bench():
        for shape in a.bench:
            left = a.budget - (time.monotonic() - t_start)
            if left < 60:
                summary.append(f"== bench {shape}: skipped, {left:.0f} s left")
                continue
            js = os.path.join(a.out, f"bench-{shape.replace('/', '_')}.json")
            cmd = [sys.executable, "-m", "ninfer_core.cli", "bench", "--shape", shape, "--json", js,
                   *a.bench_args.split(), *[x for sh, extra in a.shape_args if sh == shape for x in extra.split()]]
            rc, dt, text = run(cmd, os.path.join(a.out, f"bench-{shape.replace('/', '_')}.log"), left - 10)
            summary.append(f"== bench {shape} rc={rc} in {dt:.0f} s")
            start = text.find("ninfer bench  shape=")
            prof = text.find("profile decode_b1")
            if prof >= 0:
                summary.append(text[prof:start if start > prof else None].strip())
            summary.append(text[start:].strip() if start >= 0 else text[-3000:])
            if os.path.exists(js):
                with open(js) as f:
                    json.load(f)

    def part_replay():
        for shape in a.replay:
            left = a.budget - (time.monotonic() - t_start)
            if left < 90:
                summary.append(f"== replay {shape}: skipped, {left:.0f} s left")
                continue
            tag = shape.replace('/', '_')
            js = os.path.join(a.out, f"replay-{tag}.json")
            cmd = [sys.executable, "-m", "ninfer_core.cli", "bench", "--conversations", "--replay-model", shape,
                   "--device", "cuda", "--json", js, *a.replay_args.split()]
            rc, dt, text = run(cmd, os.path.join(a.out, f"replay-{tag}.log"), left - 10)
            summary.append(f"== replay {shape} rc={rc} in {dt:.0f} s")
            start = text.find("replay: ")
            summary.append(text[start:].strip() if start >= 0 else text[-3000:])

    def part_gemma4():
        left = a.budget - (time.monotonic() - t_start)
        rc, dt, text = run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *a.gemma4_tests],
                           os.path.join(a.out, "gemma4.log"), max(60, left - 30))
        summary.append(f"== Gemma 4 GPU checks rc={rc} in {dt:.0f} s")
        summary.extend(ln for ln in text.splitlines() if ln.startswith("PARITY") or " passed" in ln
                       or " failed" in ln)
        if rc != 0:
            summary.append(text[-4000:])

    def part_vision():
        left = a.budget - (time.monotonic() - t_start)
        rc, dt, text = run([sys.executable, "scripts/vision_bench.py", *a.vision_args.split()],
                           os.path.join(a.out, "vision.log"), max(60, left - 30))
        summary.append(f"== vision tower rc={rc} in {dt:.0f} s")
        start = text.find("tower ")
        summary.append(text[start:].strip() if start >= 0 and rc == 0 else text[-4000:])
        rc, dt, text = run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                            "plugins/qwen35/tests/test_qwen35_vision.py", "tests/gpu/test_gpu_vision.py"],
                           os.path.join(a.out, "vision-tests.log"),
                           max(60, a.budget - (time.monotonic() - t_start) - 30))
        summary.append(f"== vision parity tests rc={rc} in {dt:.0f} s")
        summary.extend(ln[ln.find("PARITY"):] if "PARITY" in ln else ln for ln in text.splitlines()
                       if "PARITY" in ln or " passed" in ln or " failed" in ln)

    parts = {"tests": part_tests, "replay": part_replay, "bench": part_bench, "gemma4": part_gemma4,
             "vision": part_vision}
    for name in a.order.split(","):
        parts[name.strip()]()

    print("\n".join(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
