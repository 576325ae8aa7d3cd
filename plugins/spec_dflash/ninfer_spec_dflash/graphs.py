"""CUDA Graphs of the DFlash / DFlash2 draft pass, one per (lane bucket, context width bucket, K).

A round's draft pass is a fixed function of three int64 vectors per lane (its context-store row, its
last token, its position) once the lane count is padded to a bucket (1, 2, 4, 8) and the context
read is cut to a power-of-two width W >= the furthest lane's position: `body(rows, tokens, bases, W, K)`
gathers the lanes' context from the store, embeds [token, mask x K], runs the drafter and picks the
drafts [B, K] (argmax, or the DFlash2 selector's walk), all on the device with no host sync. The
graph's inputs live in one pinned [3, B] buffer that a round fills with a single copy; padding lanes
read the store's scratch row (no valid key) at position 0. The store re-allocating (it grows by
doubling) drops every graph. Without CUDA, or with graphs off, `run` calls the same body on the
same static buffers (`static=True`, what the CPU tests exercise) or directly (`static=False`).
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("ninfer.spec.dflash")

LANE_BUCKETS = (1, 2, 4, 8)
MIN_WIDTH = 64


def lane_bucket(b: int) -> int | None:
    """The smallest graph lane count >= b (None past the largest: eager)."""
    return next((x for x in LANE_BUCKETS if x >= b), None)


def width_bucket(n: int) -> int:
    """The context width read for a furthest position n: a power of two, at least MIN_WIDTH."""
    w = MIN_WIDTH
    while w < n:
        w *= 2
    return w


def graphs_wanted(runner) -> bool:
    """Graphs when the runner runs its own (CUDA, graphs on); NINFER_DFLASH_GRAPHS=0 turns them off."""
    return os.environ.get("NINFER_DFLASH_GRAPHS", "1") != "0" and bool(getattr(runner, "graphs_enabled", False))


class DraftGraphs:
    def __init__(self, body, store, device):
        self.body, self.store, self.device = body, store, torch.device(device)
        self.graphs: dict[tuple[int, int, int], dict] = {}  # (lanes, width, drafts)
        self._generation = store.generation
        self._pool = None
        self.captures = 0  # graphs captured so far (a test's and the log's count)

    def clear(self) -> None:
        self.graphs.clear()
        self._pool = None

    def run(self, rows: list[int], tokens: list[int], bases: list[int], width: int, k: int, static: bool = True):
        """Drafts [B, K] of the lanes (a view of the bucket's output on the graph path)."""
        b = len(rows)
        bucket = lane_bucket(b)
        if bucket is None or not static:
            dev = self.device
            t = torch.tensor([rows, tokens, bases], dtype=torch.int64).to(dev)
            return self.body(t[0], t[1], t[2], width, k)
        if self.store.generation != self._generation:  # the store moved: the graphs point at old tensors
            self.clear()
            self._generation = self.store.generation
        g = self.graphs.get((bucket, width, k)) or self._make(bucket, width, k)
        host = g["host"]
        host.zero_()
        host[0, :b] = torch.tensor(rows, dtype=torch.int64)
        host[1, :b] = torch.tensor(tokens, dtype=torch.int64)
        host[2, :b] = torch.tensor(bases, dtype=torch.int64)
        g["inputs"].copy_(host, non_blocking=True)
        if g["graph"] is not None:
            g["graph"].replay()
            return g["out"][:b]
        inp = g["inputs"]
        return self.body(inp[0], inp[1], inp[2], width, k)[:b]

    def _make(self, bucket: int, width: int, k: int) -> dict:
        cuda = self.device.type == "cuda"
        host = torch.zeros(3, bucket, dtype=torch.int64)
        if cuda:
            host = host.pin_memory()
        inputs = torch.zeros(3, bucket, dtype=torch.int64, device=self.device)
        g = {"host": host, "inputs": inputs, "graph": None, "out": None}
        if cuda:
            torch.cuda.synchronize(self.device)
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up on the scratch row (cuBLAS picks, SDPA's kernel choice)
                    self.body(inputs[0], inputs[1], inputs[2], width, k)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.body(inputs[0], inputs[1], inputs[2], width, k)
            torch.cuda.synchronize(self.device)
            g.update(graph=graph, out=out)
            log.info("captured the draft graph for %d lanes, %d drafts, %d context positions", bucket, k, width)
        self.captures += 1
        self.graphs[(bucket, width, k)] = g
        return g
