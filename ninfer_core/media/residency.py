"""Built-in vision residencies (`--vision-residency`): resident (the tower on the runner's device,
for the process lifetime) and cpu (an FP32 tower on host threads, no device memory).

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
    def load(cls, family, artifact, runner, options) -> "ResidentResidency":
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
    def load(cls, family, artifact, runner, options) -> "CpuResidency":
        import torch

        return cls(family.vision_tower(artifact, "cpu", torch.float32))

    def encode(self, item: PreparedMedia):
        with self._one:
            return self.tower.encode(item)

    def describe(self) -> dict:
        return {"residency": self.name, "device_bytes": 0}


@hookimpl
def ninfer_register_vision_residencies(register):
    register("resident", "ninfer_core.media.residency:ResidentResidency")
    register("cpu", "ninfer_core.media.residency:CpuResidency")
