"""Gemma 4 as pipeline stages (`--devices A,B,...`; ninfer_core.engine.pipeline).

A stage holds a contiguous range of decoder layers and the caches of those it owns (global pages,
sliding rings); the first also embeds (and computes the per-layer inputs, PLE), the last applies
the final norm and the tied LM head (a copy of the embedding matrix when it is not the first).
Every layer of a PLE model reads its row of the per-layer inputs, which are computed from the
token ids and the first embedding: the first stage computes them once and they travel with the
residual stream, [rows, hidden + layers * ple] (`stage_width`). KV-shared layers read their
source layer's cache, so a stage never starts between a source and the layers sharing it
(`pipeline_cuts`).
"""

from __future__ import annotations

import torch

from ninfer_core.engine.model_api import (
    FINAL_HIDDEN,
    LOGITS_ALL,
    LOGITS_LAST,
    VERIFY,
    ForwardBatch,
    SegmentOutput,
    StageRunner,
)
from ninfer_gemma4.config import Gemma4Config
from ninfer_gemma4.layers import rope_tables
from ninfer_gemma4.runner import Gemma4Runner


def stage_cuts(cfg: Gemma4Config) -> tuple[int, ...]:
    """The layers a stage may start at: none between a KV-shared layer and its source."""
    n = cfg.num_hidden_layers
    return tuple(b for b in range(1, n) if all(cfg.kv_source[j] >= b for j in range(b, n)))


class Gemma4StageRunner(Gemma4Runner, StageRunner):
    """A Gemma4Runner over `layers` only; `forward_stage` is its forward (no decode graphs)."""

    def __init__(self, model, cfg: Gemma4Config, device, dtype, layers: range, eos_token_ids=()):
        self.layer_range = layers
        super().__init__(model, cfg, device, dtype, eos_token_ids)
        self.first, self.last = layers.start == 0, layers.stop == cfg.num_hidden_layers
        ple = cfg.hidden_size_per_layer_input
        self.stage_width = cfg.hidden_size + (cfg.num_hidden_layers * ple if ple else 0)
        self.cuda_graph = False
        self._stage_taps: dict = {}

    def configure(self, options=None) -> None:
        super().configure(options)
        self.cuda_graph, self._graphs = False, None  # a stage's input is another process's tensor

    def forward(self, batch: ForwardBatch) -> list[SegmentOutput]:
        if not (self.first and self.last):
            raise RuntimeError("a pipeline stage runs forward_stage (ninfer_core.engine.pipeline)")
        return self.forward_stage(batch)

    def stage_layer_outputs(self) -> dict:
        return dict(self._stage_taps)

    @torch.inference_mode()
    def forward_stage(self, batch: ForwardBatch, hidden: torch.Tensor | None = None):
        self._check(batch)
        segs = list(batch.segments)
        if (hidden is None) != self.first:
            raise ValueError("the first stage embeds the tokens; every later stage needs the previous stage's hidden")
        n = sum(len(s.tokens) for s in segs)
        if hidden is not None and tuple(hidden.shape) != (n, self.stage_width):
            raise ValueError(f"stage input of shape {tuple(hidden.shape)} for {n} tokens x {self.stage_width}")
        if self.ring_pages and max(len(s.tokens) for s in segs) > self.max_segment:
            raise ValueError(f"a segment of more than {self.max_segment} tokens on a pipeline stage "
                             "(configure max_segment_tokens)")
        cfg, model = self.cfg, self.model
        ple_width = cfg.hidden_size_per_layer_input
        ids = torch.tensor([int(t) for s in segs for t in s.tokens], dtype=torch.int64, device=self.device)
        ctx = self._context(segs)
        if hidden is None:
            embeds, ple_ids = self._embeds(segs, ids)
            x = model.scaled_embed(ids) if embeds is None else embeds
            ple = model.per_layer_inputs(ids if ple_ids is None else ple_ids, x) if ple_width else None
        else:
            x = hidden[:, : cfg.hidden_size]
            ple = hidden[:, cfg.hidden_size:].reshape(n, cfg.num_hidden_layers, ple_width) if ple_width else None
        ctx.rope = {kind: rope_tables(f, ctx.positions, x.dtype) for kind, f in model.freqs.items()}
        collect = {h for s in segs for h in s.hidden if h != FINAL_HIDDEN and h in self.layer_range}
        self._stage_taps = {}
        for i in self.layer_range:
            x = model.layers[i](x, None if ple is None else ple[:, i], ctx)
            if i in collect:
                self._stage_taps[i] = x
        for s in segs:
            if s.kind == VERIFY:
                self._uncommitted[s.slot] = len(s.tokens)
            if s.snapshot is not None:  # the ring after the chunk serves the snapshot (Gemma4Runner)
                self.copy_slot(s.slot, s.snapshot[1])
        if not self.last:
            return torch.cat([x, ple.reshape(n, -1)], 1) if ple is not None else x
        out = model.norm(x)
        outs, off = [], 0
        for s in segs:
            rows = out[off: off + len(s.tokens)]
            logits = (model.logits(rows) if s.logits == LOGITS_ALL else
                      model.logits(rows[-1]) if s.logits == LOGITS_LAST else None)
            got = {h: self._stage_taps[h][off: off + len(s.tokens)] for h in s.hidden if h in self._stage_taps}
            if FINAL_HIDDEN in s.hidden:
                got[FINAL_HIDDEN] = rows
            outs.append(SegmentOutput(logits, got))
            off += len(s.tokens)
        return outs
