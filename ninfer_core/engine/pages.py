"""The KV page pool: fixed-size pages of `PAGE_SIZE` tokens handed to sequences by id.

Pure CPU bookkeeping; the model runner owns the tensors the ids index.
"""

from __future__ import annotations

from ninfer_core.engine.model_api import PAGE_SIZE


def pages_for(tokens: int, page_size: int = PAGE_SIZE) -> int:
    """Pages needed to hold `tokens` positions (ceil)."""
    return -(-max(tokens, 0) // page_size)


class PagePool:
    """A free list of page ids; `allocate` and `free` are all-or-nothing.

    Freed pages are reused last-freed-first, so a sequence seldom gets a contiguous run and a
    wrong page mapping shows up in tests instead of passing by luck.
    """

    def __init__(self, num_pages: int, page_size: int = PAGE_SIZE):
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages; raises RuntimeError when fewer are free (the caller checks first)."""
        if n < 0 or n > len(self._free):
            raise RuntimeError(f"page pool: asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages; a page that is not allocated is an invariant failure."""
        bad = [p for p in pages if p not in self._used]
        if bad or len(set(pages)) != len(pages):
            raise RuntimeError(f"page pool: freeing pages not held: {sorted(bad) or pages}")
        for p in pages:
            self._used.remove(p)
            self._free.append(p)
