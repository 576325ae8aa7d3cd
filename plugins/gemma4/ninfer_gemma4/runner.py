"""Gemma4Runner: the ModelRunner of the Gemma 4 family (CPU reference path).

Cache geometry: one KV group per attention kind that owns K/V (`sliding`: head_dim, KV heads and the
window of the sliding layers; `global`: global_head_dim and the global KV heads). KV-shared layers
add no cache. There is no recurrent state, so a verify needs no per-position state: `commit` only
closes the verify (KV rows past the accepted prefix are ignored by the engine's length) and a state
slot holds nothing (StateImages are empty).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer_core.engine.model_api import (
    FINAL_HIDDEN,
    LOGITS_ALL,
    LOGITS_LAST,
    PAGE_SIZE,
    VERIFY,
    CacheSpec,
    ForwardBatch,
    KVGroup,
    LaneSegment,
    ModelInfo,
    ModelRunner,
    SegmentOutput,
    StateImage,
    check_batch,
)
from ninfer_gemma4.attention import Context, Segment
from ninfer_gemma4.config import GLOBAL, SLIDING, Gemma4Config
from ninfer_gemma4.model import Gemma4TextModel

GROUP_NAMES = {SLIDING: "sliding", GLOBAL: "global"}


class Gemma4Runner(ModelRunner):
    def __init__(self, model: Gemma4TextModel, cfg: Gemma4Config, device: torch.device, dtype: torch.dtype,
                 eos_token_ids: tuple[int, ...] = ()):
        self.model, self.cfg, self.device, self.dtype = model, cfg, device, dtype
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.page_size = PAGE_SIZE
        self.num_pages = self.num_slots = 0
        self._uncommitted: dict[int, int] = {}  # slot -> verify length not committed yet
        self.group_of = {i: GROUP_NAMES[cfg.layer_types[i]] for i in range(cfg.num_hidden_layers)}
        self.info = ModelInfo(
            architecture=cfg.architecture,
            vocab_size=cfg.vocab_size,
            max_position=cfg.max_position_embeddings,
            hidden_size=cfg.hidden_size,
            eos_token_ids=tuple(eos_token_ids or cfg.eos_token_ids),
            n_params=sum(p.numel() for p in model.parameters()),
            extra={"dtype": str(dtype).removeprefix("torch."), "layer_types": list(cfg.layer_types),
                   "moe": cfg.enable_moe_block, "sliding_window": cfg.sliding_window,
                   "kv_shared_layers": cfg.num_kv_shared_layers, "per_layer_embeddings": cfg.hidden_size_per_layer_input > 0},
        )

    # ---- cache geometry ---------------------------------------------------------------------
    @property
    def _elem(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def cache_spec(self) -> CacheSpec:
        cfg, groups = self.cfg, []
        for kind in (SLIDING, GLOBAL):
            layers = cfg.kv_layers(kind)
            if not layers:
                continue
            kvh, hd = cfg.layer_kv_heads(layers[0]), cfg.layer_head_dim(layers[0])
            groups.append(KVGroup(name=GROUP_NAMES[kind], layers=layers, kv_heads=kvh, head_dim=hd,
                                  bytes_per_token=2 * len(layers) * kvh * hd * self._elem,
                                  window=cfg.sliding_window if kind == SLIDING else None,
                                  page_size=self.page_size))
        return CacheSpec(kv_groups=tuple(groups), state_bytes=0)

    def allocate_cache(self, num_pages: int, num_slots: int, page_size: int = PAGE_SIZE) -> None:
        cfg = self.cfg
        self.page_size = page_size
        self.kv = {}
        for kind in (SLIDING, GLOBAL):
            for i in cfg.kv_layers(kind):
                shape = (num_pages, page_size, cfg.layer_kv_heads(i), cfg.layer_head_dim(i))
                self.kv[i] = (torch.zeros(shape, dtype=self.dtype, device=self.device),
                              torch.zeros(shape, dtype=self.dtype, device=self.device))
        self.num_pages, self.num_slots = num_pages, num_slots
        self._uncommitted = {}

    def free_cache(self) -> None:
        self.kv = None
        self._uncommitted = {}

    def _check_slot(self, slot: int) -> None:
        if self.kv is None:
            raise RuntimeError("allocate_cache() must be called first")
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"state slot {slot} outside 0..{self.num_slots - 1}")

    def reset_slot(self, slot: int) -> None:
        self._check_slot(slot)
        self._uncommitted.pop(slot, None)

    def copy_slot(self, src: int, dst: int) -> None:
        self._check_slot(src)
        self._check_slot(dst)

    def copy_page(self, src: int, dst: int) -> None:
        for i in (src, dst):
            if not 0 <= i < self.num_pages:
                raise ValueError(f"page id {i} outside the pool of {self.num_pages} pages")
        for k, v in self.kv.values():
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])

    def capture_state(self, slot: int) -> StateImage:
        self._check_slot(slot)
        return StateImage({})

    def restore_state(self, image: StateImage, slot: int) -> None:
        self._check_slot(slot)
        if image.tensors:
            raise ValueError("StateImage holds state this model does not keep (another model?)")
        self._uncommitted.pop(slot, None)

    def read_pages(self, pages):
        idx = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        out = {}
        for i, (k, v) in self.kv.items():
            out[f"k.{i}"] = k.index_select(0, idx).to("cpu", copy=True)
            out[f"v.{i}"] = v.index_select(0, idx).to("cpu", copy=True)
        return out

    def write_pages(self, pages, data) -> None:
        idx = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        if set(data) != {f"{kv}.{i}" for i in self.kv for kv in "kv"}:
            raise ValueError("KV data does not fit this model's pages (another model)")
        for i, (k, v) in self.kv.items():
            for name, dst in ((f"k.{i}", k), (f"v.{i}", v)):
                src = data[name]
                if tuple(src.shape[1:]) != tuple(dst.shape[1:]) or src.shape[0] != len(idx):
                    raise ValueError(f"KV data does not fit this model's pages ({name})")
                dst.index_copy_(0, idx, src.to(dst.device, dst.dtype))

    # ---- forwards ---------------------------------------------------------------------------
    def _check(self, batch: ForwardBatch) -> None:
        if self.kv is None:
            raise RuntimeError("allocate_cache() must be called before a forward")
        check_batch(batch, self.cfg.vocab_size, self.num_slots, self.num_pages,
                    self.cache_spec().group_names, self.page_size)
        pending = [s.slot for s in batch.segments if s.slot in self._uncommitted]
        if pending:
            raise RuntimeError(f"state slots {pending} have an uncommitted verify (call commit first)")

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> list[SegmentOutput]:
        self._check(batch)
        # a snapshot inside a chunk leaves nothing to copy: no recurrent state, KV is in the pages
        return self._forward(batch.segments)

    def _context(self, segments: Sequence[LaneSegment]) -> Context:
        segs, off = [], 0
        for s in segments:
            segs.append(Segment(s.slot, {g: list(t) for g, t in s.tables.items()}, s.start, len(s.tokens), off))
            off += len(s.tokens)
        ps = self.page_size
        default = torch.cat([torch.arange(s.start, s.start + s.length, dtype=torch.int64) for s in segs])
        ctx = Context(segs, self._positions(segments, default).to(self.device), ps, self.kv, self.group_of)
        for name in self.cache_spec().group_names:
            pages, rows = [], []
            for s in segs:
                table = s.tables[name]
                for p in range(s.start, s.start + s.length):
                    pages.append(table[p // ps])
                    rows.append(p % ps)
            ctx.write_rows[name] = (torch.tensor(pages, device=self.device), torch.tensor(rows, device=self.device))
        return ctx

    def _positions(self, segments: Sequence[LaneSegment], default: torch.Tensor) -> torch.Tensor:
        parts, off = [], 0
        for s in segments:
            n = len(s.tokens)
            p = s.side.positions if s.side is not None else None
            if p is None:
                parts.append(default[off: off + n])
            else:
                p = torch.as_tensor(p, dtype=torch.int64)
                if p.dim() == 2:
                    if not bool((p == p[:1]).all()):
                        raise NotImplementedError("Gemma 4 text positions are one axis; multimodal positions need vision")
                    p = p[0]
                if p.shape != (n,):
                    raise ValueError(f"side positions of shape {tuple(p.shape)} for a segment of {n} tokens")
                parts.append(p.cpu())
            off += n
        return torch.cat(parts)

    def _embeds(self, segments, ids):
        """Token embeddings with side embeddings spliced in, and the PLE ids (pad at spliced rows, as
        transformers does for media placeholders); (None, None) without side embeddings."""
        if not any(s.side is not None and s.side.embeddings for s in segments):
            return None, None
        x = self.model.scaled_embed(ids).clone()
        ple_ids = ids.clone()
        off = 0
        for s in segments:
            for row, emb in (s.side.embeddings if s.side is not None else ()):
                if not (0 <= row and row + emb.shape[0] <= len(s.tokens)):
                    raise ValueError(f"side embeddings at rows {row}..{row + emb.shape[0]} outside the segment")
                x[off + row: off + row + emb.shape[0]] = emb.to(x.dtype)
                ple_ids[off + row: off + row + emb.shape[0]] = self.cfg.pad_token_id
            off += len(s.tokens)
        return x, ple_ids

    def _forward(self, segments: Sequence[LaneSegment]) -> list[SegmentOutput]:
        ids = torch.tensor([int(t) for s in segments for t in s.tokens], dtype=torch.int64, device=self.device)
        ctx = self._context(segments)
        collect = tuple(sorted({h for s in segments for h in s.hidden if h != FINAL_HIDDEN}))
        embeds, ple_ids = self._embeds(segments, ids)
        hidden, layer_out = self.model(ids, ctx, embeds, ple_ids, collect)
        outs = []
        for seg, s in zip(ctx.segments, segments):
            rows = hidden[seg.offset: seg.offset + seg.length]
            if s.kind == VERIFY:
                self._uncommitted[s.slot] = seg.length
            logits = None
            if s.logits == LOGITS_ALL:
                logits = self.model.logits(rows)
            elif s.logits == LOGITS_LAST:
                logits = self.model.logits(rows[-1])
            got = {h: layer_out[h][seg.offset: seg.offset + seg.length] for h in s.hidden if h != FINAL_HIDDEN}
            if FINAL_HIDDEN in s.hidden:
                got[FINAL_HIDDEN] = rows
            outs.append(SegmentOutput(logits, got))
        return outs

    def commit(self, kept: Sequence[tuple[int, int]]) -> None:
        for slot, n in kept:
            length = self._uncommitted.pop(slot, None)
            if length is None:
                raise RuntimeError(f"state slot {slot} has no verify to commit")
            if not 1 <= n <= length:
                raise ValueError(f"commit of {n} tokens of a verify of {length}")

    def embed(self, token_ids) -> torch.Tensor:
        return self.model.scaled_embed(torch.as_tensor(token_ids, dtype=torch.int64, device=self.device))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)
