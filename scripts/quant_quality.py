"""Quality of the weight encodings and KV dtypes against bf16, on the CPU (docs/quantization.md).

    python scripts/quant_quality.py [--per-kind 10] [--prose-docs 20] [--out DIR]

For ninfer-tiny (the trained artifact plugins/tiny ships): held-out prose perplexity (the runner,
offline) and greedy task accuracy (tool call, JSON, addition) through a live `ninfer serve` with the
openai client, for each `ninfer convert --quantize` encoding and each `--kv-dtype`. For a small
random Qwen3.5 shape: logits drift against the unencoded model over a prefill and decode steps.
Prints one markdown table per part.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

WEIGHTS = [("bf16", None, None), ("int8-g128", "int8", 128), ("int4-g64", "int4", 64), ("int4-g128", "int4", 128),
           ("fp8_e4m3-row", "fp8", None)]
KV = ["int8", "fp8", "k8v4"]


def tiny_artifact() -> str:
    from ninfer_tiny.plugin import packaged_artifact

    path = packaged_artifact()
    if path is None:
        sys.exit("ninfer-tiny ships no trained artifact in this checkout")
    return path


def convert(src: str, out: str, scheme: str, group) -> None:
    cmd = [sys.executable, "-m", "ninfer_core.cli", "convert", src, out, "--quantize", scheme, "--no-progress"]
    if group:
        cmd += ["--group-size", str(group)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def scores(artifact: str, samples, per_kind: int, prose_docs: int, serve_args=(), options=None) -> dict:
    from ninfer_tiny import evaluate as ev

    proc, base = ev.start_server(artifact, serve_args)
    try:
        got = ev.server_scores(base, samples)
    finally:
        proc.send_signal(2)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    got.update(ev.offline_scores(artifact, samples[:0], prose_docs, options=options))
    return got


def tiny_table(per_kind: int, prose_docs: int, out_dir: str) -> str:
    import argparse as ap

    from ninfer_tiny.data import eval_prompts

    from ninfer_core.quant.kv import kv_format

    samples = eval_prompts(1, per_kind)
    src = tiny_artifact()
    rows = []
    for label, scheme, group in WEIGHTS:
        path = src
        if scheme:
            path = os.path.join(out_dir, f"tiny-{label}.ninfer")
            convert(src, path, scheme, group)
        t0 = time.monotonic()
        s = scores(path, samples, per_kind, prose_docs)
        rows.append((f"weights {label}", os.path.getsize(path), s, time.monotonic() - t0))
    for name in KV:
        t0 = time.monotonic()
        s = scores(src, samples, per_kind, prose_docs, ("--kv-dtype", name), ap.Namespace(kv_dtype=kv_format(name)))
        rows.append((f"KV {name}", os.path.getsize(src), s, time.monotonic() - t0))
    base = rows[0][2]
    lines = [f"| ninfer-tiny | file | prose ppl | vs bf16 | tool | json | addition ({per_kind} prompts each) |",
             "|---|---|---|---|---|---|---|"]
    for label, size, s, _ in rows:
        lines.append(f"| {label} | {size / 2**20:.1f} MiB | {s['ppl']:.3f} | {100 * (s['ppl'] / base['ppl'] - 1):+.2f}% "
                     f"| {s.get('tool', 0):.2f} | {s.get('json', 0):.2f} | {s.get('addition', 0):.2f} |")
    return "\n".join(lines)


def drift_table(tokens: int = 96, steps: int = 16) -> str:
    """Logits drift of each encoding / KV dtype against the float model on a random Qwen3.5 shape."""
    import argparse as ap

    import torch
    from ninfer_qwen35.family import Qwen35Family
    from ninfer_qwen35.testing import build_tiny_artifact

    from ninfer_core.artifact import Artifact
    from ninfer_core.artifact.convert import convert_artifact
    from ninfer_core.engine.model_api import SeqView
    from ninfer_core.quant.kv import kv_format
    from ninfer_core.quant.transform import convert_encoding

    tmp = tempfile.mkdtemp(prefix="ninfer-drift-")
    src = build_tiny_artifact(os.path.join(tmp, "random.ninfer"), hidden=512, num_layers=4, vocab_size=2048,
                              dtype=torch.bfloat16, seed=3)

    def run(path, kv="bf16"):
        r = Qwen35Family().load(Artifact.open(path), dtype="float32", options=ap.Namespace(kv_dtype=kv_format(kv)))
        r.allocate_cache(4, 1, page_size=64)
        seq = SeqView(0, [0, 1, 2, 3], 0)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 2048, (tokens,), generator=g).tolist()
        out = [r.prefill(seq, ids)]  # [vocab]
        seq.num_cached = tokens
        for _ in range(steps):
            out.append(r.decode([seq], [int(out[-1].argmax())])[0])
            seq.num_cached += 1
        return torch.stack(out)

    base = run(src)
    lines = ["| random Qwen3.5 (hidden 512, 4 layers) | max abs drift / max abs logit | mean abs drift | top-1 agree |",
             "|---|---|---|---|"]
    cases = [(label, s, g, "bf16") for label, s, g in WEIGHTS[1:]] + [(f"KV {k}", None, None, k) for k in KV]
    for label, scheme, group, kv in cases:
        path = src
        if scheme:
            path = os.path.join(tmp, f"{label}.ninfer")
            convert_artifact(src, path, encoding=(convert_encoding(scheme, group), "bf16"))
        got = run(path, kv)
        d = (got - base).abs()
        agree = float((got.argmax(-1) == base.argmax(-1)).float().mean())
        lines.append(f"| {'weights ' + label if kv == 'bf16' else label} | {float(d.max() / base.abs().max()):.4f} | "
                     f"{float(d.mean()):.4f} | {agree:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--per-kind", type=int, default=10)
    p.add_argument("--prose-docs", type=int, default=20)
    p.add_argument("--out", default=None, help="directory for the converted artifacts (default: a temporary one)")
    p.add_argument("--skip-tiny", action="store_true")
    a = p.parse_args(argv)
    print(drift_table())
    if not a.skip_tiny:
        out = a.out or tempfile.mkdtemp(prefix="ninfer-quant-")
        print()
        print(tiny_table(a.per_kind, a.prose_docs, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
