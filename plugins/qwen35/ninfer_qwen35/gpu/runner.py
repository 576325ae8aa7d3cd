"""GpuQwen35Runner: the Qwen3.5 runner's fast path (bf16, fused projections, Triton paged
attention, fla GDN prefill, in-place GDN decode, CUDA-Graph decode for 1..8 lanes).

The reference modules keep their parameters: fusion concatenates a layer's projection weights
into one tensor and re-points each module's weight at its rows (a view, no second copy), so the
reference forward, the MTP head and a transformers model sharing the tensors all stay valid.

Decode graphs: one per batch width, captured on first use. Their inputs live in one packed int64
buffer (token, position, slot, length, write page, write row, then the block-table row) that a
round fills with a single host-to-device copy; the graph ends with the fp32 logits, and the
engine's sampler reads back only the sampled tokens. Warm-up before capture runs on a scratch
state slot and a scratch page the engine never hands out, so capturing touches no lane's cache.
The path is the same math as the reference and works on the CPU too (torch fallbacks), which is
how CI tests it; on CUDA the kernels and graphs take over.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ninfer_core.accel import gemv as GV
from ninfer_core.engine.model_api import (
    DECODE,
    FINAL_HIDDEN,
    LOGITS_ALL,
    LOGITS_LAST,
    PAGE_SIZE,
    PREFILL,
    VERIFY,
    ForwardBatch,
    LaneSegment,
    RunnerOptions,
    SegmentOutput,
)
from ninfer_core.quant import kv_attention as QA
from ninfer_core.quant.weight import QuantizedWeight
from ninfer_core.nn.context import Segment
from ninfer_core.accel import kernels as K
from ninfer_core.accel import moe_kernels as MK
from ninfer_core.accel.fla_glue import GRAPH_BUCKETS, GdnPrefillGraphs, fla_chunk, gdn_prefill
from ninfer_qwen35.gpu.verify import VerifyMixin
from ninfer_core.engine.hybrid_runner import ATTN_GROUP
from ninfer_core.engine.hybrid_runner import HybridRunner as Qwen35Runner

log = logging.getLogger("ninfer.qwen35.gpu")

MAX_GRAPH_BATCH = 8
MOE_GATHER_MAX_TOKENS = 8  # decode rounds: the MoE GEMV kernels; longer chunks grouped GEMMs (moe_kernels)
# verify rounds (up to 8 lanes x 16 rows) stay on the gather kernels too: they need no host sync, so
# the verify graph never depends on torch._grouped_mm being capturable
MOE_GATHER_MAX_VERIFY_ROWS = 128
_META = 6  # token, position, slot, seq_len, write page, write row


def _fuse(mods: list[nn.Module]) -> torch.Tensor:
    """Concatenate the weights of Linear-like modules along the output rows; each module's
    weight becomes a view into the fused tensor."""
    fused = torch.cat([m.weight for m in mods], dim=0)
    off = 0
    for m in mods:
        n = m.weight.shape[0]
        part = fused[off : off + n]  # an encoded weight (ninfer_core.quant) fuses into one encoded weight
        m.weight = part if isinstance(part, QuantizedWeight) else nn.Parameter(part, requires_grad=False)
        off += n
    return fused


def fuse_model(model) -> list[SimpleNamespace]:
    """Per layer: GDN w_in = [qkv | z | b | a]; attention w_qkv = [q+gate | k | v] (+ bias);
    dense MLP w_gu = [gate | up]."""
    out = []
    for layer in model.layers:
        f = SimpleNamespace(w_in=None, w_qkv=None, b_qkv=None, w_gu=None)
        if layer.layer_type == "absent":  # held by another pipeline stage
            out.append(f)
            continue
        if layer.layer_type == "linear_attention":
            g = layer.linear_attn
            f.w_in = _fuse([g.in_proj_qkv, g.in_proj_z, g.in_proj_b, g.in_proj_a])
        else:
            a = layer.self_attn
            mods = [a.q_proj, a.k_proj, a.v_proj]
            f.w_qkv = _fuse(mods)
            if a.q_proj.bias is not None:
                f.b_qkv = torch.cat([m.bias for m in mods])
        mlp = layer.mlp
        if hasattr(mlp, "gate_proj"):
            f.w_gu = _fuse([mlp.gate_proj, mlp.up_proj])
        out.append(f)
    return out


class GpuQwen35Runner(VerifyMixin, Qwen35Runner):
    # decode step with the fused attention K/V write + output gate (issue 6); False runs the kernel
    # chains they replace (for A/B measurements; drop the graphs after a change)
    decode_fusion = True

    def __init__(self, *args, cuda_graph: bool = True, **kw):
        super().__init__(*args, **kw)
        self.fused = fuse_model(self.model)
        self.cuda_graph = cuda_graph
        self.options = RunnerOptions(cuda_graph=cuda_graph)
        self._graphs: dict[int, tuple] = {}  # decode graphs by batch width: (graph, logits, hidden)
        self._pool = None
        self._gdn_graphs = GdnPrefillGraphs()  # prefill chunks of <= 1024 tokens (fla_glue)
        self._init_verify()
        self._verifying = False  # inside a verify body (the MoE path choice)
        # layer outputs a forward asks for (LaneSegment.hidden, e.g. a DFlash drafter's context):
        # `_stack` stores them here while a body runs (a graph's capture keeps them as its outputs)
        self._taps: dict | None = None
        self.info.extra["gpu_path"] = True
        # decode linears of <= GV.MAX_ROWS rows through our GEMV (issue 21); NINFER_GEMV=0 keeps
        # cuBLAS (for A/B runs; drop the graphs after flipping it on a live runner)
        self.gemv = GV.enabled()

    @classmethod
    def from_runner(cls, r: Qwen35Runner, cuda_graph: bool = True) -> "GpuQwen35Runner":
        """The fast path over an already loaded reference runner's model (weights are fused in place)."""
        return cls(r.model, r.cfg, r.device, r.dtype, mtp=r.mtp, eos_token_ids=r.info.eos_token_ids,
                   cuda_graph=cuda_graph, kv_format=r.kv_format)

    # ---- options --------------------------------------------------------------------------------
    def configure(self, options: RunnerOptions | None = None, cuda_graph: bool | None = None) -> None:
        """RunnerOptions from the engine (or just `cuda_graph` for tools): graphs on/off, the
        verify widths to prepare, the lane count."""
        if options is not None:
            self.options = options
            cuda_graph = options.cuda_graph
        if cuda_graph is not None and bool(cuda_graph) != self.cuda_graph:
            self.cuda_graph = bool(cuda_graph)
            self._drop_graphs()
            self._gdn_graphs.clear()
            if getattr(self, "cache", None) is not None:
                self._warm_gdn_graphs()

    def _drop_graphs(self) -> None:
        """Forget captured graphs and their memory pool (they point into the current cache)."""
        self._graphs.clear()
        self._drop_verify_graphs()
        if self.draft is not None:
            self.draft.drop_graphs()
        self._pool = None

    def free_cache(self) -> None:
        """Release the cache tensors and the graphs that reference them (before a re-allocation)."""
        self._drop_graphs()
        self.cache = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    @property
    def graphs_enabled(self) -> bool:
        return self.cuda_graph and self.device.type == "cuda"

    @property
    def _whole(self) -> bool:
        """False for a pipeline stage (a part of the layers): its decode runs eagerly."""
        return self.model.first and self.model.last

    # ---- cache: one scratch page and one scratch slot past the engine's pool ------------------
    def allocate_cache(self, num_pages: int, num_slots: int, page_size: int = PAGE_SIZE) -> None:
        self.free_cache()
        super().allocate_cache(num_pages + 1, num_slots + 1, page_size)
        self.num_pages, self.num_slots = num_pages, num_slots
        self.scratch_page, self.scratch_slot = num_pages, num_slots
        self.table_width = num_pages
        self._meta_host = torch.zeros(MAX_GRAPH_BATCH, _META + self.table_width, dtype=torch.int64)
        if self.device.type == "cuda":
            self._meta_host = self._meta_host.pin_memory()
        self._meta = torch.zeros_like(self._meta_host, device=self.device)
        self._warm_gdn_graphs()
        self._warm_prefill()

    @torch.inference_mode()
    def _warm_prefill(self, force: bool = False) -> None:
        """Run once now the prefill forwards whose first use would otherwise land in a request's
        time to first token (Triton compiles; 27B on the H200): short chunks over one page (the
        17-token tail after a turn closure: ~1.2 s once), and, when the pool has the pages, a
        resumed turn's ~300-token chunk over a multi-page prefix at a page-aligned and an unaligned
        start, the same chunk with a capture inside it, and a 17-token tail (the first in-chunk
        capture of a 30k-token replay: 0.88 s against 0.06 s later). They run on the scratch
        page/slot, pages 0.. and slot 0, all free at allocation: the pages are written before any
        request reads them and the slots are reset below. What each step took is kept in
        info.extra["warmup_ms"]. (CUDA only; `force` runs it elsewhere, for tests.)"""
        if self.device.type != "cuda" and not force:
            return
        ps, scratch = self.cache.page_size, [self.scratch_page]
        steps = [("short", scratch, 0, 17, None), ("short_after", scratch, 17, 9, None)]
        n = min(self.num_pages, 48)
        if n >= 16 and self.num_slots >= 1:
            pages, base = list(range(n)), (n - 6) * ps
            steps += [("chunk_aligned", pages, base, 300, None), ("chunk_unaligned", pages, base + 13, 300, None),
                      ("capture_in_chunk", pages, base + 13, 300, (283, 0)), ("tail", pages, base + 29, 17, None)]
        ids = torch.zeros(300, dtype=torch.int64, device=self.device)
        hid = None if self.model.first else torch.zeros(300, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        took = {}
        for name, seg_pages, start, t, snap in steps:
            t0 = time.perf_counter()
            seg = Segment(slot=self.scratch_slot, pages=seg_pages, start=start, length=t, offset=0)
            self._prefill_body(seg, ids[:t], snap=snap, hidden=None if hid is None else hid[:t])
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            took[name] = round((time.perf_counter() - t0) * 1e3, 1)
        for st in self.cache.slot_tensors().values():
            st[self.scratch_slot].zero_()
            if self.num_slots >= 1:
                st[0].zero_()
        self.info.extra["warmup_ms"] = took
        log.info("ran the first-use prefill paths once (ms): %s", took)

    def _warm_gdn_graphs(self) -> None:
        """Capture the GDN prefill graph of every bucket now (on the scratch slot), so that no
        request's time to first token pays a capture (~0.1 s per bucket on the 27B shape)."""
        if not self.graphs_enabled or len(self._gdn_graphs) or fla_chunk() is None:
            return
        gdn = [(i, layer.linear_attn) for i, layer in enumerate(self.model.layers)
               if layer.layer_type == "linear_attention"]
        if not gdn:
            return
        i, mod = gdn[0]
        t0 = time.perf_counter()
        ssm = self.cache.ssm[i]
        for tp in GRAPH_BUCKETS:
            z = torch.zeros(tp, mod.conv_dim + 2 * mod.hv, dtype=self.dtype, device=self.device)
            cd = mod.conv_dim
            self._gdn_graphs.run(mod, z[:, :cd], z[:, cd:cd + mod.hv], z[:, cd + mod.hv:], ssm, self.scratch_slot)
        ssm[self.scratch_slot].zero_()
        log.info("captured GDN prefill graphs for %d chunk lengths in %.1f s", len(self._gdn_graphs),
                 time.perf_counter() - t0)

    def enable_draft_head(self, name: str):
        if name != "mtp" or self.mtp is None or self.draft is not None:
            return super().enable_draft_head(name)
        if self.cache is not None:
            raise RuntimeError("enable the draft head before allocate_cache")
        from ninfer_qwen35.gpu.draft import GpuMtpDraftHead

        self.draft = GpuMtpDraftHead(self)
        return self.draft

    # ---- the forward contract -----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> list[SegmentOutput]:
        self._check(batch)
        segs = batch.segments
        # layer outputs a segment asks for (a DFlash drafter's context) ride along on every fast path,
        # CUDA Graphs included (graphs keyed by the tapped layers), so asking for them never changes the
        # kernels, the split of a reduction or the graph a forward runs: logits are the same bits
        taps = tuple(sorted({h for s in segs for h in s.hidden if h != FINAL_HIDDEN}))
        plain = all(s.side is None for s in segs)
        kinds = {s.kind for s in segs}
        if plain and kinds == {DECODE}:
            return self._decode_segments(segs, taps=taps)
        rope = _decode_rope(segs) if kinds == {DECODE} else None
        if rope is not None:  # media lanes' decode: text positions, one rope offset per lane
            return self._decode_segments(segs, rope, taps=taps)
        if plain and VERIFY in kinds and PREFILL not in kinds:
            return self._verify_segments(segs, taps)
        if plain and kinds == {PREFILL}:
            return [self._prefill_segment(s, taps=taps) for s in segs]
        if kinds == {PREFILL}:  # a media lane's text-only chunk: the fast path with its rope offset
            offsets = [_text_rope_offset(s) for s in segs]
            if all(o is not None for o in offsets):
                return [self._prefill_segment(s, o, taps) for s, o in zip(segs, offsets)]
        if VERIFY in kinds and PREFILL not in kinds:
            offsets = [_text_rope_offset(s) for s in segs]
            if all(o is not None for o in offsets):  # media lanes' verify after their media: text positions
                return self._verify_segments(segs, taps, offsets)
            # other side inputs: the reference verify over the same caches; `commit` finishes it the
            # reference way
            self._last_verify = None
            return super().forward(batch)
        return super().forward(batch)  # side inputs (media rows): the reference path (same caches)

    def _collect_taps(self, taps: tuple, fn):
        """Run `fn` with `_stack` keeping the residual stream of each layer in `taps` -> (fn's
        result, {layer: [rows, H]} in the body's row order)."""
        if not taps:
            return fn(), {}
        self._taps = {i: None for i in taps}
        try:
            return fn(), self._taps
        finally:
            self._taps = None

    @torch.inference_mode()
    def forward_stage(self, batch: ForwardBatch, hidden: torch.Tensor | None = None):
        """A pipeline stage's part of a forward on the fast path's kernels, eagerly (the stage's
        input is another process's tensor): prefill, decode and verify (the MTP head's ride-along
        on the stage holding it). Side inputs (media) and layer outputs run the reference stage
        forward over the same caches and weights (`commit` finishes a reference verify the
        reference way)."""
        if self._whole and hidden is None:
            return self.forward(batch)
        self._check(batch)
        segs = batch.segments
        self._stage_taps = {}
        if (hidden is None) != self.model.first:
            raise ValueError("the first stage embeds the tokens; every later stage needs the previous stage's hidden")
        kinds = {s.kind for s in segs}
        if any(s.side is not None or not set(s.hidden) <= {FINAL_HIDDEN} for s in segs) or (
                VERIFY in kinds and kinds != {VERIFY}):
            self._last_verify = None
            return super().forward_stage(batch, hidden)
        if kinds == {VERIFY}:
            return self._verify_stage(segs, hidden)
        if {s.kind for s in segs} == {DECODE}:
            rows = [self._segment_of(s, i) for i, s in enumerate(segs)]
            width = max(-(-(s.start + 1) // self.cache.page_size) for s in rows)
            meta = self._build_meta(rows, [int(s.tokens[0]) for s in segs], width).to(self.device)
            out = self._decode_body(len(rows), meta, width, hidden)
            if not self.model.last:
                return out
            logits = self.model.logits(out)
            return [SegmentOutput(logits[i] if s.logits == LOGITS_LAST else (logits[i: i + 1] if s.logits == LOGITS_ALL
                                                                            else None),
                                  {FINAL_HIDDEN: out[i: i + 1]} if FINAL_HIDDEN in s.hidden else {})
                    for i, s in enumerate(segs)]
        parts, off = [], 0
        for s in segs:
            if s.kind != PREFILL:
                raise NotImplementedError("a pipeline stage batch mixes prefill and decode segments")
            seg = self._segment_of(s, 0)
            ids = torch.tensor([int(t) for t in s.tokens], dtype=torch.int64, device=self.device)
            h = self._prefill_body(seg, ids, snap=s.snapshot,
                                   hidden=None if hidden is None else hidden[off: off + len(s)])
            if self.draft is not None:  # the stage holding the MTP head: its K/V rows of the chunk
                self._prefill_ride_along(s, ids, h)
            parts.append(self._output(s, h) if self.model.last else h)
            off += len(s)
        return parts if self.model.last else torch.cat(parts)

    def _prefill_segment(self, s: LaneSegment, rope_offset: int = 0, taps: tuple = ()) -> SegmentOutput:
        seg = Segment(slot=s.slot, pages=list(s.tables.get(ATTN_GROUP) or next(iter(s.tables.values()))),
                      start=s.start, length=len(s.tokens), offset=0)
        ids = torch.tensor([int(t) for t in s.tokens], dtype=torch.int64, device=self.device)
        hidden, got = self._collect_taps(taps, lambda: self._prefill_body(seg, ids, snap=s.snapshot,
                                                                          rope_offset=rope_offset))
        if self.draft is not None:
            self._prefill_ride_along(s, ids, hidden)
        out = self._output(s, hidden)
        out.hidden.update({h: got[h] for h in s.hidden if h != FINAL_HIDDEN})
        return out

    def _output(self, s: LaneSegment, hidden: torch.Tensor) -> SegmentOutput:
        logits = None
        if s.logits == LOGITS_ALL:
            logits = self.model.logits(hidden)
        elif s.logits == LOGITS_LAST:
            logits = self.model.logits(hidden[-1])
        return SegmentOutput(logits, {FINAL_HIDDEN: hidden} if FINAL_HIDDEN in s.hidden else {})

    def _prefill_ride_along(self, s: LaneSegment, ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """The draft head's K/V of the chunk's positions; the slot keeps the chunk's last hidden
        (and a snapshot slot the hidden at its frontier)."""
        ps = self.cache.page_size
        t = ids.shape[0]
        table = list(s.tables.get(self.draft.kv_group) or next(iter(s.tables.values())))
        pos = torch.arange(s.start, s.start + t, device=self.device)
        pages = torch.tensor(table[: -(-(s.start + t) // ps)], dtype=torch.int64, device=self.device)
        wpage = torch.where(pos == 0, self.scratch_page, pages[pos // ps])
        prev = torch.cat([self.cache.hidden[s.slot][None], hidden[:-1]])
        self.draft.write_kv(pos, ids, prev, wpage, pos % ps)
        if s.snapshot is not None:
            at, snap = s.snapshot
            self.cache.hidden[snap] = hidden[at - 1]
        self.cache.hidden[s.slot] = hidden[-1]

    # ---- decode -----------------------------------------------------------------------------------
    def _decode_segments(self, segs: list[LaneSegment], rope: list[int] | None = None,
                         taps: tuple = ()) -> list[SegmentOutput]:
        """`rope`: each lane's rope position when it is not the lane's index (media lanes); `taps`:
        the layer outputs to return beside (the graph of the batch width and those layers)."""
        rows = [self._segment_of(s, i) for i, s in enumerate(segs)]
        tokens = [int(s.tokens[0]) for s in segs]
        b = len(rows)
        if b <= MAX_GRAPH_BATCH and self.graphs_enabled:
            self._fill_meta(rows, tokens, self.table_width, rope)
            graph, logits, hidden, got = self._graph(b, taps)
            graph.replay()
            logits, hidden = logits[:b].clone(), hidden[:b]
        else:
            width = max(-(-(s.start + 1) // self.cache.page_size) for s in rows)
            meta = self._build_meta(rows, tokens, width, rope=rope).to(self.device)
            hidden, got = self._collect_taps(taps, lambda: self._decode_body(b, meta, width))
            logits = self._logits(hidden)
        outs = []
        for i, s in enumerate(segs):
            lg = logits[i] if s.logits == LOGITS_LAST else (logits[i: i + 1] if s.logits == LOGITS_ALL else None)
            hid = {h: got[h][i: i + 1].clone() for h in s.hidden if h != FINAL_HIDDEN}
            if FINAL_HIDDEN in s.hidden:
                hid[FINAL_HIDDEN] = hidden[i: i + 1].clone()
            outs.append(SegmentOutput(lg, hid))
        return outs

    def _segment_of(self, s: LaneSegment, offset: int) -> Segment:
        pages = list(s.tables.get(ATTN_GROUP) or next(iter(s.tables.values())))
        return Segment(slot=s.slot, pages=pages, start=s.start, length=len(s.tokens), offset=offset, kind=s.kind)

    def _build_meta(self, segs, tokens, width: int, out: torch.Tensor | None = None,
                    rope: list[int] | None = None) -> torch.Tensor:
        ps = self.cache.page_size
        rows = []
        for i, (seg, tok) in enumerate(zip(segs, tokens)):
            pos = seg.start
            need = pos // ps + 1
            table = list(seg.pages[:need]) + [self.scratch_page] * (width - need)
            # the position column feeds the rotary tables (and the draft head's rows); the KV write
            # and the attention length follow the lane's index
            rows.append([tok, pos if rope is None else rope[i], seg.slot, pos + 1, seg.pages[pos // ps], pos % ps,
                         *table])
        meta = torch.tensor(rows, dtype=torch.int64)
        if out is not None:
            out[: len(rows)].copy_(meta)
            return out
        return meta

    def _fill_meta(self, segs, tokens, width: int, rope: list[int] | None = None) -> None:
        self._build_meta(segs, tokens, width, out=self._meta_host, rope=rope)
        self._meta.copy_(self._meta_host)

    def _graph(self, b: int, taps: tuple = ()):
        """The decode graph of b lanes (keyed b; (b, taps) when it also returns layer outputs) ->
        (graph, logits, hidden, {layer: output rows})."""
        key = (b, taps) if taps else b
        hit = self._graphs.get(key)
        if hit is not None:
            return hit
        # warm-up on scratch: every lane points at the scratch slot and page
        torch.cuda.synchronize(self.device)
        meta = self._meta
        saved = self._meta_host[:b].clone()
        self._meta_host[:b] = 0
        self._meta_host[:b, 2] = self.scratch_slot
        self._meta_host[:b, 3] = 1
        self._meta_host[:b, 4] = self.scratch_page
        self._meta_host[:b, _META:] = self.scratch_page
        meta.copy_(self._meta_host)
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._logits(self._collect_taps(taps, lambda: self._decode_body(b, meta, self.table_width))[0])
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden, got = self._collect_taps(taps, lambda: self._decode_body(b, meta, self.table_width))
            logits = self._logits(hidden)
        self._meta_host[:b] = saved
        meta.copy_(self._meta_host)
        self._reset_scratch()
        torch.cuda.synchronize(self.device)
        self._graphs[key] = (graph, logits, hidden, got)
        log.info("captured decode graph for batch width %d%s", b, f" (layer outputs {list(taps)})" if taps else "")
        return graph, logits, hidden, got

    def _reset_scratch(self) -> None:
        for t in self.cache.slot_tensors().values():
            t[self.scratch_slot].zero_()

    def _decode_body(self, b: int, meta: torch.Tensor, width: int, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step for b lanes described by meta[:b] -> final-normed hidden [b, H] (a
        pipeline stage: from the previous stage's `hidden`, and before the last the residual)."""
        m = meta[:b]
        # one transposing copy makes every per-lane column contiguous (was one copy per column)
        ids, pos, slots, lens, wpage, wrow = m[:, :_META].t().contiguous()
        table = m[:, _META : _META + width]
        model = self.model
        x = model.embed_tokens(ids) if hidden is None else hidden
        cos, sin = model.rotary.cos_sin(pos, x.dtype)

        def mixer(i, layer, h):
            if layer.layer_type == "linear_attention":
                return self._gdn_decode(i, layer.linear_attn, h, slots)
            return self._attn_decode(i, layer.self_attn, h, cos, sin, table, lens, wpage, wrow)

        hidden = self._stack(x, mixer)
        if self.draft is not None:  # the head's K/V row of each position, then the slot's new hidden
            mpage = torch.where(pos == 0, torch.full_like(wpage, self.scratch_page), wpage)
            self.draft.write_kv(pos, ids, self.cache.hidden.index_select(0, slots), mpage, wrow)
            self.cache.hidden.index_copy_(0, slots, hidden.to(self.cache.hidden.dtype))
        return hidden

    def _stack(self, x, mixer):
        """The decoder stack with fused residual-add + norm: x += mixer(norm(x)); x += mlp(norm(x));
        returns the final-normed hidden states. A pipeline stage runs its own layers; before the
        last stage it returns the residual stream (the kernel rounds x before norming it, so the
        next stage's norm of the sent x is the same bits as the fused one)."""
        model = self.model
        layers, r = model.layers, model.layer_range
        first = layers[r.start].input_layernorm
        x, h = K.add_rmsnorm(x, None, first.weight, first.eps)
        for i in r:
            layer = layers[i]
            post = layer.post_attention_layernorm
            x, h = K.add_rmsnorm(x, mixer(i, layer, h), post.weight, post.eps)
            if i + 1 == r.stop and not model.last:
                return x + self._mlp(i, layer.mlp, h)
            nxt = layers[i + 1].input_layernorm if i + 1 < r.stop else model.norm
            x, h = K.add_rmsnorm(x, self._mlp(i, layer.mlp, h), nxt.weight, nxt.eps)
            if self._taps is not None and i in self._taps:
                self._taps[i] = x  # the layer's output (a new tensor each add: no copy needed)
        return h

    def _gdn_decode(self, i, mod, h, slots):
        """The in-projection GEMV, the chain (conv update + SiLU, gated delta step on the state slot
        in place, gated RMSNorm with z), out_proj. (A one-launch fusion of the chain was measured on
        the H200 on 2026-12-01: no faster at batch 1, slower at batch 8; it was removed.)"""
        cd, vd, hv = mod.conv_dim, mod.value_dim, mod.hv
        proj = self._lin(h, self.fused[i].w_in)
        mixed, z = proj[:, :cd], proj[:, cd : cd + vd]
        b_raw, a_raw = proj[:, cd + vd : cd + vd + hv], proj[:, cd + vd + hv :]
        conv_out = K.conv_update(mixed, self.cache.conv[i], mod.conv1d.weight[:, 0, :], slots)
        core = K.gdn_decode_inplace(conv_out, a_raw, b_raw, mod.A_log, mod.dt_bias, self.cache.ssm[i], slots,
                                    mod.hk, mod.dk, mod.dv, mod.dk**-0.5)
        out = K.gated_rmsnorm(core.reshape(-1, mod.dv), z.reshape(-1, mod.dv), mod.norm.weight, mod.norm.eps)
        return self._lin(out.reshape(proj.shape[0], vd), mod.out_proj.weight)

    def _attn_qkv(self, i, mod, h):
        """The fused q+gate|k|v GEMV -> strided views q, gate [N, H, d], k, v [N, KVH, d]."""
        n = h.shape[0]
        proj = self._lin(h, self.fused[i].w_qkv, self.fused[i].b_qkv)
        hd, nh, kvh = mod.head_dim, mod.heads, mod.kv_heads
        qg = proj[:, : nh * 2 * hd].view(n, nh, 2 * hd)
        k = proj[:, nh * 2 * hd : nh * 2 * hd + kvh * hd].view(n, kvh, hd)
        v = proj[:, nh * 2 * hd + kvh * hd :].view(n, kvh, hd)
        return qg[..., :hd], qg[..., hd:], k, v

    def _attn_project(self, i, mod, h, cos, sin):
        q, gate, k, v = self._attn_qkv(i, mod, h)
        q, k = K.qk_norm_rope(q, k, mod.q_norm.weight, mod.k_norm.weight, cos, sin, mod.q_norm.eps)
        return q, gate.reshape(h.shape[0], -1), k, v

    def _attn_decode(self, i, mod, h, cos, sin, table, lens, wpage, wrow):
        """qkv GEMV; q/k norm + RoPE writing the new K/V rows into the paged cache (one launch);
        split decode + a combine that applies sigmoid(gate) (two launches); o_proj."""
        if i in self.cache.kv_scale:  # --kv-dtype int8|fp8|k8v4: rows encoded, pages dequantised in-kernel
            q, gate, k, v = self._attn_project(i, mod, h, cos, sin)
            self.cache.write_kv(i, wpage, wrow, k, v)
            o = QA.paged_decode_attention(q, self.kv_format, *self.cache.kv[i], *self.cache.kv_scale[i], table, lens,
                                          mod.scale)
            return mod.finish(o, gate)
        if not self.decode_fusion:
            q, gate, k, v = self._attn_project(i, mod, h, cos, sin)
            kc, vc = self.cache.kv[i]
            kc[wpage, wrow] = k.to(kc.dtype)
            vc[wpage, wrow] = v.to(vc.dtype)
            return mod.finish(K.paged_decode_attention(q, kc, vc, table, lens, mod.scale), gate)
        q, gate, k, v = self._attn_qkv(i, mod, h)
        kc, vc = self.cache.kv[i]
        q = K.qk_norm_rope_kv(q, k, v, mod.q_norm.weight, mod.k_norm.weight, cos, sin, mod.q_norm.eps,
                              kc, vc, wpage, wrow)
        # the split count comes from the layer alone (K.decode_splits), so an eager step (more than
        # 8 lanes, a long verify) reduces in the graph's order whatever its table width
        return self._module(mod.o_proj, K.paged_decode_attention_gated(q, kc, vc, table, lens, mod.scale, gate))

    def _mlp(self, i, mlp, h):
        w = self.fused[i].w_gu
        if w is None:
            if isinstance(mlp.experts.gate_up_proj, QuantizedWeight):
                return mlp(h)  # encoded experts: the expert loop over the dequantising linear
            if h.shape[0] <= (MOE_GATHER_MAX_VERIFY_ROWS if self._verifying else MOE_GATHER_MAX_TOKENS):
                return self._moe_few_tokens(mlp, h)
            return mlp(h)  # MoE block: its own forward (a loop over the experts that got tokens)
        if self._gemv_ok(h, w):
            return self._lin(GV.gemv_silu_mul(h, w), mlp.down_proj.weight)
        return F.linear(K.silu_mul(F.linear(h, w)), mlp.down_proj.weight)

    # ---- decode linears: the GEMV for a few rows, cuBLAS otherwise (issue 21) -------------------------
    def _gemv_ok(self, h, w) -> bool:
        return self.gemv and h.shape[0] <= GV.MAX_ROWS and GV.supported(h, w)

    def _lin(self, h, w, b=None):
        return GV.gemv(h, w, b) if self._gemv_ok(h, w) and (b is None or b.dtype == h.dtype) else F.linear(h, w, b)

    def _module(self, mod, h):
        """A Linear module's forward (an encoded weight's own module where it is one)."""
        w = getattr(mod, "weight", None)
        if type(mod) is nn.Linear and self._gemv_ok(h, w) and (mod.bias is None or mod.bias.dtype == h.dtype):
            return GV.gemv(h, w, mod.bias)
        return mod(h)

    def _logits(self, hidden):
        """The model's fp32 logits (F.linear rounded to the dtype, then fp32) for a decode step."""
        lm = getattr(self.model, "lm_head", None)
        if type(lm) is nn.Linear and lm.bias is None and self._gemv_ok(hidden, lm.weight):
            return GV.gemv(hidden, lm.weight, out_dtype=torch.float32)
        return self.model.logits(hidden)

    def _moe_few_tokens(self, mlp, h):
        """MoE for a decode round (a few tokens): the router's logits by one matmul, then four
        Triton launches (gpu/moe_kernels.py): softmax/top-k/normalise; gate/up + SiLU*up and
        down GEMVs that read each chosen expert's rows straight from the fused expert tensors by
        the ids on the device; the routing-weight combine + gated shared expert. No expert counts
        come back to the host, so the round has no synchronisation and is CUDA-graph safe."""
        router = mlp.gate
        top_w, top_i = MK.route_topk(self._lin(h, router.weight), router.top_k, router.normalize)  # [N, k]
        ex, se = mlp.experts, mlp.shared_expert
        shared = (se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight, mlp.shared_expert_gate.weight)
        return MK.moe_decode(h, top_w, top_i, ex.gate_up_proj, ex.down_proj, shared, grouped=self.gemv)

    # ---- prefill -----------------------------------------------------------------------------------
    def _prefill_body(self, seg, ids: torch.Tensor, snap: tuple[int, int] | None = None,
                      hidden: torch.Tensor | None = None, rope_offset: int = 0) -> torch.Tensor:
        """`rope_offset`: the rope positions are the indices plus this (text after a media lane's media)."""
        model, cache, ps = self.model, self.cache, self.cache.page_size
        t = ids.shape[0]
        pos = torch.arange(seg.start, seg.start + t, device=self.device)
        need = -(-(seg.start + t) // ps)
        pages = torch.tensor(seg.pages[:need], dtype=torch.int32, device=self.device)
        wpage, wrow = pages[pos // ps].long(), pos % ps
        x = model.embed_tokens(ids) if hidden is None else hidden
        cos, sin = model.rotary.cos_sin(pos + rope_offset if rope_offset else pos, x.dtype)

        def mixer(i, layer, h):
            if layer.layer_type == "linear_attention":
                return self._gdn_prefill(i, layer.linear_attn, h, seg.slot, snap)
            q, gate, k, v = self._attn_project(i, layer.self_attn, h, cos, sin)
            if i in cache.kv_scale:  # quantised --kv-dtype pages
                cache.write_kv(i, wpage, wrow, k, v)
                o = QA.paged_prefill_attention(q, self.kv_format, *cache.kv[i], *cache.kv_scale[i], pages, seg.start,
                                               layer.self_attn.scale)
                return layer.self_attn.finish(o, gate)
            kc, vc = cache.kv[i]
            kc[wpage, wrow] = k.to(kc.dtype)
            vc[wpage, wrow] = v.to(vc.dtype)
            o = K.paged_prefill_attention(q, kc, vc, pages, seg.start, layer.self_attn.scale)
            return layer.self_attn.finish(o, gate)

        return self._stack(x, mixer)

    def _gdn_prefill(self, i, mod, h, slot: int, snap: tuple[int, int] | None = None):
        t = h.shape[0]
        proj = F.linear(h, self.fused[i].w_in)
        cd, vd, hv = mod.conv_dim, mod.value_dim, mod.hv
        mixed, z = proj[:, :cd], proj[:, cd : cd + vd]
        b_raw, a_raw = proj[:, cd + vd : cd + vd + hv], proj[:, cd + vd + hv :]
        if snap is None:
            core = self._gdn_core(i, mod, mixed, a_raw, b_raw, slot)
        else:  # the state after the first `at` rows goes to slot `dst` (prefill_with_snapshot)
            at, dst = snap
            first = self._gdn_core(i, mod, mixed[:at], a_raw[:at], b_raw[:at], slot)
            self.cache.conv[i][dst].copy_(self.cache.conv[i][slot])
            self.cache.ssm[i][dst].copy_(self.cache.ssm[i][slot])
            core = torch.cat([first, self._gdn_core(i, mod, mixed[at:], a_raw[at:], b_raw[at:], slot)])
        out = K.gated_rmsnorm(core.reshape(-1, mod.dv), z.reshape(-1, mod.dv), mod.norm.weight, mod.norm.eps)
        return F.linear(out.reshape(t, vd), mod.out_proj.weight)

    def _gdn_core(self, i, mod, mixed, a_raw, b_raw, slot: int) -> torch.Tensor:
        """Conv (+ SiLU) and the gated delta rule over a chunk's rows from the slot's state,
        advancing it -> core output [T, Hv, dv]."""
        t = mixed.shape[0]
        conv_out = K.conv_prefill(mixed, self.cache.conv[i], mod.conv1d.weight[:, 0, :], slot)
        if t <= K.RECURRENT_PREFILL_MAX_T and K.use_triton(conv_out):
            core = K.gdn_prefill_recurrent(conv_out, a_raw, b_raw, mod.A_log, mod.dt_bias, self.cache.ssm[i], slot,
                                           mod.hk, mod.dk, mod.dv, mod.dk**-0.5)
        else:
            core = None
            if self.graphs_enabled:
                core = self._gdn_graphs.run(mod, conv_out, a_raw, b_raw, self.cache.ssm[i], slot)
            if core is None:
                core = gdn_prefill(mod, conv_out, a_raw, b_raw, self.cache.ssm[i], slot)
        return core


def _decode_rope(segs) -> list[int] | None:
    """Each decode lane's rope position when the side inputs carry positions only and they are
    one text position (equal on mRoPE's three axes); None when any lane needs the reference path."""
    out = []
    for s in segs:
        side = s.side
        if side is None:
            out.append(s.start)
            continue
        if side.embeddings or side.extras or side.positions is None:
            return None
        p = torch.as_tensor(side.positions).reshape(-1)
        if p.numel() not in (1, 3) or bool((p != p[0]).any()):
            return None
        out.append(int(p[0]))
    return out


def _text_rope_offset(s) -> int | None:
    """The rope offset of a segment whose side inputs are text positions only (equal on the three
    mRoPE axes and consecutive): position - index; 0 without side inputs; None otherwise."""
    side = s.side
    if side is None:
        return 0
    if side.embeddings or side.extras or side.positions is None:
        return None
    p = torch.as_tensor(side.positions)
    p = p if p.dim() == 2 else p[None]
    first = int(p[0, 0])
    want = torch.arange(first, first + p.shape[-1], dtype=p.dtype)
    if not bool((p == want).all()):
        return None
    return first - s.start
