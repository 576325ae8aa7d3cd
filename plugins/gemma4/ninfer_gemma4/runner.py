"""Gemma4Runner: the ModelRunner of the Gemma 4 family (CPU reference path).

Cache geometry (KV per layer group):
- Global layers keep their K/V in the engine's paged pool (one KV group, `global`: global_head_dim
  and the global KV heads); this is what grows with the context.
- Sliding layers keep only a ring of `ring_pages` pages per state slot, enough for the window plus
  the longest run of new tokens one forward brings (`RunnerOptions.max_segment_tokens`, the
  engine's prefill chunk): position p of a lane lives in ring page (p // page) % ring_pages of its
  slot (its table is `ring_table(slot)`, read with wrap-around). A forward writes its rows before it attends, so a key a query needs (at most window - 1
  behind it) is overwritten only by a position at least ring_pages * page ahead of it, and
  ring_pages * page >= chunk + window - 1 keeps that outside any forward. The ring is the lane's
  state: a checkpoint captures it (`capture_state`), `copy_slot` forks it, a snapshot inside a chunk
  copies it after the chunk (the rows past the snapshot are rewritten before any query reads them).
  So a sliding layer holds window + chunk tokens per lane whatever the context, and no page of the
  pool is ever spent on it (llama.cpp keeps a sliding-window cache of window + ubatch the same way).
- KV-shared layers add no cache (they read their source layer's pages or ring).
- `--kv-dtype int8|fp8|k8v4` (ninfer_core.quant.kv) stores the global layers' pool pages quantised,
  with a per-token, per-KV-head fp32 scale beside them (`kv_scale`); the sliding rings, a fixed
  window + chunk per lane, stay in the model dtype.
Segments longer than the ring allows (a caller that did not state its chunk) run as several
forwards of at most that length. There is no recurrent state: a verify keeps its rows in place and
`commit` only closes it (rows past the accepted prefix are rewritten before they are read).
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
    RunnerOptions,
    SegmentOutput,
    StateImage,
    check_batch,
)
from ninfer_gemma4.attention import Context, Segment
from ninfer_gemma4.config import GLOBAL, SLIDING, Gemma4Config
from ninfer_gemma4.model import Gemma4TextModel

GROUP_NAMES = {SLIDING: "sliding", GLOBAL: "global"}
RING = GROUP_NAMES[SLIDING]  # not a pool group: the per-slot ring of the sliding layers
DEFAULT_SEGMENT = 256  # new tokens per forward when the caller states none (RunnerOptions)


class Gemma4Runner(ModelRunner):
    def __init__(self, model: Gemma4TextModel, cfg: Gemma4Config, device: torch.device, dtype: torch.dtype,
                 eos_token_ids: tuple[int, ...] = (), kv_format=None):
        from ninfer_core.quant.kv import kv_format as _kv_format
        from ninfer_core.quant.transform import encoded_params
        from ninfer_core.quant.weight import QuantizedWeight

        self.model, self.cfg, self.device, self.dtype = model, cfg, device, dtype
        self.kv_format = _kv_format(kv_format)  # --kv-dtype of the global layers' pages
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.kv_scale: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # global layer -> (K, V) scales
        self._encoded_experts = any(isinstance(getattr(m, "gate_up_proj", None), QuantizedWeight)
                                    for m in model.modules())
        self.page_size = PAGE_SIZE
        self.num_pages = self.num_slots = 0
        self._uncommitted: dict[int, int] = {}  # slot -> verify length not committed yet
        self.max_segment = DEFAULT_SEGMENT
        self.ring_pages = 0
        self.cuda_graph = True
        self._graphs = None  # gpu.graphs.DecodeGraphs, made on the first graphed decode
        self.scratch_page = self.scratch_slot = -1
        self.group_of = {i: GROUP_NAMES[cfg.layer_types[i]] for i in range(cfg.num_hidden_layers)}
        # use_bidirectional_attention "vision": a media item's rows attend to each other in the
        # sliding layers, so the engine hands each item to one forward whole
        self.whole_media_spans = cfg.bidirectional_vision
        if device.type == "cuda":  # decode-sized linears through core's GEMV (issue 21; NINFER_GEMV=0: cuBLAS)
            from ninfer_core.accel.gemv import use_gemv

            self.gemv_linears = use_gemv(model)
            from ninfer_gemma4.gpu.step import prepare

            # q|k|v and gate|up fused, the fused forward of gpu/step.py (NINFER_GEMMA4_FUSE=0: off)
            self.fused_step = prepare(model)
        self.info = ModelInfo(
            architecture=cfg.architecture,
            vocab_size=cfg.vocab_size,
            max_position=cfg.max_position_embeddings,
            hidden_size=cfg.hidden_size,
            eos_token_ids=tuple(eos_token_ids or cfg.eos_token_ids),
            n_params=sum(p.numel() for p in model.parameters()) + encoded_params(model),
            extra={"dtype": str(dtype).removeprefix("torch."), "layer_types": list(cfg.layer_types),
                   "moe": cfg.enable_moe_block, "sliding_window": cfg.sliding_window,
                   "kv_shared_layers": cfg.num_kv_shared_layers, "per_layer_embeddings": cfg.hidden_size_per_layer_input > 0,
                   "kv_dtype": self.kv_format.name},
        )

    # ---- cache geometry ---------------------------------------------------------------------
    layer_range: range | None = None  # a pipeline stage's decoder layers (ninfer_gemma4.stage); None: all

    def _kv_layers(self, kind: str) -> tuple[int, ...]:
        """The layers of `kind` owning a K/V cache that this runner holds."""
        layers = self.cfg.kv_layers(kind)
        return layers if self.layer_range is None else tuple(i for i in layers if i in self.layer_range)

    @property
    def _elem(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def configure(self, options: RunnerOptions | None = None) -> None:
        if options is not None:
            if options.max_segment_tokens > 0:
                self.max_segment = int(options.max_segment_tokens)
            if bool(options.cuda_graph) != self.cuda_graph:
                self.cuda_graph = bool(options.cuda_graph)
                self._graphs = None

    @property
    def graphs_enabled(self) -> bool:
        # quantised pages (per-lane attention launches) and encoded experts (their per-expert loop
        # reads the routed ids on the host) decode without CUDA Graphs
        return (self.cuda_graph and self.device.type == "cuda" and not self.kv_format.quantized
                and not self._encoded_experts)

    def _ring_pages(self, page_size: int) -> int:
        window = self.cfg.sliding_window or 0
        if not self._kv_layers(SLIDING) or window <= 0:
            return 0
        return -(-(self.max_segment + window - 1) // page_size)

    def _ring_bytes_per_token(self) -> int:
        return sum(2 * self.cfg.layer_kv_heads(i) * self.cfg.layer_head_dim(i) * self._elem
                   for i in self._kv_layers(SLIDING))

    def cache_spec(self) -> CacheSpec:
        cfg, groups = self.cfg, []
        layers = self._kv_layers(GLOBAL)
        if layers:
            kvh, hd = cfg.layer_kv_heads(layers[0]), cfg.layer_head_dim(layers[0])
            groups.append(KVGroup(name=GROUP_NAMES[GLOBAL], layers=layers, kv_heads=kvh, head_dim=hd,
                                  bytes_per_token=self.kv_format.bytes_per_token(len(layers), kvh, hd, self._elem),
                                  page_size=self.page_size))
        ring = self._ring_pages(self.page_size) * self.page_size * self._ring_bytes_per_token()
        return CacheSpec(kv_groups=tuple(groups), state_bytes=ring, state_layers=self._kv_layers(SLIDING))

    def decode_state_bytes(self, context: int) -> int:
        """Ring bytes one decode step moves per lane (`ninfer bench`'s floor): the window's rows read
        and one row written per sliding layer."""
        rows = min(context, self.cfg.sliding_window or 0) + 1
        return rows * self._ring_bytes_per_token() if self._ring_pages(self.page_size) else 0

    @property
    def ring_tokens(self) -> int:
        """Sliding-layer positions one slot holds (window + chunk, rounded up to pages)."""
        return self._ring_pages(self.page_size) * self.page_size

    def allocate_cache(self, num_pages: int, num_slots: int, page_size: int = PAGE_SIZE) -> None:
        cfg = self.cfg
        self._graphs = None
        self.page_size = page_size
        self.ring_pages = self._ring_pages(page_size)
        # on CUDA one scratch pool page and one scratch ring slot past the engine's (graph capture)
        extra = 1 if self.device.type == "cuda" else 0
        self.scratch_page, self.scratch_slot = (num_pages, num_slots) if extra else (-1, -1)
        self.kv, self.kv_scale = {}, {}
        fmt = self.kv_format
        for kind in (SLIDING, GLOBAL):
            rows = (num_slots + extra) * self.ring_pages if kind == SLIDING else num_pages + extra
            for i in self._kv_layers(kind):
                kvh, hd = cfg.layer_kv_heads(i), cfg.layer_head_dim(i)
                if kind == GLOBAL and fmt.quantized:
                    k, ks = fmt.allocate(fmt.k_kind, rows, page_size, kvh, hd, self.dtype, self.device)
                    v, vs = fmt.allocate(fmt.v_kind, rows, page_size, kvh, hd, self.dtype, self.device)
                    self.kv[i], self.kv_scale[i] = (k, v), (ks, vs)
                    continue
                shape = (rows, page_size, kvh, hd)
                self.kv[i] = (torch.zeros(shape, dtype=self.dtype, device=self.device),
                              torch.zeros(shape, dtype=self.dtype, device=self.device))
        self.num_pages, self.num_slots = num_pages, num_slots
        self._uncommitted = {}

    def kv_page_tensors(self) -> tuple:
        """The global layers' K and V pages (a model suspend copies only the pages in use); the
        sliding rings are state slots, copied whole."""
        return tuple(self._page_tensors().values()) if self.kv is not None else ()

    def _page_tensors(self) -> dict:
        """The pool's per-page tensors by name: "k.3", "v.3", and with a quantised --kv-dtype "ks.3", "vs.3"."""
        out = {}
        for i in self._kv_layers(GLOBAL):
            out[f"k.{i}"], out[f"v.{i}"] = self.kv[i]
            if i in self.kv_scale:
                out[f"ks.{i}"], out[f"vs.{i}"] = self.kv_scale[i]
        return out

    @property
    def _pool_groups(self) -> tuple[str, ...]:
        """The pool's KV group names (cache_spec's, without building the spec on every forward)."""
        return (GROUP_NAMES[GLOBAL],) if self._kv_layers(GLOBAL) else ()

    def _ring(self, slot: int):
        """The ring rows of `slot` in the sliding layers' tensors."""
        return slice(slot * self.ring_pages, (slot + 1) * self.ring_pages)

    def ring_table(self, slot: int) -> list[int]:
        """The ring's page ids of `slot`: page index j of a lane reads entry j % ring_pages."""
        base = slot * self.ring_pages
        return list(range(base, base + self.ring_pages))

    def free_cache(self) -> None:
        self._graphs = None
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
        if src != dst:
            for i in self._kv_layers(SLIDING):
                for t in self.kv[i]:
                    t[self._ring(dst)] = t[self._ring(src)]

    def copy_page(self, src: int, dst: int) -> None:
        for i in (src, dst):
            if not 0 <= i < self.num_pages:
                raise ValueError(f"page id {i} outside the pool of {self.num_pages} pages")
        for t in self._page_tensors().values():
            t[dst].copy_(t[src])

    def capture_state(self, slot: int) -> StateImage:
        self._check_slot(slot)
        out = {}
        for i in self._kv_layers(SLIDING):
            k, v = self.kv[i]
            out[f"ring.k.{i}"] = k[self._ring(slot)].to("cpu", copy=True)
            out[f"ring.v.{i}"] = v[self._ring(slot)].to("cpu", copy=True)
        return StateImage(out)

    def restore_state(self, image: StateImage, slot: int) -> None:
        self._check_slot(slot)
        want = {f"ring.{kv}.{i}" for i in self._kv_layers(SLIDING) for kv in "kv"}
        if set(image.tensors) != want:
            raise ValueError("StateImage does not fit this model's sliding-window ring (another model?)")
        for i in self._kv_layers(SLIDING):
            for kv, dst in zip("kv", self.kv[i]):
                src = image.tensors[f"ring.{kv}.{i}"]
                view = dst[self._ring(slot)]
                if tuple(src.shape) != tuple(view.shape):
                    raise ValueError(f"StateImage ring of shape {tuple(src.shape)} for a ring of {tuple(view.shape)} "
                                     "(another chunk size or model)")
                view.copy_(src.to(dst.device, dst.dtype))
        self._uncommitted.pop(slot, None)

    def read_pages(self, pages):
        idx = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        return {name: _bytes(t).index_select(0, idx).to("cpu", copy=True).view(t.dtype)
                for name, t in self._page_tensors().items()}

    def write_pages(self, pages, data) -> None:
        idx = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        tensors = self._page_tensors()
        name = self.kv_format.name
        if set(data) != set(tensors):
            if any(n.startswith(("ks.", "vs.")) for n in data) != self.kv_format.quantized:
                raise ValueError(f"KV data was stored with another --kv-dtype than this cache's {name}")
            raise ValueError("KV data does not fit this model's pages (another model)")
        for key, dst in tensors.items():
            src = data[key]
            if src.dtype != dst.dtype and (self.kv_format.quantized or not src.dtype.is_floating_point):
                raise ValueError(f"KV data stored as {str(src.dtype).removeprefix('torch.')} does not fit this "
                                 f"cache's --kv-dtype {name} pages ({key})")
            if tuple(src.shape[1:]) != tuple(dst.shape[1:]) or src.shape[0] != len(idx):
                raise ValueError(f"KV data does not fit this model's pages ({key})")
        for key, dst in tensors.items():
            src = data[key].to(dst.device, dst.dtype)
            _bytes(dst).index_copy_(0, idx, _bytes(src))

    # ---- forwards ---------------------------------------------------------------------------
    def _check(self, batch: ForwardBatch) -> None:
        if self.kv is None:
            raise RuntimeError("allocate_cache() must be called before a forward")
        check_batch(batch, self.cfg.vocab_size, self.num_slots, self.num_pages,
                    self._pool_groups, self.page_size)
        pending = [s.slot for s in batch.segments if s.slot in self._uncommitted]
        if pending:
            raise RuntimeError(f"state slots {pending} have an uncommitted verify (call commit first)")

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> list[SegmentOutput]:
        self._check(batch)
        segments = list(batch.segments)
        if self.graphs_enabled:
            from ninfer_gemma4.gpu.graphs import DecodeGraphs

            if DecodeGraphs.eligible(segments):
                if self._graphs is None:
                    self._graphs = DecodeGraphs(self)
                return self._graphs.run(segments)
        if self.ring_pages and max(len(s.tokens) for s in segments) > self.max_segment:
            return self._forward_split(segments)
        outs = self._forward(segments)
        for s in segments:  # the ring after the chunk serves the snapshot too (module docstring)
            if s.snapshot is not None:
                self.copy_slot(s.slot, s.snapshot[1])
        return outs

    def _forward_split(self, segments: list[LaneSegment]) -> list[SegmentOutput]:
        """Segments longer than the ring allows, as rounds of at most `max_segment` new tokens per lane."""
        if any(s.kind == VERIFY for s in segments):
            raise ValueError(f"a verify of more than {self.max_segment} tokens (configure max_segment_tokens)")
        n = self.max_segment
        if self.whole_media_spans:  # a media item's rows attend to each other: a cut would change them
            for s in segments:
                for row, e in (s.side.embeddings if s.side is not None else ()):
                    if (row + int(e.shape[0]) - 1) // n != row // n:
                        raise ValueError(f"a media item of {int(e.shape[0])} rows does not fit forwards of "
                                         f"{n} tokens (configure max_segment_tokens to hold it)")
        parts: list[list[SegmentOutput]] = [[] for _ in segments]
        rounds = max(-(-len(s.tokens) // n) for s in segments)
        for r in range(rounds):
            live, pieces = [], []
            for j, s in enumerate(segments):
                lo = r * n
                if lo >= len(s.tokens):
                    continue
                hi = min(lo + n, len(s.tokens))
                snap = None
                if s.snapshot is not None and lo < s.snapshot[0] <= hi:
                    snap = (s.snapshot[0] - lo, s.snapshot[1])
                    if snap[0] == hi - lo:  # at the piece's end: the state after this piece
                        snap = (0, snap[1])
                last = hi == len(s.tokens)
                want = s.logits if (last or s.logits == LOGITS_ALL) else "none"
                live.append(j)
                pieces.append((LaneSegment(s.slot, s.tables, s.start + lo, list(s.tokens[lo:hi]), s.kind, want,
                                           s.hidden, None, _side_slice(s.side, lo, hi)), snap))
            outs = self._forward([p for p, _ in pieces])
            for j, (piece, snap), out in zip(live, pieces, outs):
                if snap is not None:
                    self.copy_slot(piece.slot, snap[1])
                parts[j].append(out)
        return [_join(s, p) for s, p in zip(segments, parts)]

    def _context(self, segments: Sequence[LaneSegment]) -> Context:
        segs, off = [], 0
        for s in segments:
            tables = {g: list(t) for g, t in s.tables.items()}
            if self.ring_pages:
                tables[RING] = self.ring_table(s.slot)
            blocks = ()
            if self.cfg.bidirectional_vision and s.side is not None and s.side.embeddings:
                # absolute positions [a, b) of each media run (one item's rows; spans never adjoin)
                blocks = tuple((s.start + row, s.start + row + int(e.shape[0])) for row, e in s.side.embeddings)
            segs.append(Segment(s.slot, tables, s.start, len(s.tokens), off, blocks))
            off += len(s.tokens)
        ps = self.page_size
        default = torch.cat([torch.arange(s.start, s.start + s.length, dtype=torch.int64) for s in segs])
        ctx = Context(segs, self._positions(segments, default).to(self.device), ps, self.kv, self.group_of,
                      kv_scale=self.kv_scale, kv_format=self.kv_format)
        if self.ring_pages:
            ctx.wrap[RING] = self.ring_pages
        rows = (default % ps).to(self.device)
        for name in (*self._pool_groups, *((RING,) if self.ring_pages else ())):
            wrap = ctx.wrap.get(name, 0)
            index = default // ps % wrap if wrap else default // ps
            pages, off = [], 0
            for s in segs:
                pages.append(torch.as_tensor(s.tables[name], dtype=torch.int64)[index[off: off + s.length]])
                off += s.length
            ctx.write_rows[name] = (torch.cat(pages).to(self.device), rows)
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
        # media rows carry identity ids past the vocabulary: their lookups are overwritten below
        ids = ids.clamp(max=self.cfg.vocab_size - 1)
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


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 pages as their bytes (index_select / index_copy_ have no fp8 kernels)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _side_slice(side, lo: int, hi: int):
    """The side inputs of rows [lo, hi) of a segment (positions cut, embeddings re-based)."""
    if side is None:
        return None
    from dataclasses import replace

    pos = side.positions
    if pos is not None:
        pos = torch.as_tensor(pos)[..., lo:hi]
    emb = []
    for row, e in side.embeddings or ():
        a, b = max(row, lo), min(row + e.shape[0], hi)
        if a < b:
            emb.append((a - lo, e[a - row: b - row]))
    return replace(side, positions=pos, embeddings=emb)


def _join(seg: LaneSegment, parts: list[SegmentOutput]) -> SegmentOutput:
    if seg.logits == LOGITS_ALL:
        logits = torch.cat([p.logits for p in parts])
    else:
        logits = parts[-1].logits
    hidden = {h: torch.cat([p.hidden[h] for p in parts]) for h in parts[-1].hidden}
    return SegmentOutput(logits, hidden)
