"""Qwen3.5's media preprocessing and placeholder expansion (the facts of transformers' Qwen2-VL
image processor and Qwen3.5's get_rope_index, written for ninfer_core.media's contract).

An image is resized so both sides are multiples of patch x merge (32) with its area inside
[min_pixels, max_pixels] (max_pixels from the merged-token bound), scaled to [-1, 1], repeated to
the temporal patch and cut into patches in spatial-merge-block order: [h*w, 3*2*16*16]. A video's
frames are cut the same way in pairs. Each image placeholder becomes (h/2)*(w/2) image tokens;
a video becomes, per frame pair, "<T seconds>" + vision_start + frame tokens + vision_end. Text
after media continues its rope position from the largest position the media used, plus one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from ninfer_core.media.api import IMAGE, VIDEO, Expansion, MediaProcessor, MediaSpan, PreparedMedia
from ninfer_qwen35.vision import VisionConfig

MIN_PIXELS = 65536  # the Qwen3.5 processor's shortest_edge (64 merged tokens)
MAX_PIXELS = 16777216
MEAN = STD = 0.5


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h, w): multiples of `factor`, area in [min_pixels, max_pixels], aspect kept as closely as it can."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is above 200")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


class Qwen35MediaProcessor(MediaProcessor):
    def __init__(self, config: dict, encode_text: Callable[[str], list[int]] | None = None):
        self.vcfg = VisionConfig.from_hf(config)
        self.placeholder_ids = {IMAGE: int(config.get("image_token_id", 248056)),
                                VIDEO: int(config.get("video_token_id", 248057))}
        self.vision_start = int(config.get("vision_start_token_id", 248053))
        self.vision_end = int(config.get("vision_end_token_id", 248054))
        self.encode_text = encode_text  # plain-text ids (video timestamps); set by the server
        self.factor = self.vcfg.patch_size * self.vcfg.spatial_merge_size
        self.min_pixels, self.max_pixels = MIN_PIXELS, MAX_PIXELS

    def _size(self, height: int, width: int, max_merged: int) -> tuple[int, int]:
        bound = min(self.max_pixels, max_merged * self.factor ** 2)
        h, w = smart_resize(height, width, self.factor, min(self.min_pixels, bound), bound)
        if h * w > bound:  # the minimum's upward rounding passed the bound: the bound wins
            beta = math.sqrt(h * w / bound)
            h = max(self.factor, math.floor(h / beta / self.factor) * self.factor)
            w = max(self.factor, math.floor(w / beta / self.factor) * self.factor)
        return h, w

    def _patches(self, frames: np.ndarray) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """frames [T, 3, H, W] float32 in [-1, 1] (T a multiple of the temporal patch) -> patches."""
        c = self.vcfg
        t, ch, height, width = frames.shape
        gt, gh, gw, m, p, tp = t // c.temporal_patch_size, height // c.patch_size, width // c.patch_size, \
            c.spatial_merge_size, c.patch_size, c.temporal_patch_size
        x = frames.reshape(gt, tp, ch, gh // m, m, p, gw // m, m, p)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [gt, gh/m, gw/m, m, m, ch, tp, p, p]
        flat = np.ascontiguousarray(x).reshape(gt * gh * gw, ch * tp * p * p)
        return torch.from_numpy(flat).to(torch.bfloat16), (gt, gh, gw)

    def _pixels(self, image, h: int, w: int) -> np.ndarray:
        from PIL import Image

        img = image if image.size == (w, h) else image.resize((w, h), Image.Resampling.BICUBIC)
        arr = np.asarray(img, dtype=np.float32) / 255.0
        return ((arr - MEAN) / STD).transpose(2, 0, 1)  # [3, H, W]

    def prepare_image(self, image, max_merged: int):
        h, w = self._size(image.height, image.width, max_merged)
        px = self._pixels(image, h, w)
        frames = np.repeat(px[None], self.vcfg.temporal_patch_size, axis=0)
        pv, grid = self._patches(frames)
        return pv, grid, grid[1] * grid[2] // self.vcfg.spatial_merge_size ** 2

    def prepare_video(self, frames: list, times: list[float], max_merged: int):
        tp = self.vcfg.temporal_patch_size
        if len(frames) % tp:
            frames, times = frames + frames[-1:] * (tp - len(frames) % tp), times + times[-1:] * (tp - len(frames) % tp)
        h, w = self._size(frames[0].height, frames[0].width, max_merged)
        px = np.stack([self._pixels(f, h, w) for f in frames])
        pv, grid = self._patches(px)
        stamps = [(times[i] + times[i + tp - 1]) / 2 for i in range(0, len(times), tp)]
        return pv, grid, grid[0] * grid[1] * grid[2] // self.vcfg.spatial_merge_size ** 2, {"timestamps": stamps}

    def expand(self, ids: list[int], items: list[PreparedMedia]) -> Expansion:
        m = self.vcfg.spatial_merge_size
        out: list[int] = []
        spans: list[MediaSpan] = []
        rope_runs: list[tuple[int, int, int, int, int]] = []  # (start, length, t, h, w) of media runs
        it = iter(items)
        i = 0
        while i < len(ids):
            tok = ids[i]
            if tok == self.placeholder_ids[IMAGE]:
                item = next(it)
                _, gh, gw = item.grid
                spans.append(MediaSpan(len(out), item.tokens, item))
                rope_runs.append((len(out), item.tokens, 1, gh // m, gw // m))
                out += [tok] * item.tokens
            elif tok == self.placeholder_ids[VIDEO]:
                item = next(it)
                gt, gh, gw = item.grid
                per = gh * gw // m ** 2
                # the template wrote vision_start before the placeholder: each frame pair brings its own
                if out and out[-1] == self.vision_start:
                    out.pop()
                if i + 1 < len(ids) and ids[i + 1] == self.vision_end:
                    i += 1
                stamps = item.extra.get("timestamps") or [0.0] * gt
                for k, stamp in enumerate(stamps):
                    out += self._text(f"<{stamp:.1f} seconds>")
                    out.append(self.vision_start)
                    spans.append(MediaSpan(len(out), per, item, offset=k * per))
                    rope_runs.append((len(out), per, 1, gh // m, gw // m))
                    out += [tok] * per
                    out.append(self.vision_end)
            else:
                out.append(tok)
            i += 1
        positions, delta = self._rope(len(out), rope_runs)
        return Expansion(out, spans, positions, delta)

    def _text(self, text: str) -> list[int]:
        if self.encode_text is None:
            raise RuntimeError("video timestamps need the server's tokenizer (encode_text)")
        return list(self.encode_text(text))

    @staticmethod
    def _rope(total: int, runs: list[tuple[int, int, int, int, int]]) -> tuple[torch.Tensor, int]:
        """mRoPE positions [3, total]: text advances all axes by one; a media run of h x w
        merged tokens takes t = current, h/w = current + row/col, and the text after it resumes at
        current + max(h, w)."""
        pos = torch.empty(3, total, dtype=torch.int64)
        cur, at = 0, 0
        for start, length, _t, h, w in runs:
            n = start - at
            pos[:, at:start] = torch.arange(cur, cur + n)
            cur += n
            hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            pos[0, start:start + length] = cur
            pos[1, start:start + length] = cur + hh.reshape(-1)
            pos[2, start:start + length] = cur + ww.reshape(-1)
            cur += max(h, w)
            at = start + length
        pos[:, at:] = torch.arange(cur, cur + total - at)
        delta = int(pos.max()) + 1 - total if total else 0
        return pos, delta
