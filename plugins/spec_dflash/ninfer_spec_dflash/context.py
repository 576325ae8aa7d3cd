"""The drafter's context K/V of every request, in one static tensor per draft layer.

Each request that the backend has seen holds one row of the store: k/v [rows, cap, kvh, hd] per
draft layer and valid [rows, cap] (True where the row's position was observed). Row 0 is scratch:
never valid, the row of a padding lane in a CUDA Graph bucket or of a request without context.
Keeping every request in the same tensors lets a round's draft pass gather its lanes' context with
one index_select per layer (a graph input is the lanes' row ids), and a round's observations of all
lanes become one batched projection (`flush`). The store grows by doubling (rows or positions);
`generation` counts re-allocations, so graphs that point at the old tensors know to go. Every
write runs under inference mode (the tensors may be born there).
"""

from __future__ import annotations

import torch


class ContextStore:
    def __init__(self, project, layers: int, kv_heads: int, head_dim: int, device, dtype, rows: int = 9,
                 cap: int = 256):
        """`project(feats [N, L*H], pos [N])` -> a list of (k, v) [N, kvh, hd], one per draft layer."""
        self._project = project
        self.layers, self.kvh, self.hd = layers, kv_heads, head_dim
        self.device, self.dtype = torch.device(device), dtype
        self.generation = 0
        self.row_of: dict[str, int] = {}
        self.known: dict[int, int] = {}  # row -> the end of its observed positions
        self._free: list[int] = []
        self._alloc(rows, cap)
        self._pending: list[tuple[int, int, torch.Tensor]] = []  # (row, start, features [n, L*H])

    # -- storage -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _alloc(self, rows: int, cap: int) -> None:
        old = getattr(self, "k", None)
        shape = (rows, cap, self.kvh, self.hd)
        k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.layers)]
        v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.layers)]
        valid = torch.zeros(rows, cap, dtype=torch.bool, device=self.device)
        if old is not None:
            r0, c0 = self.valid.shape
            for dst, src in zip(k + v, self.k + self.v):
                dst[:r0, :c0] = src
            valid[:r0, :c0] = self.valid
            self._free.extend(range(r0, rows))
            self.generation += 1
        else:
            self._free = list(range(1, rows))
        self.k, self.v, self.valid = k, v, valid

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    @property
    def cap(self) -> int:
        return self.valid.shape[1]

    @torch.inference_mode()
    def ensure_cap(self, n: int) -> None:
        """Room for positions 0..n-1 (doubling)."""
        if n > self.cap:
            cap = self.cap
            while cap < n:
                cap *= 2
            self._alloc(self.rows, cap)

    @torch.inference_mode()
    def row(self, request_id: str, create: bool = False) -> int:
        """The request's row (0, the scratch row, when it has none and `create` is False)."""
        r = self.row_of.get(request_id)
        if r is not None or not create:
            return r or 0
        if not self._free:
            self._alloc(2 * self.rows, self.cap)
        r = self._free.pop(0)
        self.valid[r] = False
        self.known[r] = 0
        self.row_of[request_id] = r
        return r

    def release(self, request_id: str) -> None:
        r = self.row_of.pop(request_id, None)
        if r is not None:
            self._pending = [p for p in self._pending if p[0] != r]
            self.known.pop(r, None)
            self._free.append(r)

    # -- observations ------------------------------------------------------------------------------
    @torch.inference_mode()
    def observe(self, request_id: str, start: int, feats: torch.Tensor) -> None:
        """Queue the target features [n, L*H] of positions start..start+n-1 (projected at `flush`)."""
        r = self.row(request_id, create=True)
        n = feats.shape[0]
        if start + n < self.known[r]:  # a rewound lane (its positions are recomputed): later rows are stale
            self.flush_pending_of(r)
            self.valid[r, start + n:] = False
        self.known[r] = start + n
        self._pending.append((r, start, feats))

    @torch.inference_mode()
    def flush_pending_of(self, r: int) -> None:
        self._apply([p for p in self._pending if p[0] == r])
        self._pending = [p for p in self._pending if p[0] != r]

    @torch.inference_mode()
    def flush(self) -> None:
        """Project every queued observation at once (one batched pass for all lanes of a round)."""
        pending, self._pending = self._pending, []
        self._apply(pending)

    @torch.inference_mode()
    def _apply(self, pending) -> None:
        if not pending:
            return
        dev = self.device
        self.ensure_cap(max(start + f.shape[0] for _, start, f in pending))
        feats = torch.cat([f.to(dev) for _, _, f in pending])
        pos = torch.cat([torch.arange(s, s + f.shape[0]) for _, s, f in pending]).to(dev)
        rows = torch.cat([torch.full((f.shape[0],), r, dtype=torch.int64) for r, _, f in pending]).to(dev)
        for i, (k, v) in enumerate(self._project(feats, pos)):
            self.k[i][rows, pos] = k.to(self.dtype)
            self.v[i][rows, pos] = v.to(self.dtype)
        self.valid[rows, pos] = True

    def rows_of(self, request_id: str) -> dict | None:
        """One request's context as copies (tests, tools): {"k": [...], "v": [...], "valid", "n"}."""
        r = self.row_of.get(request_id)
        if r is None:
            return None
        n = self.known[r]
        return {"k": [t[r, :n].clone() for t in self.k], "v": [t[r, :n].clone() for t in self.v],
                "valid": self.valid[r, :n].clone(), "n": n}
