#!/usr/bin/env python3
"""Vision towers on the device: encode time per 512x512 image and per video second for each
residency (resident, overlay, cpu) at a Qwen3.5 tower shape and at the Gemma 4 31B tower shape,
the device memory each one holds between encodes and reserves during one, and the bf16 tower
against transformers' fp32 (beside transformers' own bf16).

Random weights (transformers' Qwen3_5VisionModel / Gemma4VisionModel + its embedder at the shape,
drawn with a per-fan-in spread); times are the median of a few encodes after a warm-up, measured in
this run. The overlay's window is borrowed from free pages of a KV pool allocated for the run, at
the text model's page geometry, as the server lends them (ninfer_core.media.window). One table per
shape.

    python3 scripts/vision_bench.py [--shape 27b,gemma4-31b] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = {
    # Qwen3.5 27B / 9B towers (the published vision_config widths; out_hidden_size is the text width)
    "27b": {"depth": 27, "hidden_size": 1152, "num_heads": 16, "intermediate_size": 4304, "out_hidden_size": 5120,
            "num_position_embeddings": 2304, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
    # a smoke-test shape (runs on any CPU in seconds)
    "tiny": {"depth": 2, "hidden_size": 64, "num_heads": 2, "intermediate_size": 128, "out_hidden_size": 96,
             "num_position_embeddings": 256, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "9b": {"depth": 27, "hidden_size": 1152, "num_heads": 16, "intermediate_size": 4304, "out_hidden_size": 4096,
           "num_position_embeddings": 2304, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
}
# Gemma 4 towers (vision_config widths; the 31B's 27 blocks of 1152, about 1.07 GiB in bf16) with the
# text width their embedder projects to
GEMMA_SHAPES = {
    "gemma4-31b": {"vision": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                              "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 72,
                              "patch_size": 16, "pooling_kernel_size": 3, "position_embedding_size": 10240,
                              "standardize": True, "rms_norm_eps": 1e-6},
                   "text_hidden": 5376},
    "gemma4-tiny": {"vision": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                               "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32,
                               "patch_size": 16, "pooling_kernel_size": 3, "position_embedding_size": 256,
                               "standardize": True, "rms_norm_eps": 1e-6},
                    "text_hidden": 96},
}
# the text model's KV page row per tensor (64 tokens x KV heads x head_dim, bf16) and page-major
# tensors (K and V of each paged layer): where the overlay's window is borrowed from
KV_GEOMETRY = {"27b": (32, 4, 256), "9b": (16, 4, 256), "tiny": (4, 1, 32),
               "gemma4-31b": (20, 4, 512), "gemma4-tiny": (4, 1, 32)}
KV_POOL_MIB = {"27b": 2048, "9b": 2048, "tiny": 16, "gemma4-31b": 2048, "gemma4-tiny": 16}


class _Artifact:
    """What a family's tower loader reads: config and the tower's tensors under their names."""

    def __init__(self, config: dict, state: dict, architecture: str = "qwen3_5"):
        self.config = config
        self.architecture = architecture
        self._state = state

    def tensor_names(self):
        return list(self._state)

    def get_tensor(self, name):
        return self._state[name]


def _random_hf(vision: dict):
    import transformers as tr

    cfg = tr.Qwen3_5VisionConfig(**vision)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tr.models.qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.normal_(0, 1.0 / p[0].numel() ** 0.5 if "pos_embed" not in name else 0.5)
    return model


def _image(w: int, h: int, seed: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def _time(fn, repeats: int, cuda: bool):
    """(median seconds of `repeats` calls after a warm-up, the last call's result)."""
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def _random_gemma(shape: dict):
    """transformers' Gemma 4 tower and embedder at `shape`, random: linears by fan-in, q/k norm
    weights head_dim^-1/4 (attention scores of order one, as in a trained tower: with softmax scale
    1 and unit norms they would spread by sqrt(head_dim) and a bf16 rounding would flip them)."""
    import transformers as tr
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder, Gemma4VisionModel

    vcfg = tr.Gemma4VisionConfig(**shape["vision"])
    vcfg._attn_implementation = "sdpa"
    tcfg = tr.Gemma4TextConfig(hidden_size=shape["text_hidden"], num_hidden_layers=1, vocab_size=16,
                               intermediate_size=16, num_attention_heads=1, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    tower, embed = Gemma4VisionModel(vcfg).eval(), Gemma4MultimodalEmbedder(vcfg, tcfg).eval()
    with torch.no_grad():
        for mod in (tower, embed):
            for name, p in mod.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.fill_(p.shape[0] ** -0.25)
                elif "norm" in name:
                    p.fill_(1.0)
                elif "position_embedding_table" in name:
                    p.normal_(0, 0.5)
                else:
                    p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
        for name, b in tower.named_buffers():
            if name.endswith("std_bias"):
                b.zero_()
            elif name.endswith("std_scale"):
                b.fill_(1.0)
    return tower, embed


def _random_gemma_state(shape: dict) -> dict:
    """Checkpoint-named random weights of the plugin's Gemma 4 tower (the same spread as _random_gemma)."""
    from ninfer_gemma4.vision import Gemma4VisionModel, VisionConfig

    cfg = VisionConfig(**shape["vision"], text_hidden_size=shape["text_hidden"])
    with torch.device("meta"):
        model = Gemma4VisionModel(cfg)
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, p in model.named_parameters():
        if ".position_embedding_table." in name:
            continue
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            t = torch.full(p.shape, p.shape[0] ** -0.25)
        elif "norm" in name or name == "std_scale":
            t = torch.ones(p.shape)
        elif name == "std_bias":
            t = torch.zeros(p.shape)
        else:
            t = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
        key = ("model." + name) if name.startswith("embed_vision.") else ("model.vision_tower." + name)
        state[key] = t
    state["model.vision_tower.patch_embedder.position_embedding_table"] = 0.5 * torch.randn(
        2, cfg.position_embedding_size, cfg.hidden_size, generator=g)
    return state


def _kv_lender(shape: str, dev):
    """A KV pool on the device at the text model's page geometry, and the lender an overlay uses."""
    from ninfer_core.engine.pages import PagePool
    from ninfer_core.media.window import PageLender

    tensors, kvh, hd = KV_GEOMETRY[shape]
    row = 64 * kvh * hd * 2
    pages = max(4, (KV_POOL_MIB[shape] << 20) // (row * tensors))
    kv = [torch.zeros(pages, 64, kvh, hd, dtype=torch.bfloat16, device=dev) for _ in range(tensors)]
    pool = PagePool(pages)
    return PageLender(pool, lambda: kv), kv


def _measure(name, run, item, video, seconds, repeats, cuda, base):
    held = (torch.cuda.memory_allocated() - base) if cuda else 0
    reps = repeats if name != "cpu" else min(2, repeats)  # seconds per encode on host threads
    t_img, out = _time(lambda: run(item), reps, cuda and name != "cpu")
    t_vid = _time(lambda: run(video), max(1, reps // 2), cuda and name != "cpu")[0] / seconds
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else 0
    return t_img, t_vid, held, peak, out.float().cpu()


LOANS: list[tuple[int, int]] = []  # (bytes, pages) of each overlay window borrowed from the KV pool


def _towers(name, build_device, build_host, lender, cuda, dev):
    """(encode function, reserved bytes) of one residency; `lender`: the overlay's KV pages."""
    from ninfer_core.media.window import nbytes_of

    if name == "resident":
        tower = build_device(torch.bfloat16)
        return tower.encode, tower.device_bytes(), tower
    if name == "overlay":
        tower = build_host(torch.bfloat16)
        tower.pin()
        sizes = nbytes_of(tower.window_tensors(), tower.dtype)

        def run(item, tower=tower):
            window = lender.borrow(sizes)
            if window is None:
                raise RuntimeError("the KV pool cannot cover one window")
            LOANS.append((window.nbytes, len(window.pages)))
            try:
                return tower.encode_streamed(item, dev, window)
            finally:
                lender.give_back(window)

        return run, sum(sizes), tower
    tower = build_host(torch.float32)
    return tower.encode, 0, tower


def bench_shape(shape: str, a, cuda: bool, dev) -> list[str]:
    """One shape's table (lines)."""
    from ninfer_core.media.api import IMAGE, VIDEO, PreparedMedia

    t0 = time.monotonic()
    gemma = shape in GEMMA_SHAPES
    seconds = 2 if gemma else 4  # 2 fps: two 512x512 frames per second
    frames = [_image(512, 512, 10 + i) for i in range(2 * seconds)]
    times = [i / 2 for i in range(2 * seconds)]
    if gemma:
        from ninfer_gemma4.media import Gemma4MediaProcessor
        from ninfer_gemma4.vision import Gemma4VisionTower, load_vision_model

        spec = GEMMA_SHAPES[shape]
        try:
            hf, embed = _random_gemma(spec)
            state = {"model.vision_tower." + k: v.detach() for k, v in hf.state_dict().items()}
            state.update({"model.embed_vision." + k: v.detach() for k, v in embed.state_dict().items()})
        except Exception as exc:  # noqa: BLE001  (a transformers release without this config)
            print(f"transformers' Gemma 4 tower unavailable ({type(exc).__name__}: {exc}); random weights "
                  "drawn for the plugin's tower, no reference", flush=True)
            hf = embed = None
            state = _random_gemma_state(spec)
        art = _Artifact({"vision_config": spec["vision"], "text_config": {"hidden_size": spec["text_hidden"]}},
                        state, "gemma4")
        proc = Gemma4MediaProcessor(art.config)
        bound = proc.item_bound(IMAGE, "auto", 1120)

        def build(device, dtype):
            return Gemma4VisionTower(load_vision_model(art, torch.device(device), dtype), torch.device(device))
    else:
        from ninfer_qwen35.media import Qwen35MediaProcessor
        from ninfer_qwen35.vision import Qwen35VisionTower, load_vision_model

        vision = SHAPES[shape]
        hf = _random_hf(vision)
        state = {"model.visual." + k: v.detach() for k, v in hf.state_dict().items()}
        art = _Artifact({"vision_config": vision}, state)
        proc = Qwen35MediaProcessor(art.config)
        bound = 16384

        def build(device, dtype):
            return Qwen35VisionTower(load_vision_model(art, torch.device(device), dtype), torch.device(device))
    pv, grid, tokens = proc.prepare_image(_image(512, 512, 1), bound)
    image = PreparedMedia(IMAGE, "0" * 64, pv, grid, tokens)
    vbound = proc.item_bound(VIDEO, "auto", 1120) if gemma else 16384
    vpv, vgrid, vtokens, extra = proc.prepare_video(frames, times, vbound)
    video = PreparedMedia(VIDEO, "1" * 64, vpv, vgrid, vtokens, extra)
    params = sum(v.numel() for v in state.values())
    lines = [(f"tower {shape}: {params / 1e6:.0f} M parameters ({params * 2 / 2**30:.2f} GiB bf16); 512x512 image "
              f"grid {grid} -> {tokens} tokens; video {seconds} s grid {vgrid} -> {vtokens} tokens; built in "
              f"{time.monotonic() - t0:.0f} s")]
    print(lines[0], flush=True)
    smoke = a.device == "cpu"  # resident and overlay on the CPU: a check of the paths, not a measurement
    lender, kv = _kv_lender(shape, dev) if cuda or smoke else (None, None)
    rows = []
    for name in [r.strip() for r in a.residencies.split(",") if r.strip()]:
        if name in ("resident", "overlay") and not cuda and not smoke:
            rows.append((name, None, None, None, None, None, "no CUDA"))
            continue
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        run, reserved, tower = _towers(name, lambda dt: build(dev, dt), lambda dt: build("cpu", dt), lender, cuda, dev)
        t_img, t_vid, held, peak, out = _measure(name, run, image, video, seconds, a.repeats, cuda, base)
        rows.append((name, t_img, t_vid, held, reserved, peak, out))
        del tower, run
        if cuda:
            torch.cuda.empty_cache()
    if lender is not None:
        assert lender.open_pages == 0 and lender.pool.num_free == lender.pool.num_pages  # every loan returned
        del kv

    ref_note = ""
    try:
        ref, ref_note = _reference(gemma, hf, embed if gemma else None, image, grid, cuda, dev)
    except Exception as exc:  # noqa: BLE001  (another transformers release: the timings stand without it)
        ref, ref_note = None, f"; transformers reference failed: {type(exc).__name__}: {str(exc)[:160]}"
    del hf
    if cuda:
        torch.cuda.empty_cache()

    lines.append(f"{'residency':10s} {'image ms':>9s} {'video ms/s':>11s} {'held MiB':>9s} {'reserved MiB':>13s} "
                 f"{'peak MiB':>9s} {'vs transformers fp32':>21s}")
    for name, t_img, t_vid, held, reserved, peak, out in rows:
        if t_img is None:
            lines.append(f"{name:10s} {'-':>9s} {'-':>11s} {'-':>9s} {'-':>13s} {'-':>9s} {out:>21s}")
            continue
        err = f"{rel_err(out, ref):21.2e}" if ref is not None else f"{'-':>21s}"
        lines.append(f"{name:10s} {t_img * 1e3:9.1f} {t_vid * 1e3:11.1f} {held / 2**20:9.1f} "
                     f"{reserved / 2**20:13.1f} {peak / 2**20:9.1f} {err}")
    return _notes(lines, rows, shape, ref_note)


def _reference(gemma, hf, embed, image, grid, cuda, dev):
    """transformers' fp32 embeddings of the image, and a note comparing its own bf16 with them."""
    if hf is None:
        raise RuntimeError("no transformers model")
    ref_note = ""
    with torch.no_grad():
        if gemma:
            hf32, emb32 = hf.to(dev).float(), embed.to(dev).float()
            ph, pw = grid
            yy, xx = torch.meshgrid(torch.arange(ph), torch.arange(pw), indexing="ij")
            pos = torch.stack([xx.reshape(-1), yy.reshape(-1)], -1)[None].to(dev)
            px = image.pixel_values.float().to(dev)[None] / 255.0

            def reference(model, emb, x):
                return emb(model(pixel_values=x, pixel_position_ids=pos).last_hidden_state)  # [tokens, text]

            ref = reference(hf32, emb32, px).float().cpu()
            if cuda:
                own = reference(hf32.to(torch.bfloat16), emb32.to(torch.bfloat16), px.to(torch.bfloat16))
                ref_note = f"; transformers bf16 vs its fp32 {rel_err(own.float().cpu(), ref):.2e}"
        else:
            hf32 = hf.to(dev).float()
            ref = hf32(image.pixel_values.float().to(dev), grid_thw=torch.tensor([grid], device=dev)).pooler_output
            ref = ref.float().cpu()
            if cuda:
                hf16 = hf32.to(torch.bfloat16)
                own = hf16(image.pixel_values.to(dev), grid_thw=torch.tensor([grid], device=dev)).pooler_output
                ref_note = f"; transformers bf16 vs its fp32 {rel_err(own.float().cpu(), ref):.2e}"
    return ref, ref_note


def _notes(lines, rows, shape, ref_note):
    if LOANS:
        window = next(r[4] for r in rows if r[0] == "overlay")
        lines.append(f"overlay window: {window / 2**20:.1f} MiB of tensors in {LOANS[-1][0] / 2**20:.1f} MiB of "
                     f"free KV pages ({LOANS[-1][1]} consecutive pages of {KV_GEOMETRY[shape][0]} page-major "
                     f"tensors; a tensor must fit one tensor's rows), {len(LOANS)} loans, all returned")
        LOANS.clear()
    outs = {r[0]: r[-1] for r in rows if r[1] is not None}
    if "resident" in outs and "overlay" in outs:
        lines.append(f"overlay embeddings equal resident bit for bit: {torch.equal(outs['resident'], outs['overlay'])}")
    lines.append(f"(max abs error over max abs reference, 512x512 image{ref_note}; held: device memory between "
                 "encodes; reserved: the tower (resident) or one encode's window borrowed from free KV pages "
                 "(overlay); peak: allocator view during encodes, the window's KV pages not counted)")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="27b,gemma4-31b",
                    help=f"comma-separated shapes: {', '.join(sorted(SHAPES) + sorted(GEMMA_SHAPES))}")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--residencies", default="resident,overlay,cpu")
    ap.add_argument("--device", default=None, help="cpu: run resident and overlay on the CPU too (a smoke "
                    "test of the paths; default: cuda when present)")
    a = ap.parse_args()
    shapes = [x.strip() for x in a.shape.split(",") if x.strip()]
    unknown = [x for x in shapes if x not in SHAPES and x not in GEMMA_SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}")
    cuda = torch.cuda.is_available() and a.device != "cpu"
    dev = torch.device("cuda" if cuda else "cpu")
    tables = []
    for shape in shapes:
        try:
            tables.append(bench_shape(shape, a, cuda, dev))
        except Exception as exc:  # noqa: BLE001  (one shape failing leaves the others' tables)
            import traceback

            traceback.print_exc()
            tables.append([f"tower {shape}: failed: {type(exc).__name__}: {exc}"])
        if cuda:
            torch.cuda.empty_cache()
    print("\nvision tables")
    for lines in tables:
        print("\n".join(lines) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
