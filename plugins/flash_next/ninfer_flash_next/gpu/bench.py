"""H200 bench of Flash-Next at the real widths (`python -m ninfer_flash_next.gpu.bench`).

One run: the host-to-device (pinned; whole GiB and one expert's bytes a copy) and device copy
bandwidths; NInfer prefill and decode with the experts on the device; transformers' qwen4_exp on the
same weights (shared tensors) for prefill and decode, and the bf16 logits' distance between the two;
then NInfer decode with the experts in pinned host memory through the device expert cache, against
the rate the measured host-to-device bandwidth allows for the expert bytes it copied per token.

Every rate is the median of --repeats timed runs after a warm-up run (Triton compiles and fla
autotunes on the first); a decode rate's runs are consecutive windows of --decode-steps after one
prefill and one warm-up step. The device model is the first --layers layers (shapes.bench_config; `max`:
the most multiples of 4 whose weights fit the free device memory, shapes.model_bytes); the host
model the first --host-layers (its banks are pinned host memory). The real 48 layers do not fit
one H200 with the experts on the device (the table says the bytes), so the table also gives the
decode rate scaled to 48 layers: per-token time x 48 / layers (the embedding and lm_head's fixed
share counted 48 / layers times: the estimate errs low). transformers runs when its qwen4_exp has
indexed_attention layers (5.24; --tf-site / NINFER_TF_SITE puts a folder holding it first on
sys.path). --json PATH writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

GiB = 1 << 30


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_rate(fn, repeats: int, warmup: int = 1):
    """(median of fn()'s rates over `repeats` runs after `warmup` untimed ones, every rate, last result)."""
    for _ in range(warmup):
        fn()
    rates, out = [], None
    for _ in range(repeats):
        rate, out = fn()
        rates.append(rate)
    return statistics.median(rates), rates, out


def bandwidths(dev, expert_bytes: int, repeats: int = 5) -> dict:
    """Pinned host->device copy rates (1 GiB copies, and copies of one expert's bytes as the expert
    cache makes them) and the device copy rate (read + write), each the median of `repeats`."""
    n = GiB if dev.type == "cuda" else 1 << 24
    host = torch.empty(n, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    d = torch.empty(n, dtype=torch.uint8, device=dev)
    d2 = torch.empty_like(d)

    def timed(fn, nbytes):
        fn()
        _sync()
        rates = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            _sync()
            rates.append(nbytes / (time.perf_counter() - t))
        return statistics.median(rates)

    h2d = timed(lambda: d.copy_(host, non_blocking=True), n)
    chunk = max(1, min(expert_bytes, n))
    k = n // chunk

    def chunks():
        for i in range(k):
            d[i * chunk:(i + 1) * chunk].copy_(host[i * chunk:(i + 1) * chunk], non_blocking=True)

    h2d_expert = timed(chunks, k * chunk)
    dd = timed(lambda: d2.copy_(d), 2 * n)
    return {"h2d_GBps": h2d / 1e9, "h2d_expert_GBps": h2d_expert / 1e9, "expert_bytes": expert_bytes,
            "device_copy_GBps": dd / 1e9}


def ours_prefill(r, tokens, slot=0, all_logits=False) -> tuple[float, torch.Tensor]:
    from ninfer_core.engine.model_api import SeqView

    r.reset_slot(slot)
    pages = list(range(-(-len(tokens) // 64) + 1))
    _sync()
    t = time.perf_counter()
    out = r.prefill(SeqView(slot, pages, 0), tokens, all_logits=all_logits)
    _sync()
    return len(tokens) / (time.perf_counter() - t), out


def ours_decode(r, prompt, steps, windows: int = 1, snap=None):
    """Greedy decode after one prefill of `prompt`: a warm-up step, then `windows` timed windows of
    `steps` steps each, one after the other -> (tok/s of each window, every token, snap() at each
    window's start and end)."""
    from ninfer_core.engine.model_api import SeqView

    r.reset_slot(0)
    pages = list(range(-(-(len(prompt) + steps * windows + 2) // 64) + 1))
    seq = SeqView(0, pages, 0)
    got = [int(r.prefill(seq, prompt).argmax())]
    seq.num_cached = len(prompt)
    got.append(int(r.decode([seq], [got[-1]])[0].argmax()))  # warm-up step
    seq.num_cached += 1
    rates, snaps = [], []
    for _ in range(windows):
        _sync()
        snaps.append(snap() if snap is not None else None)
        t = time.perf_counter()
        for _ in range(steps):
            got.append(int(r.decode([seq], [got[-1]])[0].argmax()))
            seq.num_cached += 1
        _sync()
        rates.append(steps / (time.perf_counter() - t))
        snaps.append(snap() if snap is not None else None)
    return rates, got, snaps


@torch.no_grad()
def hf_figures(hf, tokens, prompt, steps, repeats) -> dict:
    dev = next(hf.parameters()).device
    ids = torch.tensor([tokens], device=dev)

    def prefill():
        _sync()
        t = time.perf_counter()
        logits = hf(ids).logits[0]
        _sync()
        return len(tokens) / (time.perf_counter() - t), logits

    hf(ids[:, :64])
    pre, pre_all, logits = _median_rate(prefill, repeats, warmup=0)

    def decode():
        out = hf(torch.tensor([prompt], device=dev), use_cache=True)
        cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
        nxt = out.logits[:, -1:].argmax(-1)
        _sync()
        t = time.perf_counter()
        for _ in range(steps):
            out = hf(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        _sync()
        return steps / (time.perf_counter() - t), None

    dec, dec_all, _ = _median_rate(decode, repeats)
    return {"prefill_tok_s": pre, "prefill_runs": pre_all, "decode_tok_s": dec, "decode_runs": dec_all,
            "logits": logits.float()}


def fit_layers(free_bytes: int, reserve: int) -> int:
    """The most layers (a multiple of 4, <= 48) whose bf16 weights fit `free_bytes - reserve`."""
    from ninfer_flash_next.shapes import bench_config, model_bytes

    for n in range(48, 0, -4):
        if sum(model_bytes(bench_config(n)).values()) + reserve <= free_bytes:
            return n
    return 4


def _import_transformers(site: str | None):
    """transformers' qwen4_exp with indexed_attention layers, from `site` first when given; returns
    (version or None, why not)."""
    if site:
        sys.path.insert(0, site)
    try:
        import transformers
        from transformers.models.qwen4_exp import configuration_qwen4_exp  # noqa: F401
    except Exception as e:  # noqa: BLE001 - reported in the table
        return None, f"transformers without qwen4_exp ({type(e).__name__}: {str(e)[:120]})"
    return transformers.__version__, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="4", help="device-expert model layers: a number or max (what fits)")
    ap.add_argument("--host-layers", type=int, default=4, help="host-expert model layers (pinned host banks)")
    ap.add_argument("--prefill", type=int, default=4096, help="NInfer prefill tokens (past the dense threshold: "
                    "its decode row is the sparse path)")
    ap.add_argument("--hf-prefill", type=int, default=1024, help="prefill tokens of both (transformers' indexer "
                    "loops over queries in Python)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--hf-decode-steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per figure (the median is reported)")
    ap.add_argument("--hf-repeats", type=int, default=3)
    ap.add_argument("--host-cache-mib", type=int, default=4096)
    ap.add_argument("--reserve-gib", type=float, default=16, help="device memory kept free by --layers max")
    ap.add_argument("--tf-site", default=os.environ.get("NINFER_TF_SITE") or None,
                    help="a folder with transformers >= 5.24 put first on sys.path")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-host", action="store_true")
    ap.add_argument("--budget-s", type=float, default=0, help="seconds for the whole run (0: none): transformers "
                    "is skipped past 0.6 of it, the host part past 0.8 (the table still prints)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="the tiny test model on the CPU (checks the script)")
    a = ap.parse_args(argv)
    from ninfer_flash_next.family import FlashNextFamily
    from ninfer_flash_next.shapes import FLASH_NEXT, bench_config, model_bytes

    dev = torch.device("cpu" if a.smoke else "cuda")
    t_all = time.perf_counter()
    if a.smoke:
        from ninfer_flash_next.testing import tiny_config

        layers, host_layers = 4, 4
        cfg = host_cfg = tiny_config()
    else:
        if a.layers == "max":
            free, _ = torch.cuda.mem_get_info(dev)
            layers = fit_layers(free, int(a.reserve_gib * GiB))
        else:
            layers = int(a.layers)
        host_layers = a.host_layers
        cfg, host_cfg = bench_config(layers), bench_config(host_layers)
    fam = FlashNextFamily()
    inter, hidden = cfg["moe_intermediate_size"], cfg["hidden_size"]
    expert_bytes = 3 * inter * hidden * 2
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "layers": layers,
           "host_layers": host_layers, "repeats": a.repeats, "torch": torch.__version__,
           "bytes": {"measured": model_bytes(cfg), "real_48": model_bytes(FLASH_NEXT)}}
    if dev.type == "cuda":
        res["device_memory_GiB"] = torch.cuda.get_device_properties(dev).total_memory / GiB
    res["bandwidth"] = bw = bandwidths(dev, expert_bytes)
    print(f"bandwidth: host->device {bw['h2d_GBps']:.1f} GB/s (1 GiB copies), {bw['h2d_expert_GBps']:.1f} GB/s "
          f"({expert_bytes / 1e6:.1f} MB copies), device copy {bw['device_copy_GBps']:.0f} GB/s", flush=True)
    hf_version, hf_why = (None, "--no-hf") if a.no_hf else _import_transformers(a.tf_site)
    res["transformers_version"] = hf_version
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, min(240000, cfg["vocab_size"]), (max(a.prefill, a.hf_prefill),), generator=g).tolist()
    prompt = tokens[: a.prompt]
    art = fam.random_artifact(cfg, device=str(dev), seed=0)
    t = time.perf_counter()
    r = fam.load(art, device=str(dev))
    pages = -(-(max(a.prefill, a.prompt) + a.decode_steps * a.repeats + 2) // 64) + 2
    r.allocate_cache(pages, 2)
    print(f"device-expert model ({layers} layers) built in {time.perf_counter() - t:.0f} s", flush=True)
    ours_prefill(r, tokens[:256])  # warm-up (Triton / fla autotune)
    res["prefill_tok_s"], res["prefill_runs"], _ = _median_rate(
        lambda: ours_prefill(r, tokens[: a.prefill]), a.repeats)
    res["prefill_hf_len_tok_s"], res["prefill_hf_len_runs"], _ = _median_rate(
        lambda: ours_prefill(r, tokens[: a.hf_prefill]), a.repeats, warmup=0)
    our_logits = ours_prefill(r, tokens[: a.hf_prefill], all_logits=True)[1]
    runs, dev_tokens, _ = ours_decode(r, prompt, a.decode_steps, a.repeats)
    res["decode_tok_s"], res["decode_runs"] = statistics.median(runs), runs
    runs, _, _ = ours_decode(r, tokens[: a.prefill], a.decode_steps, a.repeats)
    res["decode_long_tok_s"], res["decode_long_runs"] = statistics.median(runs), runs
    print(f"NInfer: prefill {res['prefill_tok_s']:.0f} tok/s ({a.prefill}), decode {res['decode_tok_s']:.1f} tok/s "
          f"after {a.prompt}, {res['decode_long_tok_s']:.1f} after {a.prefill} ({time.perf_counter() - t_all:.0f} s)",
          flush=True)
    def over(frac):
        return a.budget_s > 0 and time.perf_counter() - t_all > frac * a.budget_s

    if hf_version is None or over(0.6):
        res["transformers"] = {"error": hf_why or f"skipped: past 0.6 of --budget-s {a.budget_s:.0f}"}
    else:
        try:
            hf = fam.transformers_model(r, cfg)
            h = hf_figures(hf, tokens[: a.hf_prefill], prompt, a.hf_decode_steps, a.hf_repeats)
            ref = h.pop("logits")
            h["bf16_logits_rel_err"] = float((our_logits - ref).abs().max() / ref.abs().max())
            res["transformers"] = h
            del hf, ref
        except Exception as e:  # noqa: BLE001 - reported in the table, the host part still runs
            res["transformers"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"transformers done ({time.perf_counter() - t_all:.0f} s)", flush=True)
    r = our_logits = None  # the device model's memory back before the host part
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if over(0.8):
        res["host_skipped"] = f"past 0.8 of --budget-s {a.budget_s:.0f}"
    elif not a.no_host:
        res["host"] = host_part(fam, host_cfg, dev, a, prompt, bw, dev_tokens if host_layers == layers else None)
    print(table(res, a), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


def host_part(fam, cfg, dev, a, prompt, bw, dev_tokens) -> dict:
    """Decode with the experts in pinned host memory through the device cache, against the bound the
    measured host->device rate (at one expert's bytes a copy) sets for the bytes copied per token."""
    art = fam.random_artifact(cfg, device=str(dev), seed=0)
    opts = SimpleNamespace(expert_residency="host", expert_cache_mib=a.host_cache_mib)
    t = time.perf_counter()
    r = fam.load(art, device=str(dev), options=opts)
    r.allocate_cache(-(-(a.prompt + a.decode_steps * a.repeats + 2) // 64) + 2, 2)
    print(f"host-expert model ({cfg['num_hidden_layers']} layers) built in {time.perf_counter() - t:.0f} s",
          flush=True)
    ours_decode(r, prompt, 4)
    rates, host_tokens, snaps = ours_decode(r, prompt, a.decode_steps, a.repeats, snap=lambda: r.counters()["experts"])
    runs = []
    for rate, before, after in zip(rates, snaps[::2], snaps[1::2]):
        runs.append((rate, after["transferred_bytes"] - before["transferred_bytes"], after["routes"] - before["routes"],
                     after["hits"] - before["hits"]))
    rate = statistics.median(x[0] for x in runs)
    moved = sum(x[1] for x in runs) / (a.repeats * a.decode_steps)
    routes, hits = sum(x[2] for x in runs), sum(x[3] for x in runs)
    bound = bw["h2d_expert_GBps"] * 1e9 / moved if moved else float("inf")
    if dev_tokens is None:  # another layer count than the device model: its own greedy reference
        r = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        r = fam.load(art, device=str(dev))
        r.allocate_cache(-(-(a.prompt + a.decode_steps * a.repeats + 2) // 64) + 2, 2)
        dev_tokens = ours_decode(r, prompt, a.decode_steps, a.repeats)[1]
    r = None
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"decode_tok_s": rate, "decode_runs": [x[0] for x in runs], "cache_mib": a.host_cache_mib,
            "layers": cfg["num_hidden_layers"], "hit_rate": hits / routes if routes else None,
            "bytes_per_token": moved, "bandwidth_bound_tok_s": bound, "vs_bound": rate / bound if moved else None,
            "greedy_equal_to_device": host_tokens == dev_tokens}


def table(res: dict, a) -> str:
    hf = res.get("transformers") or {}
    host = res.get("host")
    n = res["layers"]

    def f(v, d=1):
        return "-" if v is None else f"{v:,.{d}f}"

    def spread(runs):
        return f"{min(runs):,.1f}-{max(runs):,.1f}" if runs else "-"

    def ratio(x, y):
        return f(x / y, 2) if x and y else "-"

    rows = [("figure", "NInfer", "runs", "transformers", "NInfer/tf"),
            (f"prefill {a.hf_prefill} tok/s", f(res["prefill_hf_len_tok_s"], 0), spread(res["prefill_hf_len_runs"]),
             f(hf.get("prefill_tok_s"), 0), ratio(res["prefill_hf_len_tok_s"], hf.get("prefill_tok_s"))),
            (f"prefill {a.prefill} tok/s", f(res["prefill_tok_s"], 0), spread(res["prefill_runs"]), "-", "-"),
            (f"decode b1 tok/s after {a.prompt} (device experts)", f(res["decode_tok_s"]), spread(res["decode_runs"]),
             f(hf.get("decode_tok_s")), ratio(res["decode_tok_s"], hf.get("decode_tok_s"))),
            (f"decode b1 tok/s after {a.prefill} (sparse attention)", f(res["decode_long_tok_s"]),
             spread(res["decode_long_runs"]), "-", "-"),
            (f"  scaled to 48 layers (x {n}/48)", f(res["decode_tok_s"] * n / 48),
             "-", f(hf["decode_tok_s"] * n / 48) if hf.get("decode_tok_s") else "-", "-")]
    if host:
        rows.append((f"decode b1 tok/s (host experts, {host['layers']} layers)", f(host["decode_tok_s"]),
                     spread(host["decode_runs"]), "-", "-"))
    w = [max(len(r[i]) for r in rows) for i in range(5)]
    b = res["bytes"]
    gib = 1 << 30
    real = b["real_48"]
    shape = "the tiny test model (--smoke)" if a.smoke else f"first {n} of 48 layers, real widths, bf16"
    lines = [(f"flash-next bench  {res['device']}  {shape}, median of {res['repeats']} runs; transformers "
              f"{res.get('transformers_version') or '-'}")]
    lines += ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    mem = res.get("device_memory_GiB")
    whole = (real["experts"] + real["dense"]) / gib
    fits = "-" if mem is None else ("fit" if whole <= mem else "do not fit")
    lines.append(f"weights (bf16): {n} layers {sum(b['measured'].values()) / gib:,.1f} GiB (experts "
                 f"{b['measured']['experts'] / gib:,.1f}, n-gram table of the bench's 200k-prime vocabulary "
                 f"{b['measured']['ngram'] / gib:,.1f}); all 48 layers {whole:,.1f} GiB (experts "
                 f"{real['experts'] / gib:,.1f}) + the real n-gram table {real['ngram'] / gib:,.1f} GiB; device "
                 f"{f(mem, 0)} GiB: 48 layers with experts on device {fits}")
    if res.get("host_skipped"):
        lines.append(f"host experts: skipped, {res['host_skipped']}")
    if host:
        bw = res["bandwidth"]
        lines.append(f"host experts: cache {host['cache_mib']} MiB, hit rate {f(host['hit_rate'], 3)}, "
                     f"{host['bytes_per_token'] / 1e6:,.1f} MB/token over host->device {bw['h2d_expert_GBps']:.1f} "
                     f"GB/s ({bw['expert_bytes'] / 1e6:.1f} MB copies; {bw['h2d_GBps']:.1f} at 1 GiB) -> bound "
                     f"{f(host['bandwidth_bound_tok_s'])} tok/s, measured {f(host['vs_bound'], 2)} of it; greedy "
                     f"equal to device: {host['greedy_equal_to_device']}")
    if "bf16_logits_rel_err" in hf:
        lines.append(f"bf16 logits vs transformers (prefill {a.hf_prefill}): max rel err {hf['bf16_logits_rel_err']:.2e}")
    if "error" in hf:
        lines.append(f"transformers: {hf['error']}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
