"""Quality of the weight encodings and KV dtypes against bf16, on the CPU (docs/quantization.md).

    OMP_NUM_THREADS=1 python scripts/quant_quality.py [--per-kind 50] [--prose-docs 10] [--out DIR]

ninfer-tiny (the trained artifact plugins/tiny ships), for each `ninfer convert --quantize` encoding
and each `--kv-dtype`: held-out prose perplexity (the qwen35 runner, offline) and the greedy task
accuracy of ninfer-tiny's evaluation (`ninfer_tiny.evaluate`: tool call, JSON, addition) through a
live `ninfer serve` with the openai client, plus the share of prompts whose greedy answer is the
same as bf16's. Random weights at the Qwen3.5-9B layer shape (`--drift-layers` of its layers, a
smaller vocab: see `drift_table`): logits drift against the unencoded model. One markdown table per
part.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

WEIGHTS = [("bf16", None, None), ("int8-g128", "int8", 128), ("fp8_e4m3-row", "fp8", None),
           ("int4-g128", "int4", 128), ("int4-g64", "int4", 64)]
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


def answer_key(message) -> str:
    """A greedy answer as text (content and parsed tool calls), to compare runs prompt by prompt."""
    calls = [(c.function.name, c.function.arguments) for c in (message.tool_calls or [])]
    return json.dumps([message.content or "", calls])


def served(artifact: str, samples, serve_args=(), max_tokens: int = 160) -> tuple[dict, list[str]]:
    """({kind: accuracy}, answers) of `samples` answered greedily by a `ninfer serve` of `artifact`."""
    from ninfer_tiny import evaluate as ev
    from openai import OpenAI

    proc, base = ev.start_server(artifact, serve_args)
    hits: dict[str, list[bool]] = {}
    answers = []
    try:
        with OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600) as client:
            model = client.models.list().data[0].id
            for s in samples:
                kw = {"tools": s.tools} if s.tools else {}
                r = client.chat.completions.create(model=model, messages=s.prompt_messages(), temperature=0,
                                                   max_tokens=max_tokens, **kw)  # fmt: skip
                msg = r.choices[0].message
                hits.setdefault(s.kind, []).append(ev.score_answer(s, msg))
                answers.append(answer_key(msg))
    finally:
        proc.terminate()  # SIGTERM stops at once (a single SIGINT asks for a confirming second one)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {k: sum(v) / len(v) for k, v in hits.items()}, answers


def tiny_table(per_kind: int, prose_docs: int, out_dir: str) -> str:
    import argparse as ap

    from ninfer_tiny import evaluate as ev
    from ninfer_tiny.data import eval_prompts

    from ninfer_core.quant.kv import kv_format

    samples = eval_prompts(1, per_kind)
    src = tiny_artifact()
    cases = [(f"weights {label}", scheme, group, "bf16") for label, scheme, group in WEIGHTS]
    cases += [(f"KV {name}", None, None, name) for name in KV]
    rows = []
    for label, scheme, group, kv in cases:
        t0 = time.monotonic()
        path = src
        if scheme:
            path = os.path.join(out_dir, f"tiny-{label.split()[-1]}.ninfer")
            convert(src, path, scheme, group)
        acc, answers = served(path, samples, () if kv == "bf16" else ("--kv-dtype", kv))
        opts = ap.Namespace(kv_dtype=kv_format(kv))
        acc.update(ev.offline_scores(path, [], prose_docs, options=opts))
        rows.append((label, os.path.getsize(path), acc, answers))
        print(f"  {label}: {acc} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    base = rows[0]
    n = len(samples)
    lines = ["| ninfer-tiny | file | prose ppl | vs bf16 | tool | JSON | addition | same answer as bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    for label, size, s, answers in rows:
        same = sum(a == b for a, b in zip(answers, base[3]))
        lines.append(f"| {label} | {size / 2**20:.1f} MiB | {s['ppl']:.2f} | {100 * (s['ppl'] / base[2]['ppl'] - 1):+.2f}% "
                     f"| {s.get('tool', 0):.2f} | {s.get('json', 0):.2f} | {s.get('addition', 0):.2f} | {same}/{n} |")
    return "\n".join(lines)


def drift_table(layers: int = 4, vocab: int = 32768, prompt: int = 32, chunks: int = 3, chunk: int = 16,
                steps: int = 8) -> str:
    """Logits drift of each encoding / KV dtype against the unencoded model, random weights at the
    Qwen3.5-9B shape cut to its first `layers` layers (3 GDN + 1 full attention per 4) and a
    `vocab`-row embedding and head (both stay bf16 under every encoding; the full 9B would need
    36 GB in fp32, past this CPU's memory). Each run: a `prompt`-token prefill, then `chunks`
    teacher-forced chunks of `chunk` tokens (they read the cached, possibly quantised, KV), then
    `steps` greedy decode steps fed the unencoded model's tokens; logits of every position compared."""
    import argparse as ap

    import torch
    from ninfer_qwen35.family import Qwen35Family
    from ninfer_qwen35.shapes import QWEN35_9B

    from ninfer_core.engine.model_api import SeqView
    from ninfer_core.quant.kv import kv_format
    from ninfer_core.quant.transform import convert_encoding

    cfg = dict(QWEN35_9B, num_hidden_layers=layers, vocab_size=vocab,
               layer_types=QWEN35_9B["layer_types"][:layers], eos_token_id=vocab - 1)
    fam = Qwen35Family()
    g = torch.Generator().manual_seed(0)
    total = prompt + chunks * chunk + steps
    ids = torch.randint(0, vocab, (total,), generator=g).tolist()

    def run(enc=None, kv="bf16", feed=None):
        art = fam.random_artifact(cfg, device="cpu", seed=3)
        opts = ap.Namespace(kv_dtype=kv_format(kv), quantize=enc)
        r = fam.load(art, device="cpu", dtype="float32", options=opts)
        r.allocate_cache(4, 1, page_size=64)
        seq = SeqView(0, [0, 1, 2, 3], 0)
        outs = []
        with torch.inference_mode():
            outs.append(r.prefill(seq, ids[:prompt], all_logits=True))
            seq.num_cached = prompt
            for c in range(chunks):
                part = ids[prompt + c * chunk: prompt + (c + 1) * chunk]
                outs.append(r.prefill(seq, part, all_logits=True))
                seq.num_cached += chunk
            toks = [] if feed is None else list(feed)
            for i in range(steps):
                nxt = int(outs[-1][-1].argmax()) if feed is None else feed[i]
                if feed is None:
                    toks.append(nxt)
                outs.append(r.decode([seq], [nxt]))
                seq.num_cached += 1
        del r
        return torch.cat([o.reshape(-1, vocab) for o in outs]), toks

    base, toks = run()
    head = (f"| random Qwen3.5-9B shape ({layers} layers, vocab {vocab}), {base.shape[0]} positions "
            "| max abs drift / max abs logit | mean abs drift / mean abs logit | top-1 agree |")
    lines = [head, "|---|---|---|---|"]
    cases = [(f"weights {label}", convert_encoding(s, grp), "bf16") for label, s, grp in WEIGHTS[1:]]
    cases += [(f"KV {k}", None, k) for k in KV]
    for label, enc, kv in cases:
        t0 = time.monotonic()
        got, _ = run(enc, kv, feed=toks)
        d = (got - base).abs()
        agree = float((got.argmax(-1) == base.argmax(-1)).float().mean())
        lines.append(f"| {label} | {float(d.max() / base.abs().max()):.4f} | "
                     f"{float(d.mean() / base.abs().mean()):.4f} | {agree:.3f} |")
        print(f"  {lines[-1]} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--per-kind", type=int, default=50, help="held-out prompts of each kind (tool, JSON, addition)")
    p.add_argument("--prose-docs", type=int, default=10, help="held-out prose documents (512 tokens each)")
    p.add_argument("--drift-layers", type=int, default=4)
    p.add_argument("--out", default=None, help="directory for the converted artifacts (default: a temporary one)")
    p.add_argument("--skip-tiny", action="store_true")
    p.add_argument("--skip-drift", action="store_true")
    a = p.parse_args(argv)
    if not a.skip_tiny:
        out = a.out or tempfile.mkdtemp(prefix="ninfer-quant-")
        print(tiny_table(a.per_kind, a.prose_docs, out), flush=True)
        print()
    if not a.skip_drift:
        print(drift_table(a.drift_layers), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
