#!/usr/bin/env python3
"""Vision tower on the device: encode time per 512x512 image and per video second for each
residency (resident, overlay, cpu) at a Qwen3.5 tower shape, the device memory each one holds,
and the bf16 tower against transformers' fp32 (beside transformers' own bf16).

Random weights (transformers' Qwen3_5VisionModel at the shape, drawn with a per-fan-in spread);
times are the median of a few encodes after a warm-up, measured in this run. Prints one table.

    python3 scripts/vision_bench.py [--shape 27b] [--repeats 5]
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


class _Artifact:
    """What the family's tower loader reads: config and model.visual.* tensors."""

    def __init__(self, vision: dict, state: dict):
        self.config = {"vision_config": vision}
        self.architecture = "qwen3_5"
        self._state = {"model.visual." + k: v for k, v in state.items()}

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


def _time(fn, repeats: int, cuda: bool) -> float:
    fn()
    if cuda:
        torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--residencies", default="resident,overlay,cpu")
    a = ap.parse_args()

    from ninfer_qwen35.media import Qwen35MediaProcessor
    from ninfer_qwen35.vision import Qwen35VisionTower, load_vision_model

    from ninfer_core.media.api import IMAGE, VIDEO, PreparedMedia

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    vision = SHAPES[a.shape]
    t0 = time.monotonic()
    hf = _random_hf(vision)
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    art = _Artifact(vision, state)
    proc = Qwen35MediaProcessor(art.config)
    pv, grid, tokens = proc.prepare_image(_image(512, 512, 1), 16384)
    image = PreparedMedia(IMAGE, "0" * 64, pv, grid, tokens)
    seconds = 4  # 2 fps: one 512x512 frame pair per second
    frames = [_image(512, 512, 10 + i) for i in range(2 * seconds)]
    vpv, vgrid, vtokens, extra = proc.prepare_video(frames, [i / 2 for i in range(2 * seconds)], 16384)
    video = PreparedMedia(VIDEO, "1" * 64, vpv, vgrid, vtokens, extra)
    print(f"tower {a.shape}: depth {vision['depth']}, width {vision['hidden_size']}, "
          f"{sum(v.numel() for v in state.values()) / 1e6:.0f} M parameters; image grid {grid} -> {tokens} tokens; "
          f"video {seconds} s grid {vgrid} -> {vtokens} tokens; built in {time.monotonic() - t0:.0f} s", flush=True)

    rows = []
    want = [r.strip() for r in a.residencies.split(",") if r.strip()]
    for name in want:
        if name in ("resident", "overlay") and not cuda:
            rows.append((name, None, None, None, None, "no CUDA"))
            continue
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        if name == "resident":
            tower = Qwen35VisionTower(load_vision_model(art, dev, torch.bfloat16), dev)

            def run(item, tower=tower):
                return tower.encode(item)
        elif name == "overlay":
            tower = Qwen35VisionTower(load_vision_model(art, torch.device("cpu"), torch.bfloat16),
                                      torch.device("cpu"))
            tower.pin()

            def run(item, tower=tower):
                return tower.encode_streamed(item, dev)
        else:
            tower = Qwen35VisionTower(load_vision_model(art, torch.device("cpu"), torch.float32),
                                      torch.device("cpu"))

            def run(item, tower=tower):
                return tower.encode(item)
        held = (torch.cuda.memory_allocated() - base) if cuda else 0
        reps = a.repeats if name != "cpu" else min(2, a.repeats)  # seconds per encode on host threads
        t_img = _time(lambda: run(image), reps, cuda and name != "cpu")
        t_vid = _time(lambda: run(video), max(1, reps // 2), cuda and name != "cpu") / seconds
        peak = (torch.cuda.max_memory_allocated() - base) if cuda else 0
        out = run(image).float().cpu()
        rows.append((name, t_img, t_vid, held, peak, out))
        del tower
        if cuda:
            torch.cuda.empty_cache()

    ref_note = ""
    with torch.no_grad():
        hf32 = hf.to(dev).float()
        ref = hf32(image.pixel_values.float().to(dev), grid_thw=torch.tensor([grid], device=dev)).pooler_output
        ref = ref.float().cpu()
        if cuda:
            hf16 = hf32.to(torch.bfloat16)
            own = hf16(image.pixel_values.to(dev), grid_thw=torch.tensor([grid], device=dev)).pooler_output
            ref_note = f"; transformers bf16 vs its fp32 {rel_err(own.float().cpu(), ref):.2e}"

    print(f"\n{'residency':10s} {'image ms':>9s} {'video ms/s':>11s} {'held MiB':>9s} {'peak MiB':>9s} "
          f"{'vs transformers fp32':>21s}")
    for name, t_img, t_vid, held, peak, out in rows:
        if t_img is None:
            print(f"{name:10s} {'-':>9s} {'-':>11s} {'-':>9s} {'-':>9s} {out:>21s}")
            continue
        print(f"{name:10s} {t_img * 1e3:9.1f} {t_vid * 1e3:11.1f} {held / 2**20:9.1f} {peak / 2**20:9.1f} "
              f"{rel_err(out, ref):21.2e}")
    print(f"(max abs error over max abs reference, 512x512 image{ref_note}; held: device memory between "
          "encodes; peak: during them, allocator view)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
