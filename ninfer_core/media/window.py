"""The overlay residency's device window: memory one encode borrows, and the block streaming.

spec "Vision residency": a window is funded from free KV pages when they cover it. Free pages hold
nothing, so nothing is copied: the encode takes a run of consecutive free page ids out of the pool
(`PagePool.allocate_run`), and in every cache tensor the runner indexes by page id
(`ModelRunner.kv_page_tensors`) those rows are one contiguous byte region. The window's tensors
(two block slots and the tower's front: embeddings, merger or projector) are carved out of those
regions, first fit by decreasing size. While the loan is open the pages are allocated, so the
admission capacity shrinks with it and nothing is admitted into lent memory; closing it zeroes the
bytes (the pages read as an unwritten cache again, whatever KV format reads them) and frees them.
When free pages cannot cover the window it is funded from the evicted tail of the text weights
(`ninfer_core.media.tail`, an exclusive window); only a tail too small for it falls back to the
device allocator.

`stream_blocks` runs the blocks through the two slots: the next block's weights are copied on a
side stream while the current block computes, so every slot is filled once per block.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

ALIGN = 256  # bytes: every carved tensor starts on a boundary any dtype view accepts


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _place(sizes: Sequence[int], capacities: Sequence[int]) -> list[tuple[int, int]] | None:
    """First fit by decreasing size: [(region, offset)] per size (in the given order), or None."""
    used = [0] * len(capacities)
    out: list[tuple[int, int] | None] = [None] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        need = _align(sizes[i])
        for r, cap in enumerate(capacities):
            if used[r] + need <= cap:
                out[i] = (r, used[r])
                used[r] += need
                break
        else:
            return None
    return out  # type: ignore[return-value]


def _tensors(modules: Sequence[Any]) -> list[tuple[Any, str, Any]]:
    """(owner module, attribute, meta tensor) of every parameter and buffer of `modules`."""
    out = []
    for mod in modules:
        for owner in mod.modules():
            for name, p in list(owner.named_parameters(recurse=False)):
                out.append((owner, name, p))
            for name, b in list(owner.named_buffers(recurse=False)):
                if b is not None:
                    out.append((owner, name, b))
    return out


def nbytes_of(modules: Sequence[Any], dtype: Any) -> list[int]:
    """Bytes of every tensor of `modules` in `dtype` (floating tensors take `dtype`)."""
    import torch

    def size(t):
        dt = dtype if t.is_floating_point() else t.dtype
        return t.numel() * torch.empty((), dtype=dt).element_size()

    return [size(t) for _, _, t in _tensors(modules)]


class DeviceWindow:
    """Byte regions (uint8, one device) that a streamed encode's modules are materialized in."""

    def __init__(self, regions: list[Any], kind: str, pages: list[int] | None = None):
        self.regions = regions
        self.kind = kind  # "kv" (free KV pages) | "tail" (evicted text weights) | "allocator"
        self.pages = pages or []
        self.mirrors: list[Any] = []  # a "tail" window: the pinned host copies it restores from

    @property
    def nbytes(self) -> int:
        return sum(int(r.numel()) for r in self.regions)

    def materialize(self, modules: Sequence[Any], dtype: Any) -> None:
        """Point every parameter and buffer of the meta-built `modules` at window memory (their
        values are whatever the window holds: fill them before use)."""
        from torch import nn

        entries = _tensors(modules)
        sizes = nbytes_of(modules, dtype)
        spots = _place(sizes, [int(r.numel()) for r in self.regions])
        if spots is None:
            raise RuntimeError(f"the {self.kind} window of {self.nbytes} bytes cannot hold {sum(sizes)} bytes")
        for (owner, name, t), size, (r, off) in zip(entries, sizes, spots):
            dt = dtype if t.is_floating_point() else t.dtype
            view = self.regions[r][off: off + size].view(dt).view(t.shape)
            if isinstance(t, nn.Parameter):
                setattr(owner, name, nn.Parameter(view, requires_grad=False))
            else:
                owner._buffers[name] = view


def fits(sizes: Sequence[int], capacities: Sequence[int]) -> bool:
    return _place(sizes, capacities) is not None


class PageLender:
    """Lends runs of free KV pages to overlay encodes (one engine's pool and runner).

    `lock` is the engine's lock, held while the pool changes (snapshots read it concurrently)."""

    def __init__(self, pool: Any, page_tensors: Callable[[], Sequence[Any]], lock: Any = None):
        self.pool = pool
        self.page_tensors = page_tensors  # read at each loan: a suspend/resume reallocates the cache
        self.lock = lock if lock is not None else threading.Lock()
        self.loans = 0
        self.open_pages = 0

    def _carvable(self) -> list[Any]:
        """The cache tensors whose rows can be carved (contiguous, page-major over the whole pool)."""
        return [t for t in self.page_tensors() or ()
                if t.is_contiguous() and t.dim() >= 1 and t.shape[0] >= self.pool.num_pages]

    def pages_for(self, sizes: Sequence[int], tensors: Sequence[Any] | None = None) -> int | None:
        """The fewest consecutive pages whose regions hold `sizes`, or None (not even the whole pool)."""
        tensors = self._carvable() if tensors is None else tensors
        row = [t[0].numel() * t.element_size() for t in tensors]
        if not row:
            return None
        lo, hi = 1, self.pool.num_pages
        if not fits(sizes, [hi * b for b in row]):
            return None
        while lo < hi:  # more pages never hold less: bisect the smallest run
            mid = (lo + hi) // 2
            if fits(sizes, [mid * b for b in row]):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def borrow(self, sizes: Sequence[int]) -> DeviceWindow | None:
        """A window over free pages that holds `sizes`, or None when the free pages cannot cover it."""
        tensors = self._carvable()
        n = self.pages_for(sizes, tensors)
        if n is None:
            return None
        with self.lock:
            pages = self.pool.allocate_run(n)
        if pages is None:
            return None
        import torch

        first = pages[0]
        regions = [t[first: first + n].reshape(-1).view(torch.uint8) for t in tensors]
        self.loans += 1
        self.open_pages += n
        return DeviceWindow(regions, "kv", pages)

    def give_back(self, window: DeviceWindow) -> None:
        """Zero the lent rows and return the pages to the pool."""
        for r in window.regions:
            r.zero_()
        if window.regions and window.regions[0].device.type == "cuda":
            import torch  # the zeroing (on the encode's stream) is done before a lane may write them

            torch.cuda.current_stream(window.regions[0].device).synchronize()
        with self.lock:
            self.pool.free(window.pages)
        self.open_pages -= len(window.pages)


def allocator_window(sizes: Sequence[int], device: Any) -> DeviceWindow:
    import torch

    total = sum(_align(s) for s in sizes)
    return DeviceWindow([torch.empty(total, dtype=torch.uint8, device=device)], "allocator")


def stream_blocks(host_blocks: Sequence[Any], slots: Sequence[Any], run: Callable[[Any, Any], Any], x: Any,
                  device: Any) -> Any:
    """x through every host block in order, each copied into one of the two device `slots` (the
    next on a copy stream while the current computes); `run(slot, x)` is one block's forward."""
    import torch

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    copy_stream = torch.cuda.Stream(device=dev) if cuda else None
    ready: list = [None] * len(slots)
    fill = fill_from

    def load(i: int) -> None:
        target = slots[i % len(slots)]
        if not cuda:
            fill(target, host_blocks[i])
            return
        compute = torch.cuda.current_stream(dev)
        with torch.cuda.stream(copy_stream):
            copy_stream.wait_stream(compute)  # the slot's previous block has finished
            fill(target, host_blocks[i])
            ev = torch.cuda.Event()
            ev.record(copy_stream)
            ready[i % len(slots)] = ev

    n = len(host_blocks)
    if n:
        load(0)
    for i in range(n):
        if i + 1 < n:
            load(i + 1)
        if cuda:
            torch.cuda.current_stream(dev).wait_event(ready[i % len(slots)])
        x = run(slots[i % len(slots)], x)
    return x


def fill_from(dst: Any, src: Any) -> None:
    """Copy a host module's parameters and buffers into its device twin, matched by name (`dst`
    may hold only some of `src`'s submodules: a tower's front without its blocks)."""
    import torch

    params, buffers = dict(src.named_parameters()), dict(src.named_buffers())
    with torch.no_grad():
        for name, a in list(dst.named_parameters()) + list(dst.named_buffers()):
            b = params.get(name, buffers.get(name))
            if b is None:
                raise KeyError(f"the host module has no tensor {name!r}")
            a.copy_(b, non_blocking=a.device.type == "cuda")
