"""Built-in vision residencies (`--vision-residency`): resident (the tower on the runner's device,
for the process lifetime), overlay (pinned host weights streamed through a device window for each
encode) and cpu (an FP32 tower on host threads, no device memory).

Both are ordinary plugins registered through `ninfer_register_vision_residencies`; a third party
adds its own (an overlay that streams the tower through borrowed device memory) the same way.
"""

from __future__ import annotations

import threading
from typing import Any

from ninfer_core import hookimpl
from ninfer_core.media.api import PreparedMedia, VisionResidency


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
    through a bounded device window (two block slots), so between encodes the tower holds no
    device memory. The family's tower provides `encode_streamed(item, device)`, `pin()` and
    `window_bytes()`. The window is taken from the device allocator for the encode (not yet from
    free KV pages, and without the text-weight fallback the spec describes)."""

    name = "overlay"

    def __init__(self, tower: Any, device: Any):
        self.tower, self.device = tower, device
        self.windows = 0

    @classmethod
    def load(cls, family, artifact, runner, options) -> OverlayResidency:
        tower = family.vision_tower(artifact, "cpu", getattr(runner, "dtype", None))
        if not hasattr(tower, "encode_streamed"):
            raise ValueError(f"the {artifact.architecture} vision tower cannot be streamed: use "
                             "--vision-residency resident or cpu")
        tower.pin()
        return cls(tower, runner.device)

    def encode(self, item: PreparedMedia):
        self.windows += 1
        return self.tower.encode_streamed(item, self.device)

    def describe(self) -> dict:
        return {"residency": self.name, "device_bytes": 0, "window_bytes": int(self.tower.window_bytes()),
                "windows": self.windows}


@hookimpl
def ninfer_register_vision_residencies(register):
    register("resident", "ninfer_core.media.residency:ResidentResidency")
    register("overlay", "ninfer_core.media.residency:OverlayResidency")
    register("cpu", "ninfer_core.media.residency:CpuResidency")
