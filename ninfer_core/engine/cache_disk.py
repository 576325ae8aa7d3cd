"""The disk tier under the Host tier (spec "Disk tier"), simplified: one file per continuation.

When the catalog evicts a private continuation (pressure or the continuation limit), and for every
continuation still resident at shutdown, its checkpoints are written to `--disk-kv-path` in the slot
file format (`cache_slots`: KV pages of the deepest checkpoint, one StateImage per checkpoint, a
trailing SHA-256). Files live in a subdirectory per artifact and execution profile (a digest of the
compatibility facts), are named by the session's deepest-frontier digest and frontier, and share a
byte budget (`--disk-kv-gib`) from which the least recently used file goes first. With
`--disk-kv-restore`, a request with no resident prefix looks for the deepest file whose frontier
prefixes its prompt (digest first, then every token), and restores it as an ordinary continuation
before admission; any miss, torn or mismatching file falls back to computing the prompt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass

from ninfer_core.engine import cache_slots
from ninfer_core.engine.checkpoints import FNV_OFFSET, FNV_PRIME, MASK64

log = logging.getLogger("ninfer.engine.cache")
SUFFIX = ".nkv"


@dataclass
class DiskEntry:
    digest: str  # session digest of the deepest checkpoint's tokens
    frontier: int
    path: str
    nbytes: int
    last_used: float


class DiskTier:
    def __init__(self, root: str, budget_bytes: int, compat: dict, restore: bool):
        profile = hashlib.sha256(json.dumps(compat, sort_keys=True).encode()).hexdigest()[:16]
        self.dir = os.path.join(root, profile)
        os.makedirs(self.dir, exist_ok=True)
        self.budget = budget_bytes
        self.compat = dict(compat)
        self.restore = restore
        self.index: dict[tuple[str, int], DiskEntry] = {}
        self.counters = {"writes": 0, "write_bytes": 0, "restores": 0, "misses": 0, "evicted_files": 0}
        for name in os.listdir(self.dir):  # files survive restarts
            if not name.endswith(SUFFIX):
                continue
            try:
                digest, frontier = name[: -len(SUFFIX)].split("-")
                path = os.path.join(self.dir, name)
                st = os.stat(path)
                self.index[(digest, int(frontier))] = DiskEntry(digest, int(frontier), path, st.st_size,
                                                                st.st_mtime)
            except (ValueError, OSError):
                continue

    @property
    def used_bytes(self) -> int:
        return sum(e.nbytes for e in self.index.values())

    def write(self, image: cache_slots.SlotImage, now: float) -> None:
        """Write an evicted continuation (replacing a file of the same session); never raises."""
        deepest = max(c["frontier"] for c in image.checkpoints)
        digest = cache_slots.session_digest(image.session[:deepest])
        key = (digest, deepest)
        try:
            data = cache_slots.encode(image)
            if len(data) > self.budget:
                return
            while self.used_bytes + len(data) > self.budget and self.index:
                self._remove(min(self.index.values(), key=lambda e: e.last_used))
            name = f"{digest}-{deepest}{SUFFIX}"
            cache_slots.write_atomic(self.dir, name, data)
        except Exception as e:  # noqa: BLE001 - the disk tier is best effort: memory is released anyway
            log.warning("disk tier: writing a %d-token session failed: %s", deepest, e)
            return
        self.index[key] = DiskEntry(digest, deepest, os.path.join(self.dir, name), len(data), now)
        self.counters["writes"] += 1
        self.counters["write_bytes"] += len(data)

    def lookup(self, prompt: list[int], now: float) -> cache_slots.SlotImage | None:
        """The deepest stored session whose frontier prefixes the prompt, read and verified."""
        if not self.restore or not self.index:
            return None
        frontiers = {e.frontier for e in self.index.values() if e.frontier < len(prompt)}
        if not frontiers:
            self.counters["misses"] += 1
            return None
        digests: dict[int, str] = {}
        h, top = FNV_OFFSET, max(frontiers)
        for i, t in enumerate(prompt[:top], 1):
            h = ((h ^ (int(t) & MASK64)) * FNV_PRIME) & MASK64
            if i in frontiers:
                digests[i] = f"{h:016x}"
        for f in sorted(frontiers, reverse=True):
            entry = self.index.get((digests[f], f))
            if entry is None:
                continue
            image = self._read(entry, prompt)
            if image is not None:
                entry.last_used = now
                self.counters["restores"] += 1
                return image
        self.counters["misses"] += 1
        return None

    def _read(self, entry: DiskEntry, prompt: list[int]) -> cache_slots.SlotImage | None:
        try:
            with open(entry.path, "rb") as f:
                image = cache_slots.decode(f.read(), self.compat)
        except Exception as e:  # noqa: BLE001 - a torn or foreign file is a miss
            log.warning("disk tier: %s is unreadable (%s); dropped", os.path.basename(entry.path), e)
            self._remove(entry)
            return None
        deepest = max(c["frontier"] for c in image.checkpoints)
        if image.session[:deepest] != prompt[:deepest]:
            return None  # a digest collision: never reuse state of another prefix
        return image

    def _remove(self, entry: DiskEntry) -> None:
        self.index.pop((entry.digest, entry.frontier), None)
        self.counters["evicted_files"] += 1
        try:
            os.unlink(entry.path)
        except OSError:
            pass

    def snapshot(self) -> dict:
        return {"disk_bytes_used": self.used_bytes, "disk_files": len(self.index), **self.counters}
