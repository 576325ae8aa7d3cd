"""The KV page pool: fixed-size pages of `PAGE_SIZE` tokens handed to sequences by id.

Pure CPU bookkeeping; the model runner owns the tensors the ids index. Pages are reference
counted so a checkpoint of the context cache and the sequences resumed from it share the full
pages of a prefix; a page returns to the free list when its last holder frees it. A shared page is
read-only by rule: whoever writes past a checkpoint's frontier into its partly filled tail page
writes into a private copy (copy-on-write, see `ninfer_core.engine.cache`).
"""

from __future__ import annotations

from ninfer_core.engine.model_api import PAGE_SIZE


def pages_for(tokens: int, page_size: int = PAGE_SIZE) -> int:
    """Pages needed to hold `tokens` positions (ceil)."""
    return -(-max(tokens, 0) // page_size)


class RefCounted:
    """Holders per page id, shared by the Device page pool and the Host KV tier: `share` adds one
    holder to each page, `free` drops one and calls `_release` when the last holder is gone. An id
    that is not held, or one named twice in a `free`, is an invariant failure."""

    label = "pages"

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}  # allocated page -> holders

    @property
    def num_used(self) -> int:
        return len(self._refs)

    def refcount(self, page: int) -> int:
        return self._refs.get(page, 0)

    def share(self, pages: list[int]) -> list[int]:
        """Add one holder to each (allocated) page and return them; pair with `free`."""
        bad = [p for p in pages if p not in self._refs]
        if bad:
            raise RuntimeError(f"{self.label}: sharing pages not held: {sorted(bad)}")
        for p in pages:
            self._refs[p] += 1
        return list(pages)

    def free(self, pages: list[int]) -> None:
        """Drop one holder of each page."""
        bad = [p for p in pages if p not in self._refs]
        if bad or len(set(pages)) != len(pages):
            raise RuntimeError(f"{self.label}: freeing pages not held: {sorted(bad) or pages}")
        for p in pages:
            n = self._refs[p] - 1
            if n:
                self._refs[p] = n
            else:
                del self._refs[p]
                self._release(p)

    def _release(self, page: int) -> None:
        raise NotImplementedError


class PagePool(RefCounted):
    """A free list of page ids with reference counts; `allocate` and `free` are all-or-nothing.

    Freed pages are reused last-freed-first, so a sequence seldom gets a contiguous run and a
    wrong page mapping shows up in tests instead of passing by luck.
    """

    def __init__(self, num_pages: int, page_size: int = PAGE_SIZE):
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        super().__init__()
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

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
        for p in pages:
            self._refs[p] = 1
        return pages

    def allocate_run(self, n: int) -> list[int] | None:
        """Take `n` free pages with consecutive ids (one contiguous row range of every page-major
        cache tensor: an overlay vision window borrows them), or None when no such run is free."""
        if n < 1 or n > len(self._free):
            return None
        free = sorted(self._free)
        run = 1
        for i in range(1, len(free) + 1):
            if run >= n:
                first = free[i - n]
                pages = list(range(first, first + n))
                taken = set(pages)
                self._free = [p for p in self._free if p not in taken]
                for p in pages:
                    self._refs[p] = 1
                return pages
            if i == len(free):
                break
            run = run + 1 if free[i] == free[i - 1] + 1 else 1
        return None

    label = "page pool"

    def _release(self, page: int) -> None:
        self._free.append(page)
