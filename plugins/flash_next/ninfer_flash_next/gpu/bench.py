"""H200 bench of Flash-Next at the real widths (`python -m ninfer_flash_next.gpu.bench`).

One run: the host-to-device (pinned) and device copy bandwidths; NInfer prefill and decode with the
experts on the device; transformers' qwen4_exp on the same weights (shared tensors) for prefill and
decode, and the bf16 logits' distance between the two; then NInfer decode with the experts in
pinned host memory through the device expert cache, against the rate the measured host-to-device
bandwidth allows for the expert bytes it copied per token. The model is the first --layers layers
(shapes.bench_config): every figure is for that many layers. Prints a short table; --json PATH
writes the figures.
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bandwidths(dev) -> dict:
    n = 1 << 30 if dev.type == "cuda" else 1 << 24
    host = torch.empty(n, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    d = torch.empty(n, dtype=torch.uint8, device=dev)
    d2 = torch.empty_like(d)
    d.copy_(host, non_blocking=True)
    _sync()
    t = time.perf_counter()
    for _ in range(4):
        d.copy_(host, non_blocking=True)
    _sync()
    h2d = 4 * n / (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(4):
        d2.copy_(d)
    _sync()
    dd = 2 * 4 * n / (time.perf_counter() - t)  # read + write
    del host, d, d2
    return {"h2d_GBps": h2d / 1e9, "device_copy_GBps": dd / 1e9}


def ours_prefill(r, tokens, slot=0) -> tuple[float, torch.Tensor]:
    from ninfer_core.engine.model_api import SeqView

    r.reset_slot(slot)
    pages = list(range(-(-len(tokens) // 64) + 1))
    _sync()
    t = time.perf_counter()
    out = r.prefill(SeqView(slot, pages, 0), tokens, all_logits=True)
    _sync()
    return len(tokens) / (time.perf_counter() - t), out


def ours_decode(r, prompt, steps, snap=None):
    """(tok/s of `steps` greedy decode steps after `prompt`, the tokens, snap() taken as timing starts)."""
    from ninfer_core.engine.model_api import SeqView

    r.reset_slot(0)
    pages = list(range(-(-(len(prompt) + steps + 1) // 64) + 1))
    seq = SeqView(0, pages, 0)
    tok = int(r.prefill(seq, prompt).argmax())
    seq.num_cached = len(prompt)
    got = [tok]
    r.decode([seq], [tok])  # warm-up step
    seq.num_cached += 1
    _sync()
    start = snap() if snap is not None else None
    t = time.perf_counter()
    for _ in range(steps):
        tok = int(r.decode([seq], [got[-1]])[0].argmax())
        got.append(tok)
        seq.num_cached += 1
    _sync()
    return steps / (time.perf_counter() - t), got, start


@torch.no_grad()
def hf_figures(hf, tokens, prompt, steps) -> dict:
    dev = next(hf.parameters()).device
    ids = torch.tensor([tokens], device=dev)
    hf(ids[:, :64])
    _sync()
    t = time.perf_counter()
    logits = hf(ids).logits[0].float()
    _sync()
    pre = len(tokens) / (time.perf_counter() - t)
    out = hf(torch.tensor([prompt], device=dev), use_cache=True)
    cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
    nxt = out.logits[:, -1:].argmax(-1)
    _sync()
    t = time.perf_counter()
    for _ in range(steps):
        out = hf(nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
    _sync()
    return {"prefill_tok_s": pre, "decode_tok_s": steps / (time.perf_counter() - t), "logits": logits}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prefill", type=int, default=4096, help="NInfer prefill tokens")
    ap.add_argument("--hf-prefill", type=int, default=1024, help="prefill tokens of both (transformers' indexer "
                    "loops over queries in Python)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--hf-decode-steps", type=int, default=8)
    ap.add_argument("--host-cache-mib", type=int, default=4096)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="the tiny test model on the CPU (checks the script)")
    a = ap.parse_args(argv)
    from ninfer_flash_next.family import FlashNextFamily
    from ninfer_flash_next.shapes import bench_config

    dev = torch.device("cpu" if a.smoke else "cuda")
    if a.smoke:
        from ninfer_flash_next.testing import tiny_config

        cfg = tiny_config()
    else:
        cfg = bench_config(a.layers)
    fam = FlashNextFamily()
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "layers": a.layers,
           "torch": torch.__version__}
    res["bandwidth"] = bw = bandwidths(dev)
    print(f"bandwidth: host->device {bw['h2d_GBps']:.1f} GB/s, device copy {bw['device_copy_GBps']:.0f} GB/s",
          flush=True)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, min(240000, cfg["vocab_size"]), (max(a.prefill, a.hf_prefill),), generator=g).tolist()
    prompt = tokens[: a.prompt]
    art = fam.random_artifact(cfg, device=str(dev), seed=0)
    t = time.perf_counter()
    r = fam.load(art, device=str(dev))
    pages = -(-max(a.prefill, a.prompt + a.decode_steps + 2) // 64) + 2
    r.allocate_cache(pages, 2)
    print(f"device-expert model built in {time.perf_counter() - t:.0f} s", flush=True)
    ours_prefill(r, tokens[:256])  # warm-up (Triton / fla autotune)
    res["prefill_tok_s"] = ours_prefill(r, tokens[: a.prefill])[0]
    hf_len_rate, our_logits = ours_prefill(r, tokens[: a.hf_prefill])
    res["prefill_hf_len_tok_s"] = hf_len_rate
    res["decode_tok_s"], dev_tokens, _ = ours_decode(r, prompt, a.decode_steps)
    print(f"NInfer: prefill {res['prefill_tok_s']:.0f} tok/s ({a.prefill}), decode {res['decode_tok_s']:.1f} tok/s",
          flush=True)
    if not a.no_hf:
        try:
            hf = fam.transformers_model(r, cfg)
            h = hf_figures(hf, tokens[: a.hf_prefill], prompt, a.hf_decode_steps)
            ref = h.pop("logits")
            h["bf16_logits_rel_err"] = float((our_logits - ref).abs().max() / ref.abs().max())
            res["transformers"] = h
            del hf
        except Exception as e:  # noqa: BLE001 - reported in the table, the host part still runs
            res["transformers"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    del r
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    opts = SimpleNamespace(expert_residency="host", expert_cache_mib=a.host_cache_mib)
    t = time.perf_counter()
    r = fam.load(art, device=str(dev), options=opts)
    r.allocate_cache(pages, 2)
    print(f"host-expert model built in {time.perf_counter() - t:.0f} s", flush=True)
    ours_decode(r, prompt, 4)
    rate, host_tokens, before = ours_decode(r, prompt, a.decode_steps, snap=lambda: r.counters()["experts"])
    after = r.counters()["experts"]
    moved = (after["transferred_bytes"] - before["transferred_bytes"]) / a.decode_steps
    routes = after["routes"] - before["routes"]
    hits = after["hits"] - before["hits"]
    bound = bw["h2d_GBps"] * 1e9 / moved if moved else float("inf")
    res["host"] = {"decode_tok_s": rate, "cache_mib": a.host_cache_mib, "slots": after["slots"],
                   "hit_rate": hits / routes if routes else None, "bytes_per_token": moved,
                   "bandwidth_bound_tok_s": bound, "vs_bound": rate / bound if moved else None,
                   "greedy_equal_to_device": host_tokens == dev_tokens}
    print(table(res, a), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


def table(res: dict, a) -> str:
    hf = res.get("transformers") or {}
    host = res["host"]

    def f(v, d=1):
        return "-" if v is None else f"{v:,.{d}f}"

    rows = [("figure", "NInfer", "transformers", "NInfer/tf"),
            (f"prefill {a.hf_prefill} tok/s", f(res["prefill_hf_len_tok_s"], 0), f(hf.get("prefill_tok_s"), 0),
             f(res["prefill_hf_len_tok_s"] / hf["prefill_tok_s"], 2) if hf.get("prefill_tok_s") else "-"),
            (f"prefill {a.prefill} tok/s", f(res["prefill_tok_s"], 0), "-", "-"),
            ("decode b1 tok/s (device experts)", f(res["decode_tok_s"]), f(hf.get("decode_tok_s")),
             f(res["decode_tok_s"] / hf["decode_tok_s"], 2) if hf.get("decode_tok_s") else "-"),
            ("decode b1 tok/s (host experts)", f(host["decode_tok_s"]), "-", "-")]
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"flash-next bench  {res['device']}  first {res['layers']} of 48 layers, real widths"]
    lines += ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    lines.append(f"host experts: cache {host['cache_mib']} MiB ({host['slots']} slots), hit rate "
                 f"{f(host['hit_rate'], 3)}, {host['bytes_per_token'] / 1e6:,.1f} MB/token over host->device "
                 f"{res['bandwidth']['h2d_GBps']:.1f} GB/s -> bound {f(host['bandwidth_bound_tok_s'])} tok/s, "
                 f"measured {f(host['vs_bound'], 2)} of it; greedy equal to device: {host['greedy_equal_to_device']}")
    if "bf16_logits_rel_err" in hf:
        lines.append(f"bf16 logits vs transformers (prefill {a.hf_prefill}): max rel err {hf['bf16_logits_rel_err']:.2e}")
    if "error" in hf:
        lines.append(f"transformers: {hf['error']}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
