"""CUDA-Graph decode for the Gemma 4 runner: one graph per batch width 1..8, captured on first use.

A decode step's inputs live in two persistent device buffers a step fills with one host-to-device
copy each (from pinned host mirrors, blocking, so the mirrors can be refilled at once): int64 rows (token, position, then the write page and row of
every KV group) and int32 kernel metadata (every group's page table, the attention kernel's tiles
for each (group, window) and the per-lane arrays). The graph runs the model's own forward (the same
modules as the eager path; Context gets device tensors instead of host lists, so nothing in it
synchronises) and ends with the fp32 logits and the final hidden state, copied out for the engine.
Warm-up and capture run with every lane on a scratch ring slot and a scratch pool page the runner
keeps past the ones it hands out, so capturing touches no lane's cache.
"""

from __future__ import annotations

import logging

import torch

from ninfer_core.engine.model_api import DECODE, FINAL_HIDDEN, LOGITS_LAST, SegmentOutput
from ninfer_gemma4.attention import Context, Segment
from ninfer_gemma4.gpu.attention import block_rows

log = logging.getLogger("ninfer.gemma4")
MAX_GRAPH_BATCH = 8


class DecodeGraphs:
    def __init__(self, runner):
        self.r = runner
        self.graphs: dict[int, tuple] = {}
        self._pool = None
        ps = runner.page_size
        self.groups = list(runner.cache_spec().group_names) + (["sliding"] if runner.ring_pages else [])
        # the table width of a group: the ring, or pages for the longest context the pool can hold
        self.width = {g: (runner.ring_pages if g == "sliding" else
                          max(1, min(runner.num_pages, -(-runner.cfg.max_position_embeddings // ps))))
                      for g in self.groups}
        # (group, window, block_t) of every layer's attention: the kernel metadata the graph reads
        keys = []
        for layer in runner.model.layers:
            a = layer.self_attn
            key = (runner.group_of[a.source], a.window or 0, block_rows(a.heads // a.kv_heads, a.head_dim)[0])
            if key not in keys:
                keys.append(key)
        self.keys = keys
        b = MAX_GRAPH_BATCH
        n64 = 2 + 2 * len(self.groups)
        dev = runner.device
        pin = dev.type == "cuda"  # (the CPU runs the same buffers eagerly in the interpreter tests)
        self.host64 = torch.zeros(n64, b, dtype=torch.int64, pin_memory=pin)
        n32 = sum(b * self.width[g] for g in self.groups) + len(keys) * b * 4 + 3 * b
        self.host32 = torch.zeros(n32, dtype=torch.int32, pin_memory=pin)
        self.dev64 = torch.zeros_like(self.host64, device=dev)
        self.dev32 = torch.zeros_like(self.host32, device=dev)
        # views of the device buffers (fixed addresses: the graphs read them)
        off, self.tables, self.tiles = 0, {}, {}
        for g in self.groups:
            n = b * self.width[g]
            self.tables[g] = (self.dev32[off: off + n].view(b, self.width[g]), self.host32[off: off + n].view(b, -1))
            off += n
        for key in keys:
            self.tiles[key] = (self.dev32[off: off + 4 * b].view(b, 4), self.host32[off: off + 4 * b].view(b, 4))
            off += 4 * b
        self.per_lane = (self.dev32[off: off + 3 * b].view(3, b), self.host32[off: off + 3 * b].view(3, b))
        # numpy views of the host mirrors (same memory) for `_fill`
        self._np64 = self.host64.numpy()
        self._np_tables = {g: host.numpy() for g, (_, host) in self.tables.items()}
        self._np_tiles = {key: host.numpy() for key, (_, host) in self.tiles.items()}
        self._np_lane = self.per_lane[1].numpy()

    @staticmethod
    def eligible(segments) -> bool:
        return (len(segments) <= MAX_GRAPH_BATCH
                and all(s.kind == DECODE and len(s.tokens) == 1 and s.side is None and s.snapshot is None
                        and set(s.hidden) <= {FINAL_HIDDEN} and s.logits == LOGITS_LAST for s in segments))

    # ---- inputs -------------------------------------------------------------------------------
    def _fill(self, rows: list[tuple[int, int, int, dict]]) -> None:
        """rows: (token, position, slot, {group: table}) per lane. Written through numpy views of
        the host mirrors: a step sets a few dozen scalars, and a torch op per scalar costs more
        than the step's host work should."""
        r, ps = self.r, self.r.page_size
        h64, tables, tiles, lane = self._np64, self._np_tables, self._np_tiles, self._np_lane
        for i, (tok, pos, _slot, lane_tables) in enumerate(rows):
            h64[0, i], h64[1, i] = tok, pos
            for j, g in enumerate(self.groups):
                t = lane_tables[g]
                if len(t) > self.width[g]:
                    raise ValueError(f"a page table of {len(t)} pages for a graph table of {self.width[g]}")
                idx = (pos // ps) % r.ring_pages if g == "sliding" else pos // ps
                h64[2 + 2 * j, i], h64[3 + 2 * j, i] = t[idx], pos % ps
                tables[g][i, : len(t)] = t
            for key, tile in tiles.items():
                window = key[1]
                lo = max(0, pos - window + 1) if window > 0 else 0
                tile[i] = (i, 0, lo // ps, pos // ps)
            lane[:, i] = (i, pos, 1)
        # blocking copies: the pinned mirrors are refilled by the next step
        self.dev64.copy_(self.host64)
        self.dev32.copy_(self.host32)

    def _context(self, b: int) -> Context:
        r = self.r
        segs = [Segment(slot=0, tables={}, start=0, length=1, offset=i) for i in range(b)]
        ctx = Context(segs, self.dev64[1, :b], r.page_size, r.kv, r.group_of)
        if r.ring_pages:
            ctx.wrap["sliding"] = r.ring_pages
        for j, g in enumerate(self.groups):
            ctx.write_rows[g] = (self.dev64[2 + 2 * j, :b], self.dev64[3 + 2 * j, :b])
            ctx.device_tables[g] = self.tables[g][0][:b]
        for key in self.keys:
            ctx.kernel_meta[key] = (self.tiles[key][0][:b], self.per_lane[0][:, :b])
        return ctx

    def _body(self, b: int):
        hidden, _ = self.r.model(self.dev64[0, :b], self._context(b))
        return self.r.model.logits(hidden), hidden

    # ---- capture and replay ---------------------------------------------------------------------
    def _graph(self, b: int):
        hit = self.graphs.get(b)
        if hit is not None:
            return hit
        r = self.r
        dev = r.device
        torch.cuda.synchronize(dev)
        scratch = {g: ([r.scratch_page] * self.width[g] if g != "sliding" else r.ring_table(r.scratch_slot))
                   for g in self.groups}
        self._fill([(0, 0, r.scratch_slot, scratch)] * b)
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._body(b)
        torch.cuda.current_stream(dev).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, hidden = self._body(b)
        torch.cuda.synchronize(dev)
        self.graphs[b] = (graph, logits, hidden)
        log.info("captured Gemma 4 decode graph for batch width %d", b)
        return self.graphs[b]

    def rows(self, segments):
        rows = []
        for s in segments:
            tables = dict(s.tables)
            if self.r.ring_pages:
                tables["sliding"] = self.r.ring_table(s.slot)
            rows.append((int(s.tokens[0]), s.start, s.slot, tables))
        return rows

    def eager(self, segments):
        """The graph's body run eagerly over the same buffers (logits, hidden): the interpreter tests."""
        self._fill(self.rows(segments))
        return self._body(len(segments))

    def run(self, segments) -> list[SegmentOutput]:
        b = len(segments)
        graph, logits, hidden = self._graph(b)
        self._fill(self.rows(segments))
        graph.replay()
        out_logits = logits[:b].clone()
        want_hidden = any(FINAL_HIDDEN in s.hidden for s in segments)
        out_hidden = hidden[:b].clone() if want_hidden else None
        return [SegmentOutput(out_logits[i], {FINAL_HIDDEN: out_hidden[i: i + 1]} if FINAL_HIDDEN in s.hidden else {})
                for i, s in enumerate(segments)]
