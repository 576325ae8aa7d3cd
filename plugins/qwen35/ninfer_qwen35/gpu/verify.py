"""The GPU runner's verify forward and commit (speculative rounds), as a mixin of GpuQwen35Runner.

A verify batch runs B lanes of T = k + 1 tokens each, padded to the longest lane: rows are
lane-major (lane b's rows b*T .. b*T+T-1) in the decode step's packed metadata, one row per token,
so attention, projections and MLPs are the decode step's kernels over B*T rows (each row attends
over its lane's pages up to its own position; the K/V of every row is written first). A padding
row points at the scratch page and slot. The Gated DeltaNet layers run `verify_kernels`: outputs of
every row, the lane's state untouched; `commit` then advances each lane's state by the rows it kept
(`verify_mode` "recompute": the recurrence again over the kept rows; "positions": a copy of the
state the verify stored after each row). Verify and commit run as CUDA Graphs per (B, T) when
graphs are on; their inputs are the verify's packed metadata and the kept counts.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ninfer_core.accel import kernels as K
from ninfer_core.engine.model_api import FINAL_HIDDEN, LOGITS_ALL, LOGITS_LAST, SegmentOutput
from ninfer_qwen35.gpu import verify_kernels as VK

log = logging.getLogger("ninfer.qwen35.gpu")

MAX_VERIFY_GRAPH_T = 16  # widths above this run eagerly (long n-gram copies)
MAX_VERIFY_GRAPH_B = 8
_META = 6  # token, position, slot, seq_len, write page, write row (as the decode step's)


class VerifyMixin:
    verify_mode = "recompute"  # or "positions" (chosen by measurement: scripts/gpu_check.py --spec-bench)

    def _init_verify(self) -> None:
        self._vgraphs: dict[tuple, dict] = {}  # by (lanes, rows, tapped layers)
        self._last_verify: dict | None = None

    def _drop_verify_graphs(self) -> None:
        self._vgraphs = {}
        self._last_verify = None

    # ---- metadata ---------------------------------------------------------------------------------
    def _verify_meta(self, segs, t: int, width: int, out: torch.Tensor | None = None,
                     offsets: list[int] | None = None) -> torch.Tensor:
        """`offsets`: per lane, rope position minus index (a media lane's text after its media);
        the position column then carries the rope position, the KV write and length the index."""
        ps, scratch = self.cache.page_size, self.scratch_page
        rows = []
        for li, s in enumerate(segs):
            off = offsets[li] if offsets else 0
            pages = list(next(iter(s.tables.values())))
            for j in range(t):
                if j < len(s.tokens):
                    pos = s.start + j
                    need = pos // ps + 1
                    table = pages[:need] + [scratch] * (width - need)
                    rows.append([int(s.tokens[j]), pos + off, s.slot, pos + 1, pages[pos // ps], pos % ps, *table])
                else:  # padding: attends to one scratch key, writes the scratch page
                    rows.append([0, 0, self.scratch_slot, 1, scratch, 0, *([scratch] * width)])
        meta = torch.tensor(rows, dtype=torch.int64)
        if out is not None:
            out[: len(rows)].copy_(meta)
            return out
        return meta

    # ---- verify ------------------------------------------------------------------------------------
    def _verify_segments(self, segs, taps: tuple = (), offsets: list[int] | None = None) -> list[SegmentOutput]:
        """`taps`: layer outputs returned beside the logits (the graph of (B, T, taps)); `offsets`:
        per lane rope offsets (media lanes, see `_verify_meta`)."""
        from ninfer_core.engine.model_api import DECODE

        decode = [i for i, s in enumerate(segs) if s.kind == DECODE]
        if decode:  # a decode lane in a verify batch: its own (graphed) decode step, no commit
            rest = [i for i, s in enumerate(segs) if s.kind != DECODE]
            pick = lambda idx, xs: [xs[i] for i in idx] if xs else None
            rope = [segs[i].start + offsets[i] for i in decode] if offsets else None
            done = dict(zip(decode, self._decode_segments(pick(decode, segs), rope, taps)))
            got = dict(zip(rest, self._verify_segments(pick(rest, segs), taps, pick(rest, offsets))))
            return [done[i] if i in done else got[i] for i in range(len(segs))]
        b, t = len(segs), max(len(s.tokens) for s in segs)
        slots = [s.slot for s in segs]
        if self.graphs_enabled and b <= MAX_VERIFY_GRAPH_B and t <= MAX_VERIFY_GRAPH_T:
            g = self._verify_graph(b, t, taps)
            self._verify_meta(segs, t, self.table_width, out=g["meta_host"], offsets=offsets)
            g["meta"].copy_(g["meta_host"], non_blocking=True)
            g["slots"].copy_(torch.tensor(slots, dtype=torch.int64), non_blocking=True)
            g["graph"].replay()
            logits, hidden, saved, tapped = g["logits"], g["hidden"], g["saved"], g["taps"]
        else:
            width = max(-(-s.end // self.cache.page_size) for s in segs)
            meta = self._verify_meta(segs, t, width, offsets=offsets).to(self.device)
            lane_slots = torch.tensor(slots, dtype=torch.int64, device=self.device)
            (hidden, saved), tapped = self._collect_taps(taps, lambda: self._verify_body(b, t, meta, width, lane_slots))
            logits = self.model.logits(hidden)
            g = None
        self._last_verify = {"b": b, "t": t, "slots": slots, "saved": saved, "hidden": hidden, "graph": g}
        for s in segs:
            self._uncommitted[s.slot] = True
        outs = []
        for i, s in enumerate(segs):
            n = len(s.tokens)
            rows = slice(i * t, i * t + n)
            lg = None
            if s.logits == LOGITS_ALL:
                lg = logits[rows].clone()
            elif s.logits == LOGITS_LAST:
                lg = logits[i * t + n - 1].clone()
            hid = {h: tapped[h][rows].clone() for h in s.hidden if h != FINAL_HIDDEN}
            if FINAL_HIDDEN in s.hidden:
                hid[FINAL_HIDDEN] = hidden[rows].clone()
            outs.append(SegmentOutput(lg, hid))
        return outs

    def _verify_stage(self, segs, hidden: torch.Tensor | None):
        """A pipeline stage's verify (eager): the packed rows [sum(T), H] in and out, B x T inside
        (a later stage's padding rows are zeros; a padding row never reaches a lane's rows)."""
        b, t = len(segs), max(len(s.tokens) for s in segs)
        slots = [s.slot for s in segs]
        width = max(-(-s.end // self.cache.page_size) for s in segs)
        meta = self._verify_meta(segs, t, width).to(self.device)
        lane_slots = torch.tensor(slots, dtype=torch.int64, device=self.device)
        rows = torch.tensor([i * t + j for i, s in enumerate(segs) for j in range(len(s.tokens))],
                            dtype=torch.int64, device=self.device)
        x = None
        if hidden is not None:
            x = torch.zeros(b * t, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
            x.index_copy_(0, rows, hidden)
        out, saved = self._verify_body(b, t, meta, width, lane_slots, x)
        self._last_verify = {"b": b, "t": t, "slots": slots, "saved": saved, "hidden": out, "graph": None}
        for s in segs:
            self._uncommitted[s.slot] = True
        if not self.model.last:
            return out.index_select(0, rows)
        logits = self.model.logits(out)
        outs = []
        for i, s in enumerate(segs):
            n = len(s.tokens)
            r = slice(i * t, i * t + n)
            lg = logits[r] if s.logits == LOGITS_ALL else (logits[i * t + n - 1] if s.logits == LOGITS_LAST else None)
            outs.append(SegmentOutput(lg, {FINAL_HIDDEN: out[r]} if FINAL_HIDDEN in s.hidden else {}))
        return outs

    def _verify_body(self, b: int, t: int, meta: torch.Tensor, width: int, lane_slots: torch.Tensor,
                     hidden: torch.Tensor | None = None):
        """B lanes x T rows described by meta[:b*t] -> (final hidden [B*T, H], what commit needs);
        a pipeline stage after the first starts from the previous stage's rows `hidden` [B*T, H]."""
        n = b * t
        m = meta[:n]
        ids, pos, slots, lens, wpage, wrow = m[:, :_META].t().contiguous()
        table = m[:, _META: _META + width]
        model = self.model
        x = model.embed_tokens(ids) if hidden is None else hidden
        cos, sin = model.rotary.cos_sin(pos, x.dtype)
        saved: dict = {}

        def mixer(i, layer, h):
            if layer.layer_type == "linear_attention":
                return self._gdn_verify(i, layer.linear_attn, h, lane_slots, t, saved)
            return self._attn_decode(i, layer.self_attn, h, cos, sin, table, lens, wpage, wrow)

        self._verifying = True
        try:
            hidden = self._stack(x, mixer)
        finally:
            self._verifying = False
        if self.draft is not None:  # the head's K/V rows; row j > 0 reads row j - 1's hidden
            prev = torch.cat([self.cache.hidden.index_select(0, lane_slots)[:, None],
                              hidden.view(b, t, -1)[:, :-1]], 1).reshape(n, -1)
            mpage = torch.where(pos == 0, torch.full_like(wpage, self.scratch_page), wpage)
            self.draft.write_kv(pos, ids, prev, mpage, wrow)
        return hidden, saved

    def _gdn_verify(self, i, mod, h, lane_slots, t: int, saved: dict):
        cd, vd, hv = mod.conv_dim, mod.value_dim, mod.hv
        proj = F.linear(h, self.fused[i].w_in)
        mixed, z = proj[:, :cd], proj[:, cd: cd + vd]
        b_raw, a_raw = proj[:, cd + vd: cd + vd + hv], proj[:, cd + vd + hv:]
        conv_out = VK.conv_verify(mixed, self.cache.conv[i], mod.conv1d.weight[:, 0, :], lane_slots, t)
        positions = None
        if self.verify_mode == "positions":
            positions = torch.empty(lane_slots.shape[0], t, *self.cache.ssm[i].shape[1:], dtype=torch.float32,
                                    device=h.device)
        core = VK.gdn_verify(conv_out, a_raw, b_raw, mod.A_log, mod.dt_bias, self.cache.ssm[i], lane_slots, t,
                             mod.hk, mod.dk, mod.dv, mod.dk**-0.5, positions=positions)
        saved[i] = (mixed, conv_out, a_raw, b_raw, positions)
        out = K.gated_rmsnorm(core.reshape(-1, mod.dv), z.reshape(-1, mod.dv), mod.norm.weight, mod.norm.eps)
        return F.linear(out.reshape(h.shape[0], vd), mod.out_proj.weight)

    # ---- commit ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def commit(self, kept) -> None:
        lv = self._last_verify
        kept = list(kept)
        if lv is None and kept and all(isinstance(self._uncommitted.get(s), tuple) for s, _ in kept):
            from ninfer_core.engine.hybrid_runner import HybridRunner

            return HybridRunner.commit(self, kept)  # a reference verify (side inputs)
        if lv is None:
            raise RuntimeError("no verify to commit")
        by_slot = dict(kept)
        if sorted(by_slot) != sorted(lv["slots"]):
            raise RuntimeError(f"commit of slots {sorted(by_slot)} after a verify of slots {sorted(lv['slots'])}")
        counts = [by_slot[s] for s in lv["slots"]]
        if any(not 1 <= c <= lv["t"] for c in counts):
            raise ValueError(f"commit counts {counts} outside 1..{lv['t']}")
        g = lv["graph"]
        if g is not None:
            g["kept_host"][: lv["b"]].copy_(torch.tensor(counts, dtype=torch.int64))
            g["kept"].copy_(g["kept_host"], non_blocking=True)
            g["commit_graph"].replay()
        else:
            lane_slots = torch.tensor(lv["slots"], dtype=torch.int64, device=self.device)
            self._commit_body(lv["b"], lv["t"], lane_slots, torch.tensor(counts, dtype=torch.int64, device=self.device),
                              lv["saved"], lv["hidden"])
        for s in lv["slots"]:
            self._uncommitted.pop(s, None)
        self._last_verify = None

    def _commit_body(self, b: int, t: int, lane_slots, kept, saved: dict, hidden) -> None:
        for i, (mixed, conv_out, a_raw, b_raw, positions) in saved.items():
            mod = self.model.layers[i].linear_attn
            VK.conv_commit(mixed, self.cache.conv[i], lane_slots, kept, t)
            if positions is not None:
                VK.positions_commit(self.cache.ssm[i], positions, lane_slots, kept)
            else:
                VK.gdn_commit(conv_out, a_raw, b_raw, mod.A_log, mod.dt_bias, self.cache.ssm[i], lane_slots, kept, t,
                              mod.hk, mod.dk, mod.dv, mod.dk**-0.5)
        if self.cache.hidden is not None:
            rows = torch.arange(b, device=hidden.device) * t + kept - 1
            self.cache.hidden.index_copy_(0, lane_slots, hidden.index_select(0, rows).to(self.cache.hidden.dtype))

    # ---- graphs --------------------------------------------------------------------------------------
    def _verify_graph(self, b: int, t: int, taps: tuple = ()) -> dict:
        """The verify and commit graphs of b lanes x t rows (and the layer outputs `taps`, kept as
        the graph's outputs like its logits), captured on first use."""
        hit = self._vgraphs.get((b, t, taps))
        if hit is not None:
            return hit
        torch.cuda.synchronize(self.device)
        n = b * t
        width = self.table_width
        meta_host = torch.zeros(n, _META + width, dtype=torch.int64).pin_memory()
        meta_host[:, 2] = self.scratch_slot
        meta_host[:, 3] = 1
        meta_host[:, 4] = self.scratch_page
        meta_host[:, _META:] = self.scratch_page
        meta = meta_host.to(self.device)
        slots = torch.full((b,), self.scratch_slot, dtype=torch.int64, device=self.device)
        kept_host = torch.ones(b, dtype=torch.int64).pin_memory()
        kept = kept_host.to(self.device)
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up on the scratch slot and page (Triton compiles, cuBLAS picks)
                (hidden, saved), _ = self._collect_taps(taps, lambda: self._verify_body(b, t, meta, width, slots))
                self.model.logits(hidden)
                self._commit_body(b, t, slots, kept, saved, hidden)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            (hidden, saved), tapped = self._collect_taps(taps, lambda: self._verify_body(b, t, meta, width, slots))
            logits = self.model.logits(hidden)
        commit_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(commit_graph, pool=self._pool):
            self._commit_body(b, t, slots, kept, saved, hidden)
        self._reset_scratch()
        torch.cuda.synchronize(self.device)
        g = {"graph": graph, "commit_graph": commit_graph, "meta": meta, "meta_host": meta_host, "slots": slots,
             "kept": kept, "kept_host": kept_host, "logits": logits, "hidden": hidden, "saved": saved,
             "taps": tapped}
        self._vgraphs[(b, t, taps)] = g
        log.info("captured verify and commit graphs for %d lanes x %d tokens", b, t)
        return g
