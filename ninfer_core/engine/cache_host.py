"""The Host KV tier: pinned Host copies of KV pages, one page at a time (spec "Server options":
Host KV "is consumed in physical page extents").

`--host-kv-mib` (or the Host KV share of `--host-cache-mib`) is a number of Host pages of one Device
page's bytes. A demoted checkpoint holds one reference on each Host page covering its frontier, as
a Device checkpoint does on Device pages; checkpoints that shared a Device page share its one Host
copy. A page returns to the free list when its last holder lets go. Pure bookkeeping plus the page
tensors; the cache moves bytes with the runner's read_pages/write_pages.
"""

from __future__ import annotations

from typing import Any

import torch

from ninfer_core.engine.pages import RefCounted


class HostPagePool(RefCounted):
    label = "Host KV"

    def __init__(self, capacity_pages: int, page_bytes: int):
        super().__init__()
        self.capacity = max(0, int(capacity_pages))
        self.page_bytes = page_bytes
        self._data: dict[int, dict[str, Any]] = {}  # host page -> {tensor name: [1, ...]}
        self._next = 0
        self._free_ids: list[int] = []

    @property
    def num_free(self) -> int:
        return self.capacity - len(self._refs)

    @property
    def bytes_used(self) -> int:
        return self.num_used * self.page_bytes

    def store(self, tensors: dict[str, Any]) -> list[int]:
        """Keep copies of n pages ({name: tensor [n, ...]}); each new page has one reference."""
        n = next(iter(tensors.values())).shape[0] if tensors else 0
        if n > self.num_free:
            raise RuntimeError(f"Host KV: {n} pages asked, {self.num_free} free")
        ids = []
        for i in range(n):
            pid = self._free_ids.pop() if self._free_ids else self._take()
            self._data[pid] = {k: v[i: i + 1].clone() for k, v in tensors.items()}
            self._refs[pid] = 1
            ids.append(pid)
        return ids

    def _take(self) -> int:
        self._next += 1
        return self._next - 1

    def _release(self, page: int) -> None:
        del self._data[page]
        self._free_ids.append(page)

    def gather(self, pages: list[int]) -> dict[str, Any]:
        """The pages' tensors stacked, {name: [len(pages), ...]} (what write_pages takes)."""
        names = self._data[pages[0]].keys() if pages else ()
        return {k: torch.cat([self._data[p][k] for p in pages]) for k in names}
