"""`ninfer bench`: one run that measures the card's ceilings, NInfer's prefill / decode / TTFT,
transformers on the same weight tensors, the ratios between them, and the HTTP server's cost.

Every figure is measured in this run on this device; ratios compare figures of the same run.
Timings synchronise the device before reading the host clock, after warm-up runs (kernel
compilation, autotuning and CUDA-Graph capture stay out of the numbers), and report medians.
Decode steps include what the engine does per round: the forward, sampling on the device and
reading back only the sampled token ids.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

log = logging.getLogger("ninfer.bench")


def _ints(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()] if s.strip() else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"values must be >= 0, got {s!r}")
    return vals


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default=None,
                   help="model shape: a name the installed family plugins register (`ninfer plugins` "
                        "lists them; default: the one a plugin marks as default), random weights made on "
                        "the device, nothing written; or the path of a .ninfer artifact (its weights)")
    p.add_argument("--device", default="cuda", help="torch device (cuda, cuda:N; cpu only for smoke runs)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    p.add_argument("--prefill-lens", type=_ints, default=[512, 4096, 16384],
                   help="prompt lengths whose prefill rate is measured (one chunk each)")
    p.add_argument("--decode-batches", type=_ints, default=[1, 4, 8], help="decode batch widths (1..8)")
    p.add_argument("--decode-prompt", type=int, default=512, help="prompt tokens per lane before decode")
    p.add_argument("--decode-steps", type=int, default=64, help="timed decode steps per batch width")
    p.add_argument("--long-context", type=int, default=32768,
                   help="decode at batch 1 after this many context tokens (0 skips)")
    p.add_argument("--long-chunk", type=int, default=8192, help="prefill chunk used to fill the long context")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per prefill length (median)")
    p.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly instead of through CUDA Graphs")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    p.add_argument("--hf-prefill-lens", type=_ints, default=[4096], help="transformers prefill lengths")
    p.add_argument("--hf-decode-batches", type=_ints, default=[1, 8], help="transformers decode batch widths")
    p.add_argument("--hf-decode-steps", type=int, default=8, help="transformers timed decode steps")
    p.add_argument("--http-clients", type=_ints, default=[1, 8],
                   help="streaming client counts for the HTTP comparison (empty skips it)")
    p.add_argument("--http-tokens", type=int, default=128, help="tokens each HTTP/engine request generates")
    p.add_argument("--profile", action="store_true",
                   help="also print the device-kernel time of one decode step (batch 1, eager) and one "
                        "prefill of the largest --prefill-lens, by kernel, from torch.profiler")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the table as JSON here")
    p.add_argument("--quantize", choices=("int8", "int4", "fp8"), default=None,
                   help="encode the random model's projection weights as `ninfer convert --quantize` would "
                        "(decode floors count the packed bytes; default: none)")
    p.add_argument("--group-size", type=int, default=None, metavar="N",
                   help="input columns per scale with --quantize (default: 128, fp8 per row)")
    p.add_argument("--kv-dtype", choices=("bf16", "int8", "fp8", "k8v4"), default="bf16",
                   help="KV page format of the attention layers, as `ninfer serve --kv-dtype` (default: bf16)")
    p.add_argument("--plugin", action="append", default=[], metavar="NAME",
                   help="plugin to load (entry-point name or dotted module), as for `ninfer serve`")
    from ninfer_core.bench.replay import add_replay_arguments
    from ninfer_core.bench.spec import add_spec_bench_arguments

    add_replay_arguments(p)
    add_spec_bench_arguments(p)


# ---- timing and ceilings (ceilings.py) -------------------------------------------------------------
from ninfer_core.bench.ceilings import measure_ceilings
from ninfer_core.bench.ceilings import sync as _sync
from ninfer_core.bench.ceilings import timed as _timed


# ---- model facts -----------------------------------------------------------------------------------
def weight_facts(runner) -> dict:
    """Bytes one decode step reads (all weights but the embedding table; routed experts scaled to
    the share a step touches) and matmul FLOPs per prefill token (layer projections)."""
    from ninfer_core.quant.transform import named_weights, stored_bytes

    model = runner.model
    cfg = runner.cfg
    tied = model.lm_head.weight is model.embed_tokens.weight
    experts = int(getattr(cfg, "num_experts", 0) or 0)
    top_k = int(getattr(cfg, "num_experts_per_tok", 0) or getattr(cfg, "top_k_experts", 0) or 0)
    seen, total, expert_bytes, matmul_params = set(), 0, 0, 0
    for name, p in named_weights(model):  # encoded weights (--quantize) count their packed bytes
        key = id(p)
        if key in seen:
            continue
        seen.add(key)
        nbytes = stored_bytes(p)
        if name == "embed_tokens.weight" and not tied:
            continue
        if name.startswith("embed_tokens_per_layer."):  # a per-layer embedding table: a row per token
            continue
        if ".experts." in name:
            expert_bytes += nbytes
        else:
            total += nbytes
        if name.startswith("layers.") and p.dim() >= 2 and "conv1d" not in name:
            if ".experts." in name:
                matmul_params += p.numel() * top_k / max(1, experts)
            elif name.endswith("mlp.gate.weight"):
                matmul_params += p.numel()
            else:
                matmul_params += p.numel()
    return {
        "dense_bytes": total,
        "expert_bytes": expert_bytes,
        "experts": experts,
        "top_k": top_k,
        "matmul_flops_per_token": 2 * matmul_params,
        "params": sum(p.numel() for _, p in named_weights(model)),
    }


def kv_auto_tokens(runner, device) -> dict:
    """Tokens `--kv-capacity auto` would fit now (1 lane, 1 GiB headroom) per KV dtype the runner
    stores: the same free memory counted at each dtype's bytes per token."""
    from ninfer_core.engine.kv_sizing import auto_kv_capacity
    from ninfer_core.quant.kv import BF16, INT8, K8V4

    if not hasattr(runner, "kv_format"):
        return {}
    out, keep = {}, runner.kv_format
    try:
        for fmt in (BF16, INT8, K8V4):
            runner.kv_format = fmt
            try:
                out[fmt.name] = auto_kv_capacity(runner.cache_spec(), device, 1024, 1, 64)
            except ValueError:
                out[fmt.name] = 0
    finally:
        runner.kv_format = keep
    return out


def step_bytes(facts: dict, spec, batch: int, context: int, runner=None) -> float:
    """Bytes one decode step of `batch` lanes at `context` tokens must move. A lane's state slot is
    read and written whole (recurrent state), unless the runner says what a step touches of it
    (`decode_state_bytes(context)`: a sliding-window ring reads the window, not the whole ring)."""
    w = facts["dense_bytes"]
    if facts["expert_bytes"]:
        touched = min(facts["experts"], facts["top_k"] * batch) / facts["experts"]
        w += facts["expert_bytes"] * touched
    state = getattr(runner, "decode_state_bytes", None)
    per_lane = (state(context) if state is not None else 2 * spec.state_bytes) + context * spec.kv_bytes_per_token
    return w + batch * per_lane


# ---- NInfer measurements ----------------------------------------------------------------------------
class Lanes:
    """Sequences over disjoint pages and slots of the runner's pool (as the engine hands them out)."""

    def __init__(self, runner, pages_per_lane: int):
        self.runner, self.ppl = runner, pages_per_lane

    def views(self, n: int):
        from ninfer_core.engine.model_api import SeqView

        out = []
        for i in range(n):
            self.runner.reset_slot(i)
            out.append(SeqView(slot=i, pages=list(range(i * self.ppl, (i + 1) * self.ppl)), num_cached=0))
        return out


def _prompt(torch, n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _prefill(runner, view, tokens: list[int], chunk: int | None = None):
    chunk = chunk or len(tokens)
    logits = None
    for i in range(0, len(tokens), chunk):
        part = tokens[i : i + chunk]
        logits = runner.prefill(view, part)
        view.num_cached += len(part)
    return logits


def ninfer_prefill(torch, runner, lanes, lens, vocab, repeats, seed) -> dict:
    dev = runner.device
    out = {}
    for n in lens:
        toks = _prompt(torch, n, vocab, seed + n)

        def once():
            (v,) = lanes.views(1)
            _prefill(runner, v, toks)

        once()  # warm-up: compilation and autotuning at this length
        t = _timed(torch, dev, once, repeats)

        def ttft():
            (v,) = lanes.views(1)
            logits = _prefill(runner, v, toks)
            return int(logits.argmax())

        t_first = _timed(torch, dev, ttft, repeats)
        out[n] = {"tok_s": n / t, "seconds": t, "ttft_ms": t_first * 1e3}
    return out


def ninfer_decode(torch, runner, lanes, batch, prompt_len, steps, vocab, seed, context_chunk=None) -> dict:
    dev = runner.device
    views = lanes.views(batch)
    for i, v in enumerate(views):
        _prefill(runner, v, _prompt(torch, prompt_len, vocab, seed + 100 + i), context_chunk)
    toks = [1 + i for i in range(batch)]

    def step():
        nonlocal toks
        logits = runner.decode(views, toks)
        toks = logits.argmax(dim=-1).tolist()  # sampling on the device; only the ids come back
        for v in views:
            v.num_cached += 1

    for _ in range(3):  # warm-up (captures this width's graph)
        step()
    _sync(torch, dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(torch, dev)
    t = time.perf_counter() - t0
    return {"per_seq_tok_s": steps / t, "total_tok_s": batch * steps / t, "step_ms": t / steps * 1e3,
            "context": prompt_len + 3 + steps // 2}


def profile_kernels(torch, runner, lanes, prompt_len: int, prefill_len: int, vocab: int, seed: int,
                    steps: int = 8) -> dict:
    """Device-kernel time by kernel name for one eager decode step at batch 1 and one prefill of
    `prefill_len` tokens (torch.profiler); the decode graph's step time minus the kernel sum is the
    launch/gap overhead the graph leaves."""
    from torch.profiler import ProfilerActivity, profile

    def table(prof, div: int, top: int = 18):
        rows = []
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", None)
            if t is None:
                t = getattr(ev, "cuda_time_total", 0)
            if t and ev.device_type == torch.autograd.DeviceType.CUDA:
                rows.append((ev.key[:70], t / div / 1e3, ev.count / div))
        rows.sort(key=lambda r: -r[1])
        return {"total_ms": sum(r[1] for r in rows), "kernels_per_call": sum(r[2] for r in rows),
                "top": [{"kernel": k, "ms": ms, "count": c} for k, ms, c in rows[:top]]}

    out = {}
    (view,) = lanes.views(1)
    _prefill(runner, view, _prompt(torch, prompt_len, vocab, seed + 7))
    graphs = getattr(runner, "cuda_graph", False)
    if graphs:
        runner.cuda_graph = False  # eager for names; the captured graphs stay for later use
    try:
        tok = [1]
        for _ in range(2):
            runner.decode([view], tok)
            view.num_cached += 1
        _sync(torch, runner.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                runner.decode([view], tok)
                view.num_cached += 1
            _sync(torch, runner.device)
        out["decode_b1"] = table(prof, steps)
    finally:
        if graphs:
            runner.cuda_graph = True
    toks = _prompt(torch, prefill_len, vocab, seed + 11)
    (view,) = lanes.views(1)
    _prefill(runner, view, toks)
    _sync(torch, runner.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        (view,) = lanes.views(1)
        _prefill(runner, view, toks)
        _sync(torch, runner.device)
    out[f"prefill_{prefill_len}"] = table(prof, 1)
    return out


def _floor_cell(v: dict) -> str:
    """The read-stream floor (and, when the run measured it, the copy-bandwidth one)."""
    cell = f"{v['vs_floor']:.2f} of floor {v['floor_total_tok_s']:,.0f}"
    if "copy_floor_total_tok_s" in v:
        cell += f" ({v['vs_copy_floor']:.2f} of copy floor {v['copy_floor_total_tok_s']:,.0f})"
    return cell


def render_profile(prof: dict) -> str:
    lines = []
    for name, t in prof.items():
        lines.append(f"profile {name}: device kernels {t['total_ms']:.3f} ms per call, "
                     f"{t['kernels_per_call']:.0f} kernels per call")
        for r in t["top"]:
            lines.append(f"  {r['ms']:8.3f} ms  x{r['count']:<6.1f} {r['kernel']}")
    return "\n".join(lines)


# ---- transformers -------------------------------------------------------------------------------------
def hf_figures(torch, hf, runner, args, vocab) -> dict:
    dev = runner.device
    res: dict[str, Any] = {"prefill": {}, "decode": {}}
    import importlib.util

    res["gdn_kernel"] = "fla installed" if importlib.util.find_spec("fla") else "torch fallback (no fla)"
    with torch.inference_mode():
        for n in args.hf_prefill_lens:
            ids = torch.tensor([_prompt(torch, n, vocab, args.seed + n)], device=dev)

            def once():
                hf(input_ids=ids, use_cache=False, logits_to_keep=1)

            once()
            t = _timed(torch, dev, once, max(1, args.repeats - 1))
            res["prefill"][n] = {"tok_s": n / t, "ttft_ms": t * 1e3}
        for b in args.hf_decode_batches:
            ids = torch.tensor([_prompt(torch, args.decode_prompt, vocab, args.seed + 100 + i) for i in range(b)],
                               device=dev)
            out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1)

            def step():
                nonlocal out, nxt
                out = hf(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1].argmax(-1)
                nxt.tolist()

            step()
            _sync(torch, dev)
            t0 = time.perf_counter()
            for _ in range(args.hf_decode_steps):
                step()
            _sync(torch, dev)
            t = time.perf_counter() - t0
            res["decode"][b] = {"per_seq_tok_s": args.hf_decode_steps / t,
                                "total_tok_s": b * args.hf_decode_steps / t}
            del out, cache
    return res


# ---- the run -------------------------------------------------------------------------------------------
def _fmt(v, nd=1):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return str(v)


def run_bench(a: argparse.Namespace) -> int:
    if getattr(a, "conversations", False):  # the context-cache replay (ninfer_core.bench.replay)
        from ninfer_core.bench.replay import run_replay

        return run_replay(a)
    import torch

    from ninfer_core.bench.shapes import default_shape, shapes
    from ninfer_core.plugins import PluginError, PluginHost, PluginSelection

    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is visible (use --device cpu for a smoke run)",
              file=sys.stderr)
        return 1
    if any(b < 1 or b > 8 for b in a.decode_batches + a.hf_decode_batches + a.http_clients):
        print("error: batch widths and client counts must be 1..8", file=sys.stderr)
        return 1
    host = PluginHost(PluginSelection.from_sources(a.plugin))
    try:
        host.load()
    except PluginError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    SHAPES = shapes(host)
    if a.shape is None:
        a.shape = default_shape(host)
        if a.shape is None:
            print("error: no installed family plugin registers a bench shape: name an artifact with --shape",
                  file=sys.stderr)
            return 1

    if a.shape in SHAPES:
        hf_config = SHAPES[a.shape]
        arch = hf_config["model_type"]
    else:
        from ninfer_core.artifact import Artifact, ArtifactError

        try:
            art = Artifact.open(a.shape)
        except (ArtifactError, OSError) as e:
            print(f"error: --shape is neither a known shape ({', '.join(SHAPES)}) nor a readable artifact: {e}",
                  file=sys.stderr)
            return 1
        hf_config, arch = art.config, art.architecture
    try:
        reg = host.family_for_architecture(arch)
    except PluginError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    target = reg.load()
    family = target() if isinstance(target, type) else target
    if a.shape in SHAPES:
        if not hasattr(family, "random_artifact"):
            print(f"error: model family {reg.name!r} cannot build random weights", file=sys.stderr)
            return 1
        kw = {"mtp": True} if a.spec not in (None, "oracle") else {}  # the MTP head's weights too
        art = family.random_artifact(hf_config, device=str(device), seed=a.seed, **kw)

    res: dict[str, Any] = {"shape": a.shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                           else "cpu", "torch": torch.__version__, "cuda_graph": not a.no_cuda_graph}
    t0 = time.perf_counter()
    res["ceilings"] = ceil = measure_ceilings(torch, device)
    print(f"ceilings: read {ceil['read_bandwidth_GBps']:,.0f} GB/s, copy {ceil['copy_bandwidth_GBps']:,.0f} GB/s, "
          f"matmul {ceil['matmul_TFLOPs']:,.1f} TFLOP/s", flush=True)
    load_opts = argparse.Namespace()
    if getattr(a, "quantize", None):
        from ninfer_core.quant.transform import convert_encoding

        load_opts.quantize = convert_encoding(a.quantize, a.group_size)
        res["quantize"] = load_opts.quantize.name
    if getattr(a, "kv_dtype", "bf16") != "bf16":
        from ninfer_core.quant.kv import kv_format

        load_opts.kv_dtype = kv_format(a.kv_dtype)
        res["kv_dtype"] = a.kv_dtype
    runner = family.load(art, device=str(device), options=load_opts)
    res["kv_auto_tokens"] = kv_auto_tokens(runner, device)
    # forwards of at most the engine's default prefill chunk per lane, as `ninfer serve` runs them (a
    # runner whose per-lane cache depends on it, a sliding-window ring, splits longer prefills)
    from ninfer_core.config import EngineOptions
    from ninfer_core.engine.model_api import RunnerOptions

    runner.configure(RunnerOptions(cuda_graph=not a.no_cuda_graph, max_lanes=max(a.decode_batches or [1]),
                                   max_segment_tokens=EngineOptions().prefill_chunk))
    print(f"model built in {time.perf_counter() - t0:.1f} s", flush=True)
    spec = runner.cache_spec()
    facts = weight_facts(runner)
    res["model"] = {k: v for k, v in facts.items()}
    vocab = min(runner.info.vocab_size, 240000)
    steps = a.decode_steps
    max_decode_b = max(a.decode_batches or [1])
    ps = 64
    ppl = -(-(a.decode_prompt + steps + 8) // ps)
    profile_len = max(a.prefill_lens or [512]) if a.profile else 0  # --profile's prefill (long lanes)
    long_pages = -(-(max(a.long_context, max(a.prefill_lens or [0]), profile_len) + steps + 8) // ps)
    pages = max(max_decode_b * ppl, long_pages) + 1
    runner.allocate_cache(pages, max(8, max_decode_b))
    lanes = Lanes(runner, ppl)
    long_lanes = Lanes(runner, long_pages)

    if a.spec_only:
        from ninfer_core.bench.spec import render_spec, run_spec_bench

        run_spec_bench(torch, runner, family, art, a, device, res)
        print(render_spec(res), flush=True)
        _write_json(a, res)
        return 0
    # the decode floor: a step's bytes at the read-only stream rate (it writes almost nothing); the
    # copy-bandwidth floor (read + write) is reported beside it, as earlier runs quoted it
    bw = ceil["read_bandwidth_GBps"] * 1e9
    copy_bw = ceil["copy_bandwidth_GBps"] * 1e9
    mm_tok_s = ceil["matmul_TFLOPs"] * 1e12 / facts["matmul_flops_per_token"]
    pre = ninfer_prefill(torch, runner, long_lanes, a.prefill_lens, vocab, a.repeats, a.seed)
    res["prefill"] = {n: dict(v, vs_matmul=v["tok_s"] / mm_tok_s) for n, v in pre.items()}
    res["matmul_only_prefill_tok_s"] = mm_tok_s
    print("prefill:", {n: round(v["tok_s"]) for n, v in pre.items()}, flush=True)
    dec = {}
    for b in a.decode_batches:
        d = ninfer_decode(torch, runner, lanes, b, a.decode_prompt, steps, vocab, a.seed)
        sb = step_bytes(facts, spec, b, d["context"], runner)
        floor, copy_floor = b * bw / sb, b * copy_bw / sb
        dec[b] = dict(d, floor_total_tok_s=floor, vs_floor=d["total_tok_s"] / floor,
                      copy_floor_total_tok_s=copy_floor, vs_copy_floor=d["total_tok_s"] / copy_floor)
        print(f"decode b={b}: {d['total_tok_s']:,.1f} tok/s total", flush=True)
    res["decode"] = dec
    if a.long_context:
        d = ninfer_decode(torch, runner, long_lanes, 1, a.long_context, steps, vocab, a.seed, a.long_chunk)
        sb = step_bytes(facts, spec, 1, d["context"], runner)
        res["decode_long"] = dict(d, floor_total_tok_s=bw / sb, vs_floor=d["total_tok_s"] * sb / bw,
                                  copy_floor_total_tok_s=copy_bw / sb, vs_copy_floor=d["total_tok_s"] * sb / copy_bw)
        print(f"decode after {a.long_context}: {d['total_tok_s']:,.1f} tok/s", flush=True)

    if a.profile:
        try:
            res["profile"] = profile_kernels(torch, runner, long_lanes, a.decode_prompt,
                                             max(a.prefill_lens or [512]), vocab, a.seed)
            print(render_profile(res["profile"]), flush=True)
            from ninfer_core.bench.ceilings import linear_rates, render_linear_rates

            res["linear_rates"] = linear_rates(torch, runner.model, device, runner.model.embed_tokens.weight.dtype,
                                               read_GBps=ceil["read_bandwidth_GBps"])
            print(render_linear_rates(res["linear_rates"]), flush=True)
        except Exception as e:  # noqa: BLE001 - a profiler failure must not lose the table
            res["profile"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"profile failed: {res['profile']['error']}", flush=True)

    if not a.no_hf and hasattr(family, "transformers_model"):
        try:
            hf = family.transformers_model(runner, hf_config)
            res["transformers"] = hf_figures(torch, hf, runner, a, vocab)
            del hf
        except Exception as e:  # noqa: BLE001 - the comparison is reported as missing, the run goes on
            res["transformers"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if a.http_clients:
        try:
            from ninfer_core.bench.http_compare import http_vs_engine

            res["http"] = http_vs_engine(runner, family, art, host, a, device)
        except Exception as e:  # noqa: BLE001
            res["http"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}

    if a.spec:
        from ninfer_core.bench.spec import run_spec_bench

        try:
            run_spec_bench(torch, runner, family, art, a, device, res)
        except Exception as e:  # noqa: BLE001 - reported in the table, the run's other figures stay
            res["spec"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"speculative part failed: {res['spec']['error']}", flush=True)
    table = render_table(res)
    print(table, flush=True)
    _write_json(a, res)
    return 0


def _write_json(a, res: dict) -> None:
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


def render_table(res: dict) -> str:
    hf = res.get("transformers") or {}
    hf_pre, hf_dec = hf.get("prefill", {}), hf.get("decode", {})
    rows = [("figure", "NInfer", "transformers", "NInfer/tf", "vs ceiling")]
    for n, v in res.get("prefill", {}).items():
        h = hf_pre.get(n, {}).get("tok_s")
        rows.append((f"prefill {n} tok/s", _fmt(v["tok_s"], 0), _fmt(h, 0),
                     _fmt(v["tok_s"] / h, 2) if h else "-", f"{v['vs_matmul']:.2f} of matmul-only"))
    for n, v in res.get("prefill", {}).items():
        h = hf_pre.get(n, {}).get("ttft_ms")
        rows.append((f"TTFT {n} ms", _fmt(v["ttft_ms"], 1), _fmt(h, 1), _fmt(h / v["ttft_ms"], 2) if h else "-", ""))
    for b, v in res.get("decode", {}).items():
        h = hf_dec.get(b, {})
        rows.append((f"decode b={b} tok/s/seq", _fmt(v["per_seq_tok_s"]), _fmt(h.get("per_seq_tok_s")), "", ""))
        ht = h.get("total_tok_s")
        rows.append((f"decode b={b} tok/s total", _fmt(v["total_tok_s"]), _fmt(ht),
                     _fmt(v["total_tok_s"] / ht, 2) if ht else "-",
                     _floor_cell(v)))
    dec = res.get("decode", {})
    if 1 in dec and 8 in dec:
        rows.append(("decode b=8 / b=1 total", _fmt(dec[8]["total_tok_s"] / dec[1]["total_tok_s"], 2), "", "", ""))
    if "decode_long" in res:
        v = res["decode_long"]
        rows.append((f"decode b=1 after {v['context']} tok/s", _fmt(v["total_tok_s"]), "", "", _floor_cell(v)))
    http = res.get("http") or {}
    for k, v in http.items():
        if isinstance(k, int) or str(k).isdigit():
            rows.append((f"HTTP {k} streams tok/s", _fmt(v["http_tok_s"]), f"engine {_fmt(v['engine_tok_s'])}",
                         "", f"{v['ratio']:.2f} of bare engine"))
    c = res.get("ceilings", {})
    head = (f"ninfer bench  shape={res.get('shape')}  device={res.get('device')}  torch={res.get('torch')}  "
            f"cuda_graph={res.get('cuda_graph')}\n"
            f"ceilings: read {c.get('read_bandwidth_GBps', 0):,.0f} GB/s (read-only stream), copy "
            f"{c.get('copy_bandwidth_GBps', 0):,.0f} GB/s (read+write), bf16 matmul "
            f"{c.get('matmul_TFLOPs', 0):,.1f} TFLOP/s; matmul-only prefill "
            f"{res.get('matmul_only_prefill_tok_s', 0):,.0f} tok/s\n")
    widths = [max(len(str(r[i])) for r in rows) for i in range(5)]
    lines = ["  ".join(str(r[i]).ljust(widths[i]) for i in range(5)).rstrip() for r in rows]
    tail = []
    if "error" in hf:
        tail.append(f"transformers: {hf['error']}")
    elif hf:
        tail.append(f"transformers GDN kernel: {hf.get('gdn_kernel')}")
    if "error" in http:
        tail.append(f"HTTP: {http['error']}")
    elif http.get("tokenizer", "artifact") != "artifact":
        tail.append(f"HTTP tokenizer: {http['tokenizer']}")
    from ninfer_core.bench.spec import render_spec

    spec = render_spec(res)
    return head + "\n".join(lines) + ("\n" + "\n".join(tail) if tail else "") + ("\n" + spec if spec else "")
