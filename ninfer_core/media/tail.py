"""The overlay window's fallback: the evict-ranked tail of the text weights (spec "Vision residency").

When free KV pages cannot cover a window, it is funded from the device memory of the text weights
that rank last for the next prefill unit: the output head, the token embedding, then the draft and
MTP heads (the runner's `evictable_weights()`, in that order). Their bytes are copied once into a
pinned host mirror; an exclusive window then takes over the storages of as many of them as it needs
(whole storages, deduplicated: tied weights share one), and closing it copies the mirror back into
the same addresses, so every tensor, view and captured graph over them reads its old bytes again.

The window is exclusive: while it is open the borrowed weights hold tower tensors, so the engine
runs nothing else until it closes (the encode runs on the worker itself). The mirror is refreshed
whenever a storage's address or size changed since it was taken (a model suspend regrows them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ninfer_core.media.window import DeviceWindow, fits


def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class WeightTail:
    """Lends the runner's evict-ranked weight storages to exclusive overlay windows."""

    def __init__(self, weights: Callable[[], Sequence[Any]]):
        self.weights = weights  # read at each loan: a suspend/resume regrows the storages
        self.mirrors: dict[int, tuple[tuple[int, int], Any]] = {}  # rank -> ((ptr, bytes), host copy)
        self.loans = 0
        self.open: DeviceWindow | None = None
        self.last: dict = {}  # the last loan's facts: evict_bytes, evict_ms, restore_ms

    def regions(self) -> list[Any]:
        """One uint8 tensor over each distinct storage of the tail, in eviction order."""
        import torch

        seen, out = set(), []
        for t in self.weights() or ():
            if t is None or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            if key in seen or key[1] == 0:
                continue
            seen.add(key)
            out.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),)))
        return out

    def capacity(self) -> int:
        return sum(int(r.numel()) for r in self.regions())

    def _mirror(self, rank: int, region: Any) -> Any:
        import torch

        key = (region.data_ptr(), int(region.numel()))
        held = self.mirrors.get(rank)
        if held is not None and held[0] == key:
            return held[1]
        cuda = region.device.type == "cuda"
        host = torch.empty(region.shape, dtype=torch.uint8, pin_memory=cuda)
        host.copy_(region)
        self.mirrors[rank] = (key, host)
        return host

    def borrow(self, sizes: Sequence[int]) -> DeviceWindow | None:
        """An exclusive window over the fewest leading tail storages that hold `sizes`, or None
        when the whole tail cannot. The caller runs nothing else on the device until `give_back`."""
        if self.open is not None:
            raise RuntimeError("an exclusive overlay window is already open")
        regions = self.regions()
        take = next((n for n in range(1, len(regions) + 1) if fits(sizes, [int(r.numel()) for r in regions[:n]])),
                    None)
        if take is None:
            return None
        regions = regions[:take]
        t0 = time.monotonic()
        _sync(regions[0].device)  # no forward still reads the weights about to be overwritten
        mirrors = [self._mirror(i, r) for i, r in enumerate(regions)]
        window = DeviceWindow(regions, "tail")
        window.mirrors = mirrors
        self.open = window
        self.loans += 1
        self.last = {"evict_bytes": sum(int(r.numel()) for r in regions),
                     "evict_ms": (time.monotonic() - t0) * 1000.0, "restore_ms": 0.0}
        return window

    def give_back(self, window: DeviceWindow) -> None:
        """Copy every borrowed storage back from its mirror; the weights read as before the loan."""
        if window is not self.open:
            raise RuntimeError("this window is not the open exclusive window")
        t0 = time.monotonic()
        cuda = window.regions[0].device.type == "cuda"
        for region, host in zip(window.regions, window.mirrors):
            region.copy_(host, non_blocking=cuda)
        _sync(window.regions[0].device)  # restored before the prefill unit's forward
        self.open = None
        self.last["restore_ms"] = (time.monotonic() - t0) * 1000.0
