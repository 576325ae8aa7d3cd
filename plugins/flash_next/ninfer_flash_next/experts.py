"""Routed-expert residency (`--expert-residency device|host|disk`) and the device expert cache.

`device`: the fused expert banks are module parameters (`ninfer_core.nn.moe.Experts`). `host`: the
banks stay in host memory (pinned on CUDA) and `disk`: they stay in the artifact's file, read per
expert with pread when one is needed. Either way a device cache of `--expert-cache-mib` holds the
most recently used experts (LRU over (layer, expert)); a routed expert found there is a hit, a
missing one is copied into a slot (`--expert-misses staged`, the default) or, for host experts,
read where it lies (`mapped`: computed from host memory, on the CPU, without evicting anything).
Host experts with a cache of 0 are all computed from host memory. The arithmetic is the expert
loop of the device path over the same values, so the output equals device residency's.

`--expert-profile-out PATH` records per-layer expert counts for the artifact; `--expert-profile
PATH` fills the cache with the most counted experts at load.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

RESIDENCIES = ("device", "host", "disk")
MISSES = ("staged", "mapped")


@dataclass
class ExpertCounters:
    routes: int = 0  # routed (token, expert) pairs
    hits: int = 0  # pairs served from a device slot already holding the expert
    cpu_routes: int = 0  # pairs computed from host memory
    admitted: int = 0  # experts copied into device slots
    transferred_bytes: int = 0
    slots: int = 0

    def report(self) -> dict:
        return {"routes": self.routes, "hits": self.hits, "misses": self.routes - self.hits,
                "cpu_routes": self.cpu_routes, "admitted": self.admitted,
                "transferred_bytes": self.transferred_bytes, "slots": self.slots}


class HostBank:
    """One layer's experts in host memory: fused [E, 2I, H] and [E, H, I]."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, pin: bool):
        gate_up, down = gate_up.to("cpu"), down.to("cpu")
        self.gate_up = gate_up.pin_memory() if pin else gate_up
        self.down = down.pin_memory() if pin else down

    def expert(self, e: int):
        return self.gate_up[e], self.down[e]


class FileBank:
    """One layer's experts left in the artifact file: per-expert or fused tensors, read on demand."""

    def __init__(self, artifact, gate_up_parts, down_parts, dtype: torch.dtype):
        # *_parts: per expert a list of (tensor name) whose rows concatenate to the expert's matrix
        self.path, self.dtype = artifact.path, dtype
        self.art = artifact
        self.gate_up_parts, self.down_parts = gate_up_parts, down_parts
        self._fd = os.open(artifact.path, os.O_RDONLY)

    def _read(self, part) -> torch.Tensor:
        name, index = part  # index: None (the whole tensor) or an expert row of a fused tensor
        off, length = self.art.tensor_file_range(name)
        shape = self.art.tensor_shape(name)
        stored = self.art.tensor_dtype(name)
        if index is not None:
            length //= shape[0]
            off += index * length
            shape = shape[1:]
        raw = os.pread(self._fd, length, off)
        np_t = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}[stored]
        t = torch.from_numpy(np.frombuffer(raw, dtype=np_t).copy()).reshape(shape)
        t = t.view(torch.bfloat16) if stored == torch.bfloat16 else t
        return t.to(self.dtype)

    def expert(self, e: int):
        gu = torch.cat([self._read(p) for p in self.gate_up_parts[e]])
        dn = torch.cat([self._read(p) for p in self.down_parts[e]])
        return gu, dn


class ExpertCache:
    """Device slots for experts of every layer, least recently used out first."""

    def __init__(self, slots: int, inter2: int, hidden: int, inter: int, dtype, device, counters: ExpertCounters):
        self.slots = slots
        self.gate_up = torch.zeros((slots, inter2, hidden), dtype=dtype, device=device) if slots else None
        self.down = torch.zeros((slots, hidden, inter), dtype=dtype, device=device) if slots else None
        self.where: OrderedDict[tuple[int, int], int] = OrderedDict()
        self.free = list(range(slots))[::-1]
        self.counters = counters
        counters.slots = slots

    def lookup(self, key):
        slot = self.where.get(key)
        if slot is not None:
            self.where.move_to_end(key)
        return slot

    def admit(self, key, gate_up: torch.Tensor, down: torch.Tensor, evict: bool = True) -> int | None:
        if self.free:
            slot = self.free.pop()
        elif evict and self.where:
            _, slot = self.where.popitem(last=False)
        else:
            return None
        self.gate_up[slot].copy_(gate_up, non_blocking=True)
        self.down[slot].copy_(down, non_blocking=True)
        self.where[key] = slot
        self.counters.admitted += 1
        self.counters.transferred_bytes += gate_up.numel() * gate_up.element_size() + down.numel() * down.element_size()
        return slot


class ExpertProfile:
    """Per-layer expert counts of one artifact and bank geometry (`--expert-profile[-out]`)."""

    def __init__(self, identity: str, geometry: dict, num_layers: int, num_experts: int):
        self.identity, self.geometry = identity, geometry
        self.counts = {}
        self.num_experts = num_experts
        self.lock = threading.Lock()
        self.out_path: str | None = None
        self._last_write = 0.0

    def record(self, layer: int, counts: list[int]) -> None:
        with self.lock:
            row = self.counts.setdefault(layer, [0] * self.num_experts)
            for e, c in enumerate(counts):
                row[e] += c

    def maybe_write(self, force: bool = False) -> None:
        if self.out_path is None or (not force and time.monotonic() - self._last_write < 2.0):
            return
        self._last_write = time.monotonic()
        with self.lock:
            doc = {"format": "ninfer-expert-profile", "version": 1, "artifact": self.identity,
                   "geometry": self.geometry, "counts": {str(k): v for k, v in sorted(self.counts.items())}}
        tmp = self.out_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, self.out_path)

    def ranked(self, path: str) -> list[tuple[int, int]]:
        """(layer, expert) pairs of a recorded profile, most counted first; ValueError when the
        profile is of another artifact or geometry."""
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"--expert-profile {path}: cannot read it ({e})") from None
        if doc.get("format") != "ninfer-expert-profile":
            raise ValueError(f"--expert-profile {path}: not an expert profile (ninfer-expert-profile)")
        if doc.get("artifact") != self.identity or doc.get("geometry") != self.geometry:
            raise ValueError(f"--expert-profile {path} was recorded for another artifact or expert geometry")
        pairs = [(int(layer), e, c) for layer, row in doc.get("counts", {}).items() for e, c in enumerate(row) if c]
        return [(layer, e) for layer, e, _ in sorted(pairs, key=lambda t: -t[2])]


class OffloadedExperts(nn.Module):
    """A layer's routed experts served from a host or file bank through the shared device cache."""

    def __init__(self, layer: int, bank, cache: ExpertCache | None, misses: str, num_experts: int,
                 counters: ExpertCounters, profile: ExpertProfile | None = None):
        super().__init__()
        self.counters = counters
        self.layer, self.bank, self.cache, self.misses = layer, bank, cache, misses
        self.num_experts, self.profile = num_experts, profile

    def _weights(self, e: int):
        """(gate_up, down, computed from host memory?, a cache hit?) for expert e."""
        c = self.cache
        if c is not None and c.slots:
            slot = c.lookup((self.layer, e))
            if slot is not None:
                return c.gate_up[slot], c.down[slot], False, True
            gu, dn = self.bank.expert(e)
            slot = c.admit((self.layer, e), gu, dn, evict=self.misses == "staged")
            if slot is not None:
                return c.gate_up[slot], c.down[slot], False, False
            return gu, dn, True, False
        gu, dn = self.bank.expert(e)
        return gu, dn, True, False

    def forward(self, x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        flat_i = top_i.reshape(-1)
        order = torch.argsort(flat_i, stable=True)
        counts = torch.bincount(flat_i, minlength=self.num_experts).tolist()
        if self.profile is not None:
            self.profile.record(self.layer, counts)
        token_of = order // top_i.shape[1]
        weight_of = top_w.reshape(-1)[order]
        counters = self.counters
        start = 0
        for e, cnt in enumerate(counts):
            if cnt == 0:
                continue
            tok = token_of[start: start + cnt]
            w = weight_of[start: start + cnt]
            start += cnt
            gu, dn, on_host, hit = self._weights(e)
            counters.routes += cnt
            counters.hits += cnt if hit else 0
            xs = x[tok]
            if on_host:
                counters.cpu_routes += cnt
                xs = xs.to(gu.device)
            gate, up = F.linear(xs, gu).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, dn).to(x.device)
            out.index_add_(0, tok, (y * w[:, None]).to(out.dtype))
        return out
