"""Prepared media payloads keyed by content digest: single-flight builds, an LRU under a byte bound.

A key is SHA-256 of the acquired bytes plus modality and preparation key (detail, bound), so the
same bytes at two details are two items. Concurrent misses of one key run one build; the others
wait for it and share its result (or its error). `--media-cache-mib` bounds what stays after the
requests that used it are gone (0 keeps nothing); eviction never invalidates a payload a request
still holds, since requests keep their own references.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future

from ninfer_core.engine.api import EngineError
from ninfer_core.media.api import PreparedMedia


class MediaCache:
    """`live` (a LiveBudget) accounts every payload object from its build until the last
    reference (cache, request, engine) is gone; a build that cannot fit after evicting the LRU
    retention fails with media_budget_exceeded."""

    def __init__(self, capacity_bytes: int, live: LiveBudget | None = None):
        self.capacity = max(0, int(capacity_bytes))
        self.live = live
        self._lock = threading.Lock()
        self._items: collections.OrderedDict[str, PreparedMedia] = collections.OrderedDict()
        self._building: dict[str, Future] = {}
        self.bytes = 0
        self.hits = self.misses = self.shared = self.evictions = 0

    def get_or_build(self, key: str, build: Callable[[], PreparedMedia]) -> tuple[PreparedMedia, str]:
        """(payload, how): how is "hit", "miss" (built here) or "single_flight" (built by another caller)."""
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return item, "hit"
            fut = self._building.get(key)
            owner = fut is None
            if owner:
                fut = self._building[key] = Future()
                self.misses += 1
            else:
                self.shared += 1
        if not owner:
            return fut.result(), "single_flight"
        try:
            item = build()
            self._account(item)
        except BaseException as e:
            with self._lock:
                self._building.pop(key, None)
            fut.set_exception(e)
            raise
        with self._lock:
            self._building.pop(key, None)
            self._insert(key, item)
        fut.set_result(item)
        return item, "miss"

    def _account(self, item: PreparedMedia) -> None:
        live, n = self.live, item.nbytes
        if live is None:
            return
        while not live.take(n):
            with self._lock:
                if not self._items:
                    raise EngineError(400, "media_budget_exceeded", f"A prepared media item of {n} bytes does not "
                                      f"fit the live media budget ({live.used} of {live.capacity} bytes held by "
                                      "running requests; --media-live-mib).")
                _, old = self._items.popitem(last=False)  # its bytes return once no request holds it
                self.bytes -= old.nbytes
                self.evictions += 1
            del old
        weakref.finalize(item, live.give, n)

    def _insert(self, key: str, item: PreparedMedia) -> None:
        if item.nbytes > self.capacity:
            return
        self._items[key] = item
        self.bytes += item.nbytes
        while self.bytes > self.capacity and self._items:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.nbytes
            self.evictions += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"items": len(self._items), "bytes": self.bytes, "capacity_bytes": self.capacity,
                    "hits": self.hits, "misses": self.misses, "single_flight": self.shared,
                    "evictions": self.evictions}


class LiveBudget:
    """Bytes of every payload a request holds (`--media-live-mib`): a request whose payloads would
    pass the bound is refused with media_budget_exceeded rather than holding memory it cannot get."""

    def __init__(self, capacity_bytes: int):
        self.capacity = max(0, int(capacity_bytes))
        self._lock = threading.Lock()
        self.used = 0

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self.used + nbytes > self.capacity:
                return False
            self.used += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.used = max(0, self.used - nbytes)
