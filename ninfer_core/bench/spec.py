"""`ninfer bench --spec ...`: speculative decoding measured in one run on one device.

- Round cost: a verify forward of K + 1 tokens per lane plus its commit, against a plain decode
  step, at each batch and K, for each GDN commit mode of the runner (recompute / positions), timed
  over the same lanes (CUDA Graphs as the engine uses them).
- Engine throughput with an oracle drafter: a plain engine run records each request's greedy
  output; the oracle then proposes that recorded continuation with each position replaced by
  another token with probability --oracle-corrupt (acceptance known: 1 - p per position), at no
  drafting cost, so the figure is what the round machinery delivers. Decode tok/s is the engine's
  committed decode tokens over its decode-round seconds (prefill excluded), plain and speculative
  in the same run.
- With --spec mtp: the model's own MTP head (random weights at a named shape, so its drafts are
  rarely accepted: the figure is the drafting cost), or an artifact's trained head (ninfer-tiny:
  chat prompts, real acceptance per draft position), through the same engine.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

CHAT_PROMPTS = ["What is 38 + 47?", "Hello", "What is your name?", "Count from 3 to 9.", "What is 61 + 29?",
                "What is 17 + 25?", "Count from 1 to 12.", "What is 90 + 9?"]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def add_spec_bench_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--spec", default=None, metavar="NAME",
                   help="also measure speculative rounds (several comma-separated: side by side): 'oracle' (the "
                        "recorded greedy continuation, corrupted), "
                        "or a backend (mtp) together with the oracle")
    g.add_argument("--spec-k", type=_ints, default=[3, 7], help="drafts per round to measure (comma-separated)")
    g.add_argument("--spec-batches", type=_ints, default=[1, 8], help="batch widths for the speculative rows")
    g.add_argument("--oracle-corrupt", type=float, default=0.2, help="probability the oracle replaces a draft")
    g.add_argument("--spec-tokens", type=int, default=128, help="tokens each engine request generates")
    g.add_argument("--spec-rounds", type=int, default=32, help="timed verify rounds per row of the round costs")
    g.add_argument("--verify-modes", default="recompute,positions",
                   help="GDN commit modes of the round-cost rows (a runner's verify_mode values)")
    g.add_argument("--spec-only", action="store_true",
                   help="skip the prefill / decode / transformers / HTTP parts of the bench")


def _sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _per_call_ms(torch, device, fn, warm: int, n: int) -> float:
    """Mean ms of `fn()` over n calls after `warm` untimed ones, the device synchronised around."""
    for _ in range(warm):
        fn()
    _sync(torch, device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(torch, device)
    return (time.perf_counter() - t0) / n * 1e3


# ---- round costs ----------------------------------------------------------------------------------------
def round_costs(torch, runner, a, vocab: int) -> dict:
    from ninfer_core.bench.run import Lanes, _prefill, _prompt
    from ninfer_core.engine.model_api import ForwardBatch, LaneSegment

    dev = runner.device
    groups = runner.cache_spec().group_names
    out: dict[str, Any] = {"decode_ms": {}, "rows": []}
    modes = [m for m in a.verify_modes.split(",") if m] if hasattr(runner, "verify_mode") else ["runner"]
    rng = random.Random(a.seed)
    rounds = 3 + a.spec_rounds + 4  # warm-up, timed, commit-timed
    ppl = -(-(a.decode_prompt + rounds * (max(a.spec_k) + 1) + 16) // 64)
    lanes = Lanes(runner, ppl)

    def fresh(b):
        views = lanes.views(b)
        for i, v in enumerate(views):
            _prefill(runner, v, _prompt(torch, a.decode_prompt, vocab, a.seed + 300 + i))
        return views

    for b in a.spec_batches:
        views = fresh(b)
        toks = [1] * b

        def step():
            nonlocal toks
            toks = runner.decode(views, toks).argmax(-1).tolist()
            for v in views:
                v.num_cached += 1

        out["decode_ms"][b] = _per_call_ms(torch, dev, step, 3, a.spec_rounds)
        for mode in modes:
            if mode != "runner":
                runner.verify_mode = mode
                runner._drop_verify_graphs()
            for k in a.spec_k:
                views = fresh(b)  # every row from the same context length

                def rnd(timed_commit: list | None = None):
                    segs = [LaneSegment(v.slot, {g: v.pages for g in groups}, v.num_cached,
                                        [rng.randrange(vocab) for _ in range(k + 1)], "verify", "all") for v in views]
                    outs = runner.forward(ForwardBatch(segs))
                    picks = [o.logits.argmax(-1).tolist() for o in outs]  # what the engine reads back
                    kept = [rng.randint(1, k + 1) for _ in views]
                    t1 = time.perf_counter()
                    runner.commit([(v.slot, n) for v, n in zip(views, kept)])
                    if timed_commit is not None:
                        _sync(torch, dev)
                        timed_commit.append(time.perf_counter() - t1)
                    for v, n in zip(views, kept):
                        v.num_cached += n
                    return picks

                ms = _per_call_ms(torch, dev, rnd, 3, a.spec_rounds)  # (the warm-up captures the graphs)
                commits: list = []
                for _ in range(4):
                    rnd(commits)
                out["rows"].append({"batch": b, "k": k, "mode": mode, "round_ms": ms,
                                    "commit_ms": statistics.median(commits) * 1e3,
                                    "vs_decode": ms / out["decode_ms"][b]})
                print(f"round b={b} K={k} {mode}: {ms:.2f} ms ({ms / out['decode_ms'][b]:.2f}x decode "
                      f"{out['decode_ms'][b]:.2f} ms)", flush=True)
    if "recompute" in modes:
        runner.verify_mode = "recompute"
        runner._drop_verify_graphs()
    return out


# ---- engine runs ------------------------------------------------------------------------------------------
def _engine_run(engine, requests) -> tuple[list, dict]:
    """(finish outcomes, counter deltas) of `requests` submitted together."""
    from ninfer_core.testing import collect

    before = dict(engine.snapshot()["counters"])

    async def go():
        hs = [engine.submit(r) for r in requests]
        return [await collect(h) for h in hs]

    outs = asyncio.run(go())
    after = engine.snapshot()["counters"]
    return outs, {k: after[k] - before.get(k, 0) for k in after}


def _rate(d: dict) -> float:
    return d["committed_decode_tokens"] / d["decode_seconds"] if d["decode_seconds"] > 0 else 0.0


def engine_runs(torch, runner, tok, a, device, prompts, ignore_eos=True, backend=None, base=None) -> dict:
    """Plain (recording each request's output) then the oracle at each K; or, given `backend` and
    the plain figures `base`, that backend at each K. Each at each batch width."""
    from ninfer_core.config import EngineOptions
    from ninfer_core.engine.api import GenerationRequest, SamplingParams
    from ninfer_core.engine.engine import Engine
    from ninfer_core.testing import OracleDrafter

    greedy = SamplingParams(temperature=0.0)
    longest = max(len(p) for p in prompts)
    ctx = longest + a.spec_tokens + 64
    lanes = max(a.spec_batches)
    res: dict[str, Any] = {"rows": []}

    def make(spec):
        runner.free_cache()
        opts = EngineOptions(max_context=ctx, kv_capacity=lanes * ctx, max_concurrency=lanes, prefill_chunk=2048,
                             device=str(device), cuda_graph=not a.no_cuda_graph)
        eng = Engine(runner, tok, opts, spec=spec)
        eng.start()
        return eng

    def reqs(b):
        return [GenerationRequest(prompt_ids=prompts[i % len(prompts)], sampling=greedy, max_tokens=a.spec_tokens,
                                  ignore_eos=ignore_eos, request_id=f"bench-{b}-{i}") for i in range(b)]

    if base is None:
        base = {"plain": {}, "recorded": {}}
        eng = make(None)
        try:
            for b in a.spec_batches:
                _engine_run(eng, reqs(b))  # warm-up
                outs, d = _engine_run(eng, reqs(b))
                base["plain"][b] = _rate(d)
                for r, o in zip(reqs(b), outs):
                    base["recorded"][tuple(r.prompt_ids)] = o.token_ids
                res["rows"].append({"drafter": "none", "batch": b, "k": 0, "tok_s": base["plain"][b],
                                    "vs_plain": 1.0})
                print(f"engine b={b} plain: {base['plain'][b]:,.1f} tok/s", flush=True)
        finally:
            eng.shutdown(timeout=60)
    res["base"] = base

    def continuation_of(recorded: dict):
        def continuation(history: list[int], n: int) -> list[int]:
            for prompt, out in recorded.items():
                if len(history) >= len(prompt) and tuple(history[: len(prompt)]) == prompt:
                    done = len(history) - len(prompt)
                    return out[done: done + n]
            return []
        return continuation

    runs = [(backend.name, k) for k in a.spec_k] if backend is not None else [("oracle", k) for k in a.spec_k]
    for name, k in runs:
        eng = None
        try:
            for b in a.spec_batches:
                if backend is None:
                    # The recording run verifies K + 1 rows a round like the measured one but accepts no
                    # draft (all corrupted): its greedy output is the one the measured run computes
                    # row for row (the same shapes, so the same kernels and rounding), where the plain
                    # engine's one-row decode can round a near-tie of a random-weight model otherwise.
                    spec = OracleDrafter(continuation_of(base["recorded"]), draft_tokens=k, corrupt=1.0,
                                         vocab_size=runner.info.vocab_size, seed=a.seed)
                    eng = eng or make(spec)
                    eng.spec = eng.rounds.backend = spec
                    outs, _ = _engine_run(eng, reqs(b))
                    recorded = {tuple(r.prompt_ids): o.token_ids for r, o in zip(reqs(b), outs)}
                    spec = OracleDrafter(continuation_of(recorded), draft_tokens=k, corrupt=a.oracle_corrupt,
                                         vocab_size=runner.info.vocab_size, seed=a.seed)
                    eng.spec = eng.rounds.backend = spec
                else:
                    backend.draft_tokens = k
                    eng = eng or make(backend)
                    recorded = base["recorded"]
                    _engine_run(eng, reqs(b))  # warm-up
                outs, d = _engine_run(eng, reqs(b))
                acc = d["draft_accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else 0.0
                per_round = 1 + d["draft_accepted_tokens"] / d["draft_rounds"] if d["draft_rounds"] else 0.0
                same = sum(o.token_ids == base["recorded"].get(tuple(r.prompt_ids)) for r, o in zip(reqs(b), outs))
                same_rec = sum(o.token_ids == recorded.get(tuple(r.prompt_ids)) for r, o in zip(reqs(b), outs))
                positions, rounds = [0] * k, 0
                for o in outs:
                    sp = o.finish.speculative or {}
                    rounds += sp.get("model_rounds", 0)
                    for i, n in enumerate(sp.get("accepted_per_position", [])[:k]):
                        positions[i] += n
                plain = base["plain"][b]
                row = {"drafter": name, "batch": b, "k": k, "tok_s": _rate(d), "vs_plain": _rate(d) / plain,
                       "acceptance": acc, "tokens_per_round": per_round, "same_as_plain": f"{same}/{b}",
                       "same_as_recording": f"{same_rec}/{b}",
                       "accepted_per_position": [round(n / rounds, 3) if rounds else 0.0 for n in positions]}
                res["rows"].append(row)
                print(f"engine b={b} {name} K={k}: {row['tok_s']:,.1f} tok/s ({row['vs_plain']:.2f}x plain), "
                      f"acceptance {acc:.3f}, {per_round:.2f} tokens/round, same output as plain {same}/{b}, "
                      f"as the width-{k + 1} recording {same_rec}/{b}, per position {row['accepted_per_position']}",
                      flush=True)
        finally:
            if eng is not None:
                eng.shutdown(timeout=60)
    return res


def draft_costs(torch, backend, runner, a, vocab) -> dict:
    """ms of one `propose` of K drafts for B lanes (the MTP chain), after warm-up."""
    from ninfer_core.bench.run import Lanes, _prefill, _prompt
    from ninfer_core.engine.spec import DraftLane

    dev = runner.device
    out = {}
    ppl = -(-(a.decode_prompt + max(a.spec_k) + 16) // 64)
    lanes = Lanes(runner, ppl)
    groups = runner.cache_spec().group_names
    for b in a.spec_batches:
        views = lanes.views(b)
        for i, v in enumerate(views):
            _prefill(runner, v, _prompt(torch, a.decode_prompt, vocab, a.seed + 500 + i))
        for k in a.spec_k:
            dl = [DraftLane(f"l{i}", v.slot, {g: v.pages for g in groups}, v.num_cached, 1, k) for i, v in enumerate(views)]
            out[f"b{b}_k{k}"] = _per_call_ms(torch, dev, lambda dl=dl: backend.propose(dl), 2, 8)
            print(f"{backend.name} drafts b={b} K={k}: {out[f'b{b}_k{k}']:.2f} ms per round", flush=True)
    return out


def run_spec_bench(torch, runner, family, art, a, device, res: dict) -> None:
    """The speculative part of `ninfer bench` (fills res["spec"])."""
    from ninfer_core.bench.text_tokenizer import covering_section, template_controls
    from ninfer_core.tokenizer import Tokenizer

    vocab = min(runner.info.vocab_size, 240000)
    spec: dict[str, Any] = {"oracle_corrupt": a.oracle_corrupt}
    res["spec"] = spec
    runner.allocate_cache(max(64, max(a.spec_batches) * 64), max(8, max(a.spec_batches)))
    spec["round_costs"] = round_costs(torch, runner, a, vocab)
    section = getattr(art, "tokenizer_section", None)
    tok = Tokenizer.from_section(section) if section else None
    template = getattr(art, "chat_template", None)
    trained = getattr(art, "path", "<random>") != "<random>"  # an artifact's weights, not random ones
    if tok is not None and template and trained:
        from ninfer_core.tokenizer.chat_template import ChatTemplate

        tpl = ChatTemplate(template)
        prompts = [tok.encode(tpl.render([{"role": "user", "content": q}])) for q in CHAT_PROMPTS]
        spec["prompts"], ignore_eos = "chat", False
    else:  # random weights: random prompts, a tokenizer in which every id has text
        from ninfer_core.bench.run import _prompt

        controls = template_controls(section or {}, "")  # random prompts render no markup: end tokens only
        tok = Tokenizer.from_section(covering_section(runner.info.vocab_size, controls))
        prompts = [_prompt(torch, a.decode_prompt, vocab, a.seed + 700 + i) for i in range(max(a.spec_batches))]
        spec["prompts"], ignore_eos = "random", True
    spec["engine"] = engine_runs(torch, runner, tok, a, device, prompts, ignore_eos)
    # each backend's own drafts (--spec mtp,dflash,dflash2: side by side), after the plain baseline
    from ninfer_core.plugins import PluginHost, PluginSelection

    for name in [n for n in (a.spec or "").split(",") if n and n != "oracle"]:
        host = PluginHost(PluginSelection.from_sources(a.plugin))
        cls = host.resolve_spec_backend(name).load()
        runner.free_cache()
        backend = cls.load(runner, art, argparse.Namespace(draft_tokens=max(a.spec_k)))
        runner.allocate_cache(max(64, max(a.spec_batches) * 64), max(8, max(a.spec_batches)))
        spec.setdefault("draft_ms", {})[name] = draft_costs(torch, backend, runner, a, vocab)
        got = engine_runs(torch, runner, tok, a, device, prompts, ignore_eos, backend, spec["engine"]["base"])
        spec["engine"]["rows"] += got["rows"]
    spec["engine"].pop("base", None)


def render_spec(res: dict) -> str:
    s = res.get("spec")
    if not s:
        return ""
    if "error" in s:
        return f"speculative rounds: failed ({s['error']})"
    lines = [f"speculative rounds (oracle corrupts each draft with p = {s['oracle_corrupt']})"]
    rc = s.get("round_costs", {})
    for b, ms in rc.get("decode_ms", {}).items():
        parts = [f"K={r['k']} {r['mode']} {r['round_ms']:.2f} ms ({r['vs_decode']:.2f}x, commit {r['commit_ms']:.2f})"
                 for r in rc.get("rows", []) if r["batch"] == b]
        lines.append(f"  b={b}: decode step {ms:.2f} ms; verify round " + "; ".join(parts))
    for name, per in (s.get("draft_ms") or {}).items():
        for k, ms in per.items():
            lines.append(f"  drafting {name} {k}: {ms:.2f} ms per round")
    lines.append(f"  {'drafter':<8} {'b':>2} {'K':>2} {'tok/s':>10} {'vs plain':>8} {'accept':>6} {'tok/rnd':>7} "
                 f"{'same':>5} {'same rec':>8}  accepted per position")
    for r in s.get("engine", {}).get("rows", []):
        lines.append(f"  {r['drafter']:<8} {r['batch']:>2} {r['k']:>2} {r['tok_s']:>10,.1f} {r['vs_plain']:>8.2f} "
                     f"{r.get('acceptance', 0):>6.3f} {r.get('tokens_per_round', 0):>7.2f} "
                     f"{r.get('same_as_plain', '-'):>5} {r.get('same_as_recording', '-'):>8}  "
                     f"{r.get('accepted_per_position', '')}")
    return "\n".join(lines)
