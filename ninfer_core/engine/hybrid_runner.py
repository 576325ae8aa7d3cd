"""HybridRunner: the ModelRunner of a hybrid Gated DeltaNet + paged gated-attention model (reference
path: cache ownership, the forward contract over prefill / decode / verify segments, commit, the
MTP draft head), shared by the families built from `ninfer_core.nn`.

The model it drives is the family's text model (an nn.Module) with: `layers` (each with
`layer_type` and, for "linear_attention", `linear_attn.state_shapes()`), `layer_range`, `first` and
`last` (a pipeline stage holds a range of the layers), `embed_tokens`, `rotary`
(`ninfer_core.nn.layers.RotaryEmbedding`), `forward(ids, ctx, collect, embeds, hidden=)` -> hidden
states [N, H] and `logits(hidden)` -> fp32 logits. The config is a `ninfer_core.nn.config.HybridConfig`.
A family subclasses it to add cache tensors (KV pages or state slots of its own layers)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer_core.engine.model_api import (
    FINAL_HIDDEN,
    LOGITS_ALL,
    LOGITS_LAST,
    PAGE_SIZE,
    PREFILL,
    VERIFY,
    CacheSpec,
    ForwardBatch,
    KVGroup,
    LaneSegment,
    ModelInfo,
    ModelRunner,
    SegmentOutput,
    StageRunner,
    StateImage,
    check_batch,
)
from ninfer_core.nn.config import HybridConfig
from ninfer_core.nn.context import CacheTensors, ForwardContext, Segment
from ninfer_core.nn.mtp import MtpHead

ATTN_GROUP = "full_attention"


class HybridRunner(StageRunner, ModelRunner):
    def __init__(
        self,
        model: torch.nn.Module,
        cfg: HybridConfig,
        device: torch.device,
        dtype: torch.dtype,
        mtp: MtpHead | None = None,
        eos_token_ids: tuple[int, ...] = (),
        kv_format=None,
        gdn_state_fp16: bool = False,
    ):
        from ninfer_core.quant.kv import kv_format as _kv_format

        self.model, self.cfg, self.device, self.dtype, self.mtp = model, cfg, device, dtype, mtp
        # a pipeline stage holds the layers of `model.layer_range` only (ninfer_core.engine.pipeline)
        self.attn_layers = tuple(i for i in cfg.full_attention_layers if i in model.layer_range)
        self.gdn_layers = tuple(i for i in cfg.linear_attention_layers if i in model.layer_range)
        self.kv_format = _kv_format(kv_format)  # --kv-dtype: the main attention layers' page storage
        # --gdn-state-fp16: StateImages (checkpoints, Host tier, slot and disk files) hold the GDN
        # recurrent state in fp16; the live slots compute and keep it in fp32
        self.gdn_state_fp16 = bool(gdn_state_fp16)
        self.cache: CacheTensors | None = None
        self.num_pages = self.num_slots = 0
        self.draft = None  # the enabled MtpDraftHead, or None
        # verify segments of the last forward not committed yet: {slot: (layer states, final hidden [T, H])}
        self._uncommitted: dict[int, tuple[dict, torch.Tensor]] = {}
        from ninfer_core.quant.transform import encoded_params

        n_params = sum(p.numel() for p in model.parameters()) + encoded_params(model)
        self.info = ModelInfo(
            architecture=cfg.architecture,
            vocab_size=cfg.vocab_size,
            max_position=cfg.max_position_embeddings,
            hidden_size=cfg.hidden_size,
            eos_token_ids=tuple(eos_token_ids or cfg.eos_token_ids),
            n_params=n_params,
            extra={
                "dtype": str(dtype).removeprefix("torch."),
                "layer_types": list(cfg.layer_types),
                "moe": cfg.is_moe,
                "mtp": mtp is not None,
                "kv_dtype": self.kv_format.name,
                "gdn_state": "f16" if self.gdn_state_fp16 else "f32",
            },
        )

    # ---- cache geometry ---------------------------------------------------------------------
    @property
    def _elem(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def cache_spec(self) -> CacheSpec:
        cfg, elem = self.cfg, self._elem
        attn_layers = self.attn_layers
        kv_bytes = self.kv_format.bytes_per_token(len(attn_layers), cfg.num_key_value_heads, cfg.head_dim, elem)
        conv = cfg.gdn_conv_dim * (cfg.linear_conv_kernel_dim - 1) * elem
        ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * (
            2 if self.gdn_state_fp16 else 4)
        groups = []
        if attn_layers:
            groups.append(KVGroup(name=ATTN_GROUP, layers=attn_layers, kv_heads=cfg.num_key_value_heads,
                                  head_dim=cfg.head_dim, bytes_per_token=kv_bytes))
        state = len(self.gdn_layers) * (conv + ssm)
        if self.draft is not None:
            groups.append(self.draft.kv_group_spec(elem))
            state += cfg.hidden_size * elem
        return CacheSpec(kv_groups=tuple(groups), state_bytes=state, state_layers=self.gdn_layers)

    def allocate_cache(self, num_pages: int, num_slots: int, page_size: int = PAGE_SIZE) -> None:
        cfg, dev = self.cfg, self.device
        cache = CacheTensors(page_size=page_size, kv_format=self.kv_format)
        fmt, kvh, hd = self.kv_format, cfg.num_key_value_heads, cfg.head_dim
        for i in self.attn_layers:
            k, ks = fmt.allocate(fmt.k_kind, num_pages, page_size, kvh, hd, self.dtype, dev)
            v, vs = fmt.allocate(fmt.v_kind, num_pages, page_size, kvh, hd, self.dtype, dev)
            cache.kv[i] = (k, v)
            if fmt.quantized:
                cache.kv_scale[i] = (ks, vs)
        for i in (self.draft.layer_ids if self.draft else ()):  # the draft head's pages stay in the run dtype
            shape = (num_pages, page_size, kvh, hd)
            cache.kv[i] = (torch.zeros(shape, dtype=self.dtype, device=dev),
                           torch.zeros(shape, dtype=self.dtype, device=dev))
        for i in self.gdn_layers:
            conv_shape, ssm_shape = self.model.layers[i].linear_attn.state_shapes()
            cache.conv[i] = torch.zeros((num_slots, *conv_shape), dtype=self.dtype, device=dev)
            cache.ssm[i] = torch.zeros((num_slots, *ssm_shape), dtype=torch.float32, device=dev)
        if self.draft is not None:
            cache.hidden = torch.zeros((num_slots, cfg.hidden_size), dtype=self.dtype, device=dev)
        self.cache, self.num_pages, self.num_slots = cache, num_pages, num_slots
        self._uncommitted = {}

    def free_cache(self) -> None:
        """Drop the cache tensors (before a re-allocation, or to enable a draft head)."""
        self.cache = None
        self._uncommitted = {}

    def kv_page_tensors(self) -> tuple:
        """Every layer's K and V pages (a model suspend copies only the pages in use)."""
        return tuple(self.cache.page_tensors().values()) if self.cache is not None else ()

    def evictable_weights(self) -> tuple:
        """lm_head, the token embedding (one storage when tied) and the MTP head, in that order."""
        out = []
        for mod in (getattr(self.model, "lm_head", None), getattr(self.model, "embed_tokens", None), self.mtp):
            if mod is not None:
                out += [t for t in (*mod.parameters(), *mod.buffers()) if t.device.type != "meta"]
        return tuple(out)

    def reset_slot(self, slot: int) -> None:
        self._check_slot(slot)
        self._uncommitted.pop(slot, None)
        for t in self.cache.slot_tensors().values():
            t[slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        self._check_slot(src)
        self._check_slot(dst)
        for t in self.cache.slot_tensors().values():
            t[dst].copy_(t[src])

    # ---- context cache: checkpoints' KV pages and StateImages ---------------------------------
    def copy_page(self, src: int, dst: int) -> None:
        for i in (src, dst):
            if not 0 <= i < self.num_pages:
                raise ValueError(f"page id {i} outside the pool of {self.num_pages} pages")
        for t in self.cache.page_tensors().values():
            t[dst].copy_(t[src])

    # Host copies go to pinned memory (the spec's pinned Host tiers): every tensor's device-to-host
    # copy is queued without waiting and the stream is synchronised once, so an image of a large
    # model moves at the link's rate instead of one pageable round trip per layer tensor.
    def _to_host(self, tensors: dict) -> dict:
        if self.device.type != "cuda":
            return {name: t.to("cpu", copy=True) for name, t in tensors.items()}
        out = {}
        for name, t in tensors.items():
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            out[name] = host
        torch.cuda.current_stream(self.device).synchronize()
        return out

    def capture_state(self, slot: int) -> StateImage:
        self._check_slot(slot)
        image = self._to_host({name: t[slot] for name, t in self.cache.slot_tensors().items()})
        if self.gdn_state_fp16:
            image = {n: t.to(torch.float16) if n.startswith("ssm.") else t for n, t in image.items()}
        return StateImage(image)

    def restore_state(self, image: StateImage, slot: int) -> None:
        self._check_slot(slot)
        pairs = []
        for name, t in self.cache.slot_tensors().items():
            src = image.tensors.get(name)
            want = torch.float16 if self.gdn_state_fp16 and name.startswith("ssm.") else t.dtype
            if src is not None and src.dtype != want and name.startswith("ssm."):
                raise ValueError(f"StateImage holds the GDN state {name!r} in {str(src.dtype).removeprefix('torch.')}"
                                 f", this server keeps {str(want).removeprefix('torch.')} (--gdn-state-fp16 differs)")
            if src is None or tuple(src.shape) != tuple(t[slot].shape) or src.dtype != want:
                raise ValueError(f"StateImage does not fit this model's state {name!r}")
            pairs.append((t[slot], src))
        if set(image.tensors) - set(self.cache.slot_tensors()):
            raise ValueError("StateImage holds state this model does not keep (another speculative setup?)")
        for dst, src in pairs:  # pinned sources copy asynchronously, in stream order with the forward
            dst.copy_(src, non_blocking=True)
        self._uncommitted.pop(slot, None)

    def read_pages(self, pages):
        idx = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        return self._to_host({name: t.index_select(0, idx) for name, t in self.cache.page_tensors().items()})

    def write_pages(self, pages, data) -> None:
        idx = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        tensors = self.cache.page_tensors()
        if set(data) != set(tensors):
            scaled = any(n.startswith(("ks.", "vs.")) for n in data)
            if scaled != self.kv_format.quantized:
                raise ValueError(f"KV data was stored with another --kv-dtype than this cache's "
                                 f"{self.kv_format.name}")
            raise ValueError("KV data does not fit this model's pages (another model or speculative setup)")
        for name, dst in tensors.items():
            src = data[name]
            if src.dtype != dst.dtype:
                raise ValueError(f"KV data stored as {str(src.dtype).removeprefix('torch.')} does not fit this "
                                 f"cache's --kv-dtype {self.kv_format.name} pages ({name})")
            if tuple(src.shape[1:]) != tuple(dst.shape[1:]) or src.shape[0] != len(idx):
                raise ValueError(f"KV data does not fit this model's pages ({name})")
        for name, dst in tensors.items():
            src = data[name].to(dst.device, non_blocking=True)
            if dst.dtype == torch.float8_e4m3fn:  # index_copy_ has no fp8 kernel: copy the bytes
                dst, src = dst.view(torch.uint8), src.view(torch.uint8)
            dst.index_copy_(0, idx, src)

    # ---- draft heads ------------------------------------------------------------------------
    def draft_heads(self) -> tuple[str, ...]:
        return ("mtp",) if self.mtp is not None else ()

    def enable_draft_head(self, name: str):
        if name != "mtp" or self.mtp is None:
            raise ValueError(f"this artifact has no draft head {name!r} (its heads: {list(self.draft_heads()) or 'none'})")
        if self.draft is None:
            if self.cache is not None:
                raise RuntimeError("enable the draft head before allocate_cache")
            from ninfer_core.engine.mtp_draft import MtpDraftHead

            self.draft = MtpDraftHead(self)
        return self.draft

    # ---- forwards ---------------------------------------------------------------------------
    def _groups(self) -> tuple[str, ...]:
        return self.cache_spec().group_names

    def _check(self, batch: ForwardBatch) -> None:
        if self.cache is None:
            raise RuntimeError("allocate_cache() must be called before a forward")
        check_batch(batch, self.cfg.vocab_size, self.num_slots, self.num_pages, self._groups(), self.cache.page_size)
        pending = [s.slot for s in batch.segments if s.slot in self._uncommitted]
        if pending:
            raise RuntimeError(f"state slots {pending} have an uncommitted verify (call commit first)")

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> list[SegmentOutput]:
        self._check(batch)
        if any(s.snapshot is not None for s in batch.segments):
            return [self._forward_snapshot(s) if s.snapshot is not None else self._forward([s])[0]
                    for s in batch.segments]
        return self._forward(batch.segments)

    @torch.inference_mode()
    def forward_stage(self, batch: ForwardBatch, hidden: torch.Tensor | None = None):
        """One pipeline stage's part of a forward (ninfer_core.engine.model_api.StageRunner)."""
        self._check(batch)
        if (hidden is None) != self.model.first:
            raise ValueError("the first stage embeds the tokens; every later stage needs the previous stage's hidden")
        if hidden is not None and hidden.shape[0] != sum(len(s) for s in batch.segments):
            raise ValueError(f"hidden rows {hidden.shape[0]} for {sum(len(s) for s in batch.segments)} tokens")
        # the asked layer outputs this stage holds, every row (stage_layer_outputs)
        self._stage_collect = tuple(sorted({layer for s in batch.segments for layer in s.hidden
                                            if layer != FINAL_HIDDEN and layer in self.model.layer_range}))
        self._stage_taps = {}
        try:
            if not any(s.snapshot is not None for s in batch.segments):
                return self._forward(batch.segments, hidden)
            parts, off = [], 0
            for s in batch.segments:
                h = None if hidden is None else hidden[off: off + len(s)]
                parts.append(self._stage_snapshot(s, h) if s.snapshot is not None else self._forward([s], h))
                off += len(s)
            return [o for p in parts for o in p] if self.model.last else torch.cat(parts)
        finally:
            self._stage_collect = ()

    def stage_layer_outputs(self) -> dict:
        """{layer: [sum(T), hidden]} of the last `forward_stage`: the outputs of the layers its
        segments asked for (`LaneSegment.hidden`) that this stage holds, rows in segment order."""
        return {layer: torch.cat(parts) for layer, parts in getattr(self, "_stage_taps", {}).items()}

    def _stage_snapshot(self, seg: LaneSegment, hidden):
        at, snap = seg.snapshot
        if self.model.last:
            return [self._forward_snapshot(seg, hidden)]
        side = seg.side  # media embeddings and mRoPE positions of each half
        first = LaneSegment(seg.slot, seg.tables, seg.start, list(seg.tokens[:at]), PREFILL,
                            side=None if side is None else side.slice(0, at))
        rest = LaneSegment(seg.slot, seg.tables, seg.start + at, list(seg.tokens[at:]), PREFILL,
                           side=None if side is None else side.slice(at, len(seg.tokens)))
        a = self._forward([first], None if hidden is None else hidden[:at])
        self.copy_slot(seg.slot, snap)
        return torch.cat([a, self._forward([rest], None if hidden is None else hidden[at:])])

    def _forward_snapshot(self, seg: LaneSegment, hidden: torch.Tensor | None = None) -> SegmentOutput:
        """A chunk with a checkpoint inside it: two forwards around a slot copy."""
        at, snap = seg.snapshot
        side = seg.side
        first = LaneSegment(seg.slot, seg.tables, seg.start, list(seg.tokens[:at]), PREFILL,
                            LOGITS_ALL if seg.logits == LOGITS_ALL else "none", seg.hidden,
                            side=None if side is None else side.slice(0, at))
        rest = LaneSegment(seg.slot, seg.tables, seg.start + at, list(seg.tokens[at:]), PREFILL, seg.logits,
                           seg.hidden, side=None if side is None else side.slice(at, len(seg.tokens)))
        at_h = (None, None) if hidden is None else (hidden[:at], hidden[at:])
        a = self._forward([first], at_h[0])[0]
        self.copy_slot(seg.slot, snap)
        b = self._forward([rest], at_h[1])[0]
        logits = torch.cat([a.logits, b.logits]) if seg.logits == LOGITS_ALL else b.logits
        return SegmentOutput(logits, {k: torch.cat([a.hidden[k], b.hidden[k]]) for k in b.hidden})

    def _segments(self, segments: Sequence[LaneSegment]) -> list[Segment]:
        out, off = [], 0
        for s in segments:
            pages = list(s.tables.get(ATTN_GROUP) or next(iter(s.tables.values())))
            out.append(Segment(slot=s.slot, pages=pages, start=s.start, length=len(s.tokens), offset=off, kind=s.kind))
            off += len(s.tokens)
        return out

    def _embeds(self, segments: Sequence[LaneSegment], ids: torch.Tensor) -> torch.Tensor | None:
        if not any(s.side is not None and s.side.embeddings for s in segments):
            return None
        # media rows carry identity ids past the vocabulary: their lookups are overwritten below
        x = self.model.embed_tokens(ids.clamp(max=self.cfg.vocab_size - 1)).clone()
        off = 0
        for s in segments:
            for row, emb in (s.side.embeddings if s.side is not None else ()):
                if not (0 <= row and row + emb.shape[0] <= len(s.tokens)):
                    raise ValueError(f"side embeddings at rows {row}..{row + emb.shape[0]} outside the segment")
                x[off + row: off + row + emb.shape[0]] = emb.to(x.dtype)
            off += len(s.tokens)
        return x

    def _positions(self, segments: Sequence[LaneSegment], default: torch.Tensor) -> torch.Tensor | None:
        """Rope positions from the side inputs: [N], or [3, N] when a segment brings mRoPE
        positions (a text segment beside it gets its index on all three axes); None: `default`."""
        if not any(s.side is not None and s.side.positions is not None for s in segments):
            return None
        parts, off = [], 0
        for s in segments:
            n = len(s.tokens)
            p = s.side.positions if s.side is not None else None
            if p is None:
                p = default[off: off + n]
            else:
                p = torch.as_tensor(p, dtype=torch.int64, device=self.device)
                if p.shape[-1] != n or p.dim() not in (1, 2) or (p.dim() == 2 and p.shape[0] != 3):
                    raise ValueError(f"side positions of shape {tuple(p.shape)} for a segment of {n} tokens")
            parts.append(p)
            off += n
        if all(p.dim() == 1 for p in parts):
            return torch.cat(parts)
        return torch.cat([p if p.dim() == 2 else p.expand(3, -1) for p in parts], dim=1)

    def _forward(self, segments: Sequence[LaneSegment], hidden_in: torch.Tensor | None = None):
        """SegmentOutputs of `segments`; a pipeline stage before the last returns the residual
        stream after its layers [N, hidden] instead (`hidden_in`: what the previous stage sent)."""
        segs = self._segments(segments)
        tokens = [int(t) for s in segments for t in s.tokens]
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        ctx = ForwardContext.build(segs, self.cache, self.device)
        ctx.rope_positions = self._positions(segments, ctx.positions)
        stage = getattr(self, "_stage_collect", ())
        collect = tuple(sorted({layer for s in segments for layer in s.hidden if layer != FINAL_HIDDEN} | set(stage)))
        embeds = self._embeds(segments, ids) if hidden_in is None else None
        hidden = self.model(ids, ctx, collect, embeds, hidden=hidden_in)
        for layer in stage:  # a pipeline stage's asked layers, every row of this call
            self._stage_taps.setdefault(layer, []).append(ctx.layer_outputs[layer])
        if not self.model.last:
            for seg, s in zip(segs, segments):
                if s.kind == VERIFY:
                    rows = hidden[seg.offset: seg.offset + seg.length]
                    self._uncommitted[s.slot] = (ctx.verify_states.get(s.slot, {}), rows)
            return hidden
        if self.draft is not None:
            rope = ctx.rope_positions
            self._ride_along(segs, segments, ids.clamp(max=self.cfg.vocab_size - 1), hidden,
                             rope if rope is not None and rope.dim() == 1 else ctx.positions)
        outs = []
        for seg, s in zip(segs, segments):
            rows = hidden[seg.offset: seg.offset + seg.length]
            if s.kind == VERIFY:
                self._uncommitted[s.slot] = (ctx.verify_states.get(s.slot, {}), rows)
            elif self.cache.hidden is not None:
                self.cache.hidden[s.slot] = rows[-1]
            logits = None
            if s.logits == LOGITS_ALL:
                logits = self.model.logits(rows)
            elif s.logits == LOGITS_LAST:
                logits = self.model.logits(rows[-1])
            got = {layer: ctx.layer_outputs[layer][seg.offset: seg.offset + seg.length]
                   for layer in s.hidden if layer in ctx.layer_outputs}  # a stage: the layers it holds
            if FINAL_HIDDEN in s.hidden:
                got[FINAL_HIDDEN] = rows
            outs.append(SegmentOutput(logits, got))
        return outs

    def _ride_along(self, segs: list[Segment], segments, ids: torch.Tensor, hidden: torch.Tensor,
                    positions) -> None:
        """The draft head's K/V rows of every position this forward ran (position 0 has none)."""
        ps = self.cache.page_size
        keep, prev, pages, tables = [], [], [], []
        for seg, s in zip(segs, segments):
            table = list(s.tables.get(self.draft.kv_group) or seg.pages)
            for j in range(seg.length):
                p = seg.start + j
                if p == 0:
                    continue
                keep.append(seg.offset + j)
                prev.append(self.cache.hidden[seg.slot] if j == 0 else hidden[seg.offset + j - 1])
                pages.append(table[p // ps])
                tables.append(table[: p // ps + 1])
        if not keep:
            return
        idx = torch.tensor(keep, dtype=torch.int64, device=self.device)
        pos = positions[idx]
        page_t = torch.tensor(pages, dtype=torch.int64, device=self.device)
        self.draft.write_rows(pos, ids[idx], torch.stack(prev), page_t, pos % ps, tables)

    def commit(self, kept: Sequence[tuple[int, int]]) -> None:
        for slot, n in kept:
            got = self._uncommitted.pop(slot, None)
            if got is None:
                raise RuntimeError(f"state slot {slot} has no verify to commit")
            states, rows = got
            if not 1 <= n <= rows.shape[0]:
                raise ValueError(f"commit of {n} tokens of a verify of {rows.shape[0]}")
            for layer, (conv_hist, ssm_hist) in states.items():
                self.cache.conv[layer][slot] = conv_hist[n - 1]
                self.cache.ssm[layer][slot] = ssm_hist[n - 1]
            if self.cache.hidden is not None:
                self.cache.hidden[slot] = rows[n - 1]

    def embed(self, token_ids) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.int64, device=self.device)
        return self.model.embed_tokens(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    def _check_slot(self, slot: int) -> None:
        if self.cache is None:
            raise RuntimeError("allocate_cache() must be called first")
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"state slot {slot} outside 0..{self.num_slots - 1}")

    # ---- MTP head (reference over plain per-layer tensors; tests and model evaluations) ----
    @torch.inference_mode()
    def mtp_forward(self, next_tokens: Sequence[int], target_hidden: torch.Tensor, start: int, past=None):
        """Run the MTP head for one sequence: fp32 logits [T, vocab], normed hidden, KV list.

        next_tokens[i] is the token at position start + i; target_hidden[i] is the target's
        final hidden state at position start + i - 1.
        """
        if self.mtp is None:
            raise RuntimeError("this artifact has no MTP head (mtp.* tensors)")
        ids = torch.tensor(list(next_tokens), dtype=torch.int64, device=self.device)
        pos = torch.arange(start, start + len(ids), device=self.device)
        hidden, present = self.mtp(
            self.model.embed_tokens(ids), target_hidden.to(self.dtype), pos, self.model.rotary, past
        )
        return self.model.logits(hidden), hidden, present
