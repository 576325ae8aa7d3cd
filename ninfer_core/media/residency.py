"""Built-in vision residencies (`--vision-residency`): resident (the tower on the runner's device,
for the process lifetime), overlay (pinned host weights streamed through a device window for each
encode) and cpu (an FP32 tower on host threads, no device memory).

All three are ordinary plugins registered through `ninfer_register_vision_residencies`; a third
party adds its own the same way.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ninfer_core import hookimpl
from ninfer_core.media.api import EncodeJob, PreparedMedia, VisionResidency


class ResidentResidency(VisionResidency):
    """The tower lives on the runner's device in the runner's dtype."""

    name = "resident"

    def __init__(self, tower: Any):
        self.tower = tower

    @classmethod
    def load(cls, family, artifact, runner, options) -> ResidentResidency:
        return cls(family.vision_tower(artifact, str(runner.device), getattr(runner, "dtype", None)))

    def encode(self, item: PreparedMedia):
        return self.tower.encode(item)

    def describe(self) -> dict:
        return {"residency": self.name, "device_bytes": int(self.tower.device_bytes())}


class CpuResidency(VisionResidency):
    """An FP32 tower in host memory; one encode at a time across the process (spec)."""

    name = "cpu"

    def __init__(self, tower: Any):
        self.tower = tower
        self._one = threading.Lock()

    @classmethod
    def load(cls, family, artifact, runner, options) -> CpuResidency:
        import torch

        return cls(family.vision_tower(artifact, "cpu", torch.float32))

    def encode(self, item: PreparedMedia):
        with self._one:
            return self.tower.encode(item)

    def describe(self) -> dict:
        return {"residency": self.name, "device_bytes": 0}


class OverlayResidency(VisionResidency):
    """The tower's weights in pinned host memory in the run dtype; each encode streams them
    through a bounded device window (two block slots plus the tower's front), so between encodes
    the tower holds no device memory. The window is borrowed from free KV pages when they cover it
    (`attach` gives the engine's pool; ninfer_core.media.window) and that encode runs beside other
    lanes' decode; else from the evict-ranked tail of the text weights (ninfer_core.media.tail), an
    exclusive window restored from a pinned mirror when the encode ends; only a tail too small for
    the window takes it from the device allocator. The embeddings land in pinned host memory; the
    runner uploads each chunk's rows. The family's tower provides `pin()`, `window_tensors()` (the
    meta modules a window holds) and `encode_streamed(item, device, window)`."""

    name = "overlay"

    def __init__(self, tower: Any, device: Any):
        self.tower, self.device = tower, device
        self.lender = None  # window.PageLender once the engine attached its KV pool
        self.tail = None  # tail.WeightTail over the runner's evictable_weights()
        self.windows = {"kv": 0, "tail": 0, "allocator": 0}
        self.window_pages = 0  # pages the last KV-funded window borrowed
        self.last_encode: dict | None = None

    @classmethod
    def load(cls, family, artifact, runner, options) -> OverlayResidency:
        tower = family.vision_tower(artifact, "cpu", getattr(runner, "dtype", None))
        if not hasattr(tower, "encode_streamed"):
            raise ValueError(f"the {artifact.architecture} vision tower cannot be streamed: use "
                             "--vision-residency resident or cpu")
        tower.pin()
        return cls(tower, runner.device)

    def attach(self, pool, runner, lock=None) -> None:
        from ninfer_core.media.tail import WeightTail
        from ninfer_core.media.window import PageLender

        self.lender = PageLender(pool, getattr(runner, "kv_page_tensors", tuple), lock)
        self.tail = WeightTail(getattr(runner, "evictable_weights", tuple))

    def window_sizes(self) -> list[int]:
        from ninfer_core.media.window import nbytes_of

        return nbytes_of(self.tower.window_tensors(), self.tower.dtype)

    def open(self, item: PreparedMedia) -> EncodeJob:
        """Borrow the window now (on the worker, so the pool sees the loan before the next
        admission): free KV pages give a concurrent job, the weight tail an exclusive one."""
        from ninfer_core.media.window import allocator_window

        t0 = time.monotonic()
        sizes = self.window_sizes()
        window = self.lender.borrow(sizes) if self.lender is not None else None
        if window is None and self.tail is not None:
            window = self.tail.borrow(sizes)
        if window is None:
            window = allocator_window(sizes, self.device)
        self.windows[window.kind] += 1
        job = EncodeJob(lambda: None, exclusive=window.kind == "tail")
        job.run = lambda: self._run(item, window, job, t0)
        return job

    def _run(self, item: PreparedMedia, window, job: EncodeJob, t0: float):
        import torch

        try:
            out = self.tower.encode_streamed(item, self.device, window)
            if out.device.type == "cuda":  # the embeddings wait in pinned memory, not in the window
                host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
                host.copy_(out)
                out = host
        finally:
            if window.kind == "kv":
                self.window_pages = len(window.pages)
                self.lender.give_back(window)
            elif window.kind == "tail":
                self.tail.give_back(window)
        # what the request log's vision_overlay sums over a request's encodes (media_side)
        stats = {"window": window.kind, "ms": (time.monotonic() - t0) * 1000.0, "window_bytes": window.nbytes,
                 "staged_bytes": int(out.numel() * out.element_size()), "evict_bytes": 0, "evict_ms": 0.0,
                 "restore_ms": 0.0}
        if window.kind == "tail":
            stats.update(self.tail.last)
        job.stats = self.last_encode = stats
        return out

    def encode(self, item: PreparedMedia):
        return self.open(item).run()

    def describe(self) -> dict:
        return {"residency": self.name, "device_bytes": 0, "window_bytes": int(sum(self.window_sizes())),
                "windows": sum(self.windows.values()), "kv_windows": self.windows["kv"],
                "exclusive_windows": self.windows["tail"], "allocator_windows": self.windows["allocator"]}


@hookimpl
def ninfer_register_vision_residencies(register):
    register("resident", "ninfer_core.media.residency:ResidentResidency")
    register("overlay", "ninfer_core.media.residency:OverlayResidency")
    register("cpu", "ninfer_core.media.residency:CpuResidency")
