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
from collections.abc import Sequence
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ninfer_core.engine.model_api import PAGE_SIZE, SeqView
from ninfer_qwen35.gpu import kernels as K
from ninfer_qwen35.gpu import moe_kernels as MK
from ninfer_qwen35.gpu.fla_glue import GRAPH_BUCKETS, GdnPrefillGraphs, fla_chunk, gdn_prefill
from ninfer_qwen35.context import Segment
from ninfer_qwen35.runner import Qwen35Runner

log = logging.getLogger("ninfer.qwen35.gpu")

MAX_GRAPH_BATCH = 8
MOE_GATHER_MAX_TOKENS = 8  # decode rounds: the MoE GEMV kernels; longer chunks grouped GEMMs (moe_kernels)
_META = 6  # token, position, slot, seq_len, write page, write row


def _fuse(mods: list[nn.Module]) -> torch.Tensor:
    """Concatenate the weights of Linear-like modules along the output rows; each module's
    weight becomes a view into the fused tensor."""
    fused = torch.cat([m.weight for m in mods], dim=0)
    off = 0
    for m in mods:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(fused[off : off + n], requires_grad=False)
        off += n
    return fused


def fuse_model(model) -> list[SimpleNamespace]:
    """Per layer: GDN w_in = [qkv | z | b | a]; attention w_qkv = [q+gate | k | v] (+ bias);
    dense MLP w_gu = [gate | up]."""
    out = []
    for layer in model.layers:
        f = SimpleNamespace(w_in=None, w_qkv=None, b_qkv=None, w_gu=None)
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


class GpuQwen35Runner(Qwen35Runner):
    # decode step with the fused attention K/V write + output gate (issue 6); False runs the kernel
    # chains they replace (for A/B measurements; drop the graphs after a change)
    decode_fusion = True

    def __init__(self, *args, cuda_graph: bool = True, **kw):
        super().__init__(*args, **kw)
        self.fused = fuse_model(self.model)
        self.cuda_graph = cuda_graph
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._gdn_graphs = GdnPrefillGraphs()  # prefill chunks of <= 1024 tokens (fla_glue)
        self.info.extra["gpu_path"] = True

    @classmethod
    def from_runner(cls, r: Qwen35Runner, cuda_graph: bool = True) -> "GpuQwen35Runner":
        """The fast path over an already loaded reference runner's model (weights are fused in place)."""
        return cls(r.model, r.cfg, r.device, r.dtype, mtp=r.mtp, eos_token_ids=r.info.eos_token_ids,
                   cuda_graph=cuda_graph)

    # ---- options --------------------------------------------------------------------------------
    def configure(self, cuda_graph: bool | None = None) -> None:
        if cuda_graph is not None:
            self.cuda_graph = bool(cuda_graph)
            self._drop_graphs()
            self._gdn_graphs.clear()
            if getattr(self, "cache", None) is not None:
                self._warm_gdn_graphs()

    def _drop_graphs(self) -> None:
        """Forget captured graphs and their memory pool (they point into the current cache)."""
        self._graphs.clear()
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
        took = {}
        for name, seg_pages, start, t, snap in steps:
            t0 = time.perf_counter()
            seg = Segment(slot=self.scratch_slot, pages=seg_pages, start=start, length=t, offset=0)
            self._prefill_body(seg, ids[:t], snap=snap)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            took[name] = round((time.perf_counter() - t0) * 1e3, 1)
        for st in (*self.cache.conv.values(), *self.cache.ssm.values()):
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

    def reset_slot(self, slot: int) -> None:
        self._check_slot(slot)
        for t in (*self.cache.conv.values(), *self.cache.ssm.values()):
            t[slot].zero_()

    # ---- decode -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, seqs: Sequence[SeqView], tokens: Sequence[int]):
        if len(seqs) != len(tokens) or not seqs:
            raise ValueError(
                f"decode needs one token per sequence (got {len(seqs)} sequences, {len(tokens)} tokens)"
            )
        segs = [self._segment(s, 1, offset=i) for i, s in enumerate(seqs)]
        if len({s.slot for s in segs}) != len(segs):
            raise ValueError("decode batch holds the same state slot twice")
        self._check_tokens(tokens)
        b = len(segs)
        if b <= MAX_GRAPH_BATCH and self.graphs_enabled:
            self._fill_meta(segs, tokens, self.table_width)
            graph, logits = self._graph(b)
            graph.replay()
            return logits[:b].clone()
        width = max(-(-(s.start + 1) // self.cache.page_size) for s in segs)
        meta = self._build_meta(segs, tokens, width).to(self.device)
        return self.model.logits(self._decode_body(b, meta, width))

    def _check_tokens(self, tokens) -> None:
        for t in tokens:
            if not 0 <= t < self.cfg.vocab_size:
                raise ValueError(f"token id {t} outside the vocabulary (size {self.cfg.vocab_size})")

    def _build_meta(self, segs, tokens, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
        ps = self.cache.page_size
        rows = []
        for seg, tok in zip(segs, tokens):
            pos = seg.start
            need = pos // ps + 1
            table = list(seg.pages[:need]) + [self.scratch_page] * (width - need)
            rows.append([tok, pos, seg.slot, pos + 1, seg.pages[pos // ps], pos % ps, *table])
        meta = torch.tensor(rows, dtype=torch.int64)
        if out is not None:
            out[: len(rows)].copy_(meta)
            return out
        return meta

    def _fill_meta(self, segs, tokens, width: int) -> None:
        self._build_meta(segs, tokens, width, out=self._meta_host)
        self._meta.copy_(self._meta_host)

    def _graph(self, b: int):
        hit = self._graphs.get(b)
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
                self.model.logits(self._decode_body(b, meta, self.table_width))
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.model.logits(self._decode_body(b, meta, self.table_width))
        self._meta_host[:b] = saved
        meta.copy_(self._meta_host)
        torch.cuda.synchronize(self.device)
        self._graphs[b] = (graph, logits)
        log.info("captured decode graph for batch width %d", b)
        return graph, logits

    def _decode_body(self, b: int, meta: torch.Tensor, width: int) -> torch.Tensor:
        """One decode step for b lanes described by meta[:b] -> final-normed hidden [b, H]."""
        m = meta[:b]
        # one transposing copy makes every per-lane column contiguous (was one copy per column)
        ids, pos, slots, lens, wpage, wrow = m[:, :_META].t().contiguous()
        table = m[:, _META : _META + width]
        model, cache = self.model, self.cache
        x = model.embed_tokens(ids)
        cos, sin = model.rotary.cos_sin(pos, x.dtype)

        def mixer(i, layer, h):
            if layer.layer_type == "linear_attention":
                return self._gdn_decode(i, layer.linear_attn, h, slots)
            return self._attn_decode(i, layer.self_attn, h, cos, sin, table, lens, wpage, wrow)

        return self._stack(x, mixer)

    def _stack(self, x, mixer):
        """The decoder stack with fused residual-add + norm: x += mixer(norm(x)); x += mlp(norm(x));
        returns the final-normed hidden states."""
        model = self.model
        layers = model.layers
        x, h = K.add_rmsnorm(x, None, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
        for i, layer in enumerate(layers):
            post = layer.post_attention_layernorm
            x, h = K.add_rmsnorm(x, mixer(i, layer, h), post.weight, post.eps)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
            x, h = K.add_rmsnorm(x, self._mlp(i, layer.mlp, h), nxt.weight, nxt.eps)
        return h

    def _gdn_decode(self, i, mod, h, slots):
        """The in-projection GEMV, the chain (conv update + SiLU, gated delta step on the state slot
        in place, gated RMSNorm with z), out_proj. (A one-launch fusion of the chain was measured on
        the H200 on 2026-12-01: no faster at batch 1, slower at batch 8; it was removed.)"""
        cd, vd, hv = mod.conv_dim, mod.value_dim, mod.hv
        proj = F.linear(h, self.fused[i].w_in)
        mixed, z = proj[:, :cd], proj[:, cd : cd + vd]
        b_raw, a_raw = proj[:, cd + vd : cd + vd + hv], proj[:, cd + vd + hv :]
        conv_out = K.conv_update(mixed, self.cache.conv[i], mod.conv1d.weight[:, 0, :], slots)
        core = K.gdn_decode_inplace(conv_out, a_raw, b_raw, mod.A_log, mod.dt_bias, self.cache.ssm[i], slots,
                                    mod.hk, mod.dk, mod.dv, mod.dk**-0.5)
        out = K.gated_rmsnorm(core.reshape(-1, mod.dv), z.reshape(-1, mod.dv), mod.norm.weight, mod.norm.eps)
        return F.linear(out.reshape(proj.shape[0], vd), mod.out_proj.weight)

    def _attn_qkv(self, i, mod, h):
        """The fused q+gate|k|v GEMV -> strided views q, gate [N, H, d], k, v [N, KVH, d]."""
        n = h.shape[0]
        proj = F.linear(h, self.fused[i].w_qkv, self.fused[i].b_qkv)
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
        return mod.o_proj(K.paged_decode_attention_gated(q, kc, vc, table, lens, mod.scale, gate))

    def _mlp(self, i, mlp, h):
        w = self.fused[i].w_gu
        if w is None:
            if h.shape[0] <= MOE_GATHER_MAX_TOKENS:
                return self._moe_few_tokens(mlp, h)
            return mlp(h)  # MoE block: its own forward (a loop over the experts that got tokens)
        return F.linear(K.silu_mul(F.linear(h, w)), mlp.down_proj.weight)

    @staticmethod
    def _moe_few_tokens(mlp, h):
        """MoE for a decode round (a few tokens): the router's logits by one matmul, then four
        Triton launches (gpu/moe_kernels.py): softmax/top-k/normalise; gate/up + SiLU*up and
        down GEMVs that read each chosen expert's rows straight from the fused expert tensors by
        the ids on the device; the routing-weight combine + gated shared expert. No expert counts
        come back to the host, so the round has no synchronisation and is CUDA-graph safe."""
        router = mlp.gate
        top_w, top_i = MK.route_topk(F.linear(h, router.weight), router.top_k, router.normalize)  # [N, k]
        ex, se = mlp.experts, mlp.shared_expert
        shared = (se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight, mlp.shared_expert_gate.weight)
        return MK.moe_decode(h, top_w, top_i, ex.gate_up_proj, ex.down_proj, shared)

    # ---- prefill (and any multi-token forward) ---------------------------------------------
    def _forward(self, segs, tokens: list[int]) -> torch.Tensor:
        if self.cache is None:
            raise RuntimeError("allocate_cache() must be called before a forward")
        self._check_tokens(tokens)
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        if all(s.length == 1 for s in segs):
            width = max(-(-(s.start + 1) // self.cache.page_size) for s in segs)
            meta = self._build_meta(segs, tokens, width).to(self.device)
            return self._decode_body(len(segs), meta, width)
        outs = [self._prefill_body(seg, ids[seg.offset : seg.offset + seg.length]) for seg in segs]
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    @torch.inference_mode()
    def prefill_with_snapshot(self, seq: SeqView, tokens, at: int, slot: int):
        """One forward over the chunk that also leaves the state after its first `at` tokens in
        state slot `slot` (a checkpoint inside the chunk): each GDN layer runs its conv and delta
        rule over the two parts and copies the lane's conv/recurrent state to `slot` between them;
        the projections, attention and MLPs run once over the whole chunk."""
        if not 0 < at < len(tokens):
            raise ValueError(f"snapshot position {at} outside the chunk of {len(tokens)} tokens")
        self._check_slot(slot)
        if slot == seq.slot:
            raise ValueError("the snapshot slot is the lane's own state slot")
        seg = self._segment(seq, len(tokens), offset=0)
        self._check_tokens(tokens)
        ids = torch.tensor(list(tokens), dtype=torch.int64, device=self.device)
        return self.model.logits(self._prefill_body(seg, ids, snap=(at, slot))[-1])

    def _prefill_body(self, seg, ids: torch.Tensor, snap: tuple[int, int] | None = None) -> torch.Tensor:
        model, cache, ps = self.model, self.cache, self.cache.page_size
        t = ids.shape[0]
        pos = torch.arange(seg.start, seg.start + t, device=self.device)
        need = -(-(seg.start + t) // ps)
        pages = torch.tensor(seg.pages[:need], dtype=torch.int32, device=self.device)
        wpage, wrow = pages[pos // ps].long(), pos % ps
        x = model.embed_tokens(ids)
        cos, sin = model.rotary.cos_sin(pos, x.dtype)

        def mixer(i, layer, h):
            if layer.layer_type == "linear_attention":
                return self._gdn_prefill(i, layer.linear_attn, h, seg.slot, snap)
            q, gate, k, v = self._attn_project(i, layer.self_attn, h, cos, sin)
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
