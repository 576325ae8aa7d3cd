"""Gemma 4's media preprocessing and placeholder expansion (the facts of transformers'
Gemma4ImageProcessor, Gemma4VideoProcessor and Gemma4Processor, written for ninfer_core.media).

An image is resized, aspect kept, to the largest size whose sides are multiples of patch x pooling
(48) and whose patches fit the item's soft-token budget x 9; its patches (16 x 16 x RGB, raster
order) are kept as bytes (the tower rescales by 1/255). It takes ph * pw / 9 soft tokens. Budgets
are 70, 140, 280, 560 and 1120 (spec "Image detail": low 70, auto 280, high the --vision-max-merged
bound; a video frame 70). The template writes one <|image|> per image; the expansion makes it
<boi> + soft tokens + <eoi>. A video becomes, per sampled frame, "mm:ss " + <boi> + its soft tokens
+ <eoi>, frames joined by a space. Positions are the plain token index (Gemma 4 has no mRoPE).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from ninfer_core.engine.api import EngineError
from ninfer_core.media.api import IMAGE, VIDEO, Expansion, MediaProcessor, MediaSpan, PreparedMedia
from ninfer_gemma4.vision import VisionConfig

BUDGETS = (70, 140, 280, 560, 1120)
IMAGE_DEFAULT = 280  # the release's image budget (detail auto)
VIDEO_FRAME = 70


def budget_at_most(bound: int) -> int:
    """The largest soft-token budget not above `bound` (at least the smallest)."""
    fit = [b for b in BUDGETS if b <= bound]
    return fit[-1] if fit else BUDGETS[0]


def aspect_size(height: int, width: int, patch: int, max_patches: int, k: int) -> tuple[int, int]:
    """(h, w): the largest multiples of patch * k, aspect kept, with at most `max_patches` patches."""
    factor = math.sqrt(max_patches * patch ** 2 / (height * width))
    side = patch * k
    h = math.floor(factor * height / side) * side
    w = math.floor(factor * width / side) * side
    longest = (max_patches // k ** 2) * side
    if h == 0 and w == 0:
        raise ValueError(f"an image of {width} x {height} pixels cannot be resized to whole {side}-pixel cells")
    if h == 0:
        h, w = side, min(math.floor(width / height) * side, longest)
    elif w == 0:
        w, h = side, min(math.floor(height / width) * side, longest)
    return h, w


class Gemma4MediaProcessor(MediaProcessor):
    max_merged_limit = BUDGETS[-1]
    min_merged = BUDGETS[0]
    video_fps = 2.0
    video_max_frames = 32  # the video processor's frame count

    def __init__(self, config: dict, encode_text: Callable[[str], list[int]] | None = None):
        self.vcfg = VisionConfig.from_hf(config)
        self.placeholder_ids = {IMAGE: int(config.get("image_token_id", 258880)),
                                VIDEO: int(config.get("video_token_id", 258884))}
        self.boi = int(config.get("boi_token_id", 255999))
        self.eoi = int(config.get("eoi_token_id", 258882))
        self.encode_text = encode_text  # plain-text ids (frame timestamps); set by the server

    def item_bound(self, kind: str, detail: str, max_merged: int) -> int:
        cap = budget_at_most(max_merged)
        if kind == VIDEO:
            return min(VIDEO_FRAME, cap)
        if detail == "low":
            return BUDGETS[0]
        return cap if detail == "high" else min(IMAGE_DEFAULT, cap)

    def _patches(self, image, budget: int) -> tuple[torch.Tensor, tuple[int, int]]:
        from PIL import Image

        c = self.vcfg
        k, p = c.pooling_kernel_size, c.patch_size
        h, w = aspect_size(image.height, image.width, p, budget * k * k, k)
        img = image if image.size == (w, h) else image.resize((w, h), Image.Resampling.BICUBIC)
        arr = np.asarray(img.convert("RGB"), dtype=np.uint8)  # [H, W, 3]
        ph, pw = h // p, w // p
        x = arr.reshape(ph, p, pw, p, 3).transpose(0, 2, 1, 3, 4).reshape(ph * pw, p * p * 3)
        return torch.from_numpy(np.ascontiguousarray(x)), (ph, pw)

    def prepare_image(self, image, max_merged: int):
        pv, (ph, pw) = self._patches(image, budget_at_most(max_merged))
        return pv, (ph, pw), ph * pw // self.vcfg.pooling_kernel_size ** 2

    def prepare_video(self, frames: list, times: list[float], max_merged: int):
        if not frames:
            raise EngineError(400, "invalid_media", "the video has no frames")
        budget = budget_at_most(max_merged)
        parts = [self._patches(f, budget) for f in frames]
        grids = {g for _, g in parts}
        if len(grids) != 1:
            raise EngineError(400, "invalid_media", "the video's frames change size")
        ph, pw = grids.pop()
        per = ph * pw // self.vcfg.pooling_kernel_size ** 2
        pv = torch.cat([x for x, _ in parts])
        return pv, (len(frames), ph, pw), len(frames) * per, {"timestamps": list(times)}

    def expand(self, ids: list[int], items: list[PreparedMedia]) -> Expansion:
        out: list[int] = []
        spans: list[MediaSpan] = []
        it = iter(items)
        i = 0
        while i < len(ids):
            tok = ids[i]
            if tok not in self.placeholder_ids.values():
                out.append(tok)
                i += 1
                continue
            item = next(it)
            # a template that writes the image markers itself keeps them; ours writes the placeholder
            if out and out[-1] == self.boi:
                out.pop()
            if i + 1 < len(ids) and ids[i + 1] == self.eoi:
                i += 1
            if tok == self.placeholder_ids[IMAGE]:
                out.append(self.boi)
                spans.append(MediaSpan(len(out), item.tokens, item))
                out += [tok] * item.tokens
                out.append(self.eoi)
            else:
                frames = item.grid[0]
                per = item.tokens // frames
                for f, t in enumerate(item.extra.get("timestamps") or [0.0] * frames):
                    out += self._text(("" if f == 0 else " ") + f"{int(t // 60):02d}:{int(t % 60):02d} ")
                    out.append(self.boi)
                    spans.append(MediaSpan(len(out), per, item, offset=f * per))
                    out += [tok] * per
                    out.append(self.eoi)
            i += 1
        return Expansion(out, spans)

    def _text(self, text: str) -> list[int]:
        if self.encode_text is None:
            raise RuntimeError("video timestamps need the server's tokenizer (encode_text)")
        return list(self.encode_text(text))
