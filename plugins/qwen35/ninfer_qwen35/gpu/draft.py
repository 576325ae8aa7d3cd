"""The MTP draft head on the GPU path: fused projections, the Triton paged decode attention
(keys from position 1: the head has no row at position 0) and the decode step's kernels.

Same math as `ninfer_core.engine.mtp_draft.MtpDraftHead` (the reference, whose `step` also runs here for
heads of more than one layer); `write_kv` is the ride-along of every target forward (tensor inputs
only, so it runs inside the decode and verify CUDA Graphs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ninfer_core.accel import kernels as K
from ninfer_core.engine.model_api import DraftStep
from ninfer_core.engine.mtp_draft import KEY_START, MtpDraftHead

MAX_CHAIN_GRAPH_LANES = 8


class GpuMtpDraftHead(MtpDraftHead):
    def __init__(self, runner):
        super().__init__(runner)
        if len(self.head.layers) != 1:
            raise NotImplementedError("the GPU path runs MTP heads of one layer (this one has "
                                      f"{len(self.head.layers)}); load it on the CPU")
        from ninfer_qwen35.gpu.runner import _fuse

        layer = self.head.layers[0]
        a = layer.self_attn
        self.w_qkv = _fuse([a.q_proj, a.k_proj, a.v_proj])
        self.b_qkv = torch.cat([m.bias for m in (a.q_proj, a.k_proj, a.v_proj)]) if a.q_proj.bias is not None else None
        self.w_gu = _fuse([layer.mlp.gate_proj, layer.mlp.up_proj]) if hasattr(layer.mlp, "gate_proj") else None
        self._chains: dict = {}  # (lanes, steps, pick) -> captured chain graph and its buffers

    def _qkv(self, h):
        a = self.head.layers[0].self_attn
        n = h.shape[0]
        proj = F.linear(h, self.w_qkv, self.b_qkv)
        hd, nh, kvh = a.head_dim, a.heads, a.kv_heads
        qg = proj[:, : nh * 2 * hd].view(n, nh, 2 * hd)
        k = proj[:, nh * 2 * hd: nh * 2 * hd + kvh * hd].view(n, kvh, hd)
        v = proj[:, nh * 2 * hd + kvh * hd:].view(n, kvh, hd)
        return qg[..., :hd], qg[..., hd:], k, v

    def _project_write(self, x, pos, wpage, wrow):
        """input norm, q/k/v, q/k norm + RoPE with the K/V rows written -> (q [N, H, d], gate)."""
        layer = self.head.layers[0]
        a = layer.self_attn
        cos, sin = self.runner.model.rotary.cos_sin(pos, x.dtype)
        h = layer.input_layernorm(x)
        q, gate, k, v = self._qkv(h)
        kc, vc = self.runner.cache.kv[self.layer_ids[0]]
        q = K.qk_norm_rope_kv(q, k, v, a.q_norm.weight, a.k_norm.weight, cos, sin, a.q_norm.eps, kc, vc, wpage, wrow)
        return q, gate

    def write_kv(self, pos, ids, prev, wpage, wrow) -> None:
        """The head's K/V rows at `pos` [N] from tokens `ids` [N] and the previous hidden [N, H]."""
        self._project_write(self.fuse_inputs(ids, prev), pos, wpage.contiguous(), wrow.contiguous())

    def drop_graphs(self) -> None:
        self._chains = {}

    def _meta(self, rows: Sequence[DraftStep], width: int) -> torch.Tensor:
        """[B, 6 + 2 * width] int64: token, position, slot, keys, write page, write row, the table it
        attends through, the table it writes through (both padded with the scratch page)."""
        r = self.runner
        ps = r.cache.page_size
        host = []
        for row in rows:
            n = row.kv_len if row.kv_len is not None else row.position + 1
            wt = list(row.write_table if row.write_table is not None else row.table)
            table = list(row.table[:width])  # (a chain's later rows attend further into the same table)
            host.append([row.token, row.position, row.slot, n, wt[row.position // ps], row.position % ps,
                         *table, *([r.scratch_page] * (width - len(table))),
                         *wt[:width], *([r.scratch_page] * (width - min(width, len(wt))))])
        return torch.tensor(host, dtype=torch.int64)

    def _body(self, ids, pos, slots, lens, wpage, wrow, table, prev):
        """One draft position for every row (tensors only) -> final-normed hidden [B, H]."""
        r = self.runner
        cache = r.cache
        x = self.fuse_inputs(ids, prev)
        layer = self.head.layers[0]
        a = layer.self_attn
        q, gate = self._project_write(x, pos, wpage, wrow)
        kc, vc = cache.kv[self.layer_ids[0]]
        o = K.paged_decode_attention(q.contiguous(), kc, vc, table, lens, a.scale, key_start=KEY_START)
        x = x + a.finish(o, gate.reshape(x.shape[0], -1))
        h = layer.post_attention_layernorm(x)
        if self.w_gu is not None:
            x = x + F.linear(K.silu_mul(F.linear(h, self.w_gu)), layer.mlp.down_proj.weight)
        else:  # an MoE head: the decode step's routed-expert kernels
            x = x + (r._moe_few_tokens(layer.mlp, h) if h.shape[0] <= 8 else layer.mlp(h))
        return self.head.norm(x)

    def _chain_body(self, m: torch.Tensor, width: int, steps: int, pick, prev=None) -> torch.Tensor:
        """`steps` chained positions from the packed rows `m` -> picks [B, steps] (no host sync)."""
        ps = self.runner.cache.page_size
        ids, pos, slots, lens, _, _ = m[:, :6].t().contiguous()
        table = m[:, 6: 6 + width].to(torch.int32)
        wtable = m[:, 6 + width: 6 + 2 * width]
        if prev is None:
            prev = self.runner.cache.hidden.index_select(0, slots)
        out = []
        for j in range(steps):
            p = pos + j
            wpage = wtable.gather(1, (p // ps).clamp(max=width - 1)[:, None])[:, 0].contiguous()
            hidden = self._body(ids, p, slots, (lens + j).to(torch.int32), wpage, p % ps, table, prev)
            ids = pick(hidden)
            out.append(ids)
            prev = hidden
        return torch.stack(out, 1)

    @torch.inference_mode()
    def chain(self, rows: Sequence[DraftStep], steps: int, pick) -> torch.Tensor:
        r = self.runner
        self._check_rows(rows)
        if any(row.prev_hidden is not None for row in rows):
            return super().chain(rows, steps, pick)
        b = len(rows)
        if not (r.graphs_enabled and b <= MAX_CHAIN_GRAPH_LANES):
            width = max(-(-(row.position + steps) // r.cache.page_size) for row in rows)
            width = max(width, max(max(len(row.write_table or row.table), len(row.table)) for row in rows))
            m = self._meta(rows, width).to(r.device, non_blocking=True)
            return self._chain_body(m, width, steps, pick)
        g = self._chain_graph(b, steps, pick)
        g["host"][:b].copy_(self._meta(rows, r.table_width))
        g["meta"].copy_(g["host"], non_blocking=True)
        g["graph"].replay()
        return g["out"]

    def _chain_graph(self, b: int, steps: int, pick) -> dict:
        key = (b, steps, id(pick.__func__) if hasattr(pick, "__func__") else id(pick))
        hit = self._chains.get(key)
        if hit is not None:
            return hit
        r = self.runner
        width = r.table_width
        torch.cuda.synchronize(r.device)
        host = torch.zeros(b, 6 + 2 * width, dtype=torch.int64).pin_memory()
        host[:, 1] = 1  # warm-up rows: position 1 on the scratch slot and page
        host[:, 2] = r.scratch_slot
        host[:, 3] = 2
        host[:, 4] = r.scratch_page
        host[:, 6:] = r.scratch_page
        meta = host.to(r.device)
        stream = torch.cuda.Stream(device=r.device)
        stream.wait_stream(torch.cuda.current_stream(r.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._chain_body(meta, width, steps, pick)
        torch.cuda.current_stream(r.device).wait_stream(stream)
        if r._pool is None:
            r._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=r._pool):
            out = self._chain_body(meta, width, steps, pick)
        r._reset_scratch()
        torch.cuda.synchronize(r.device)
        g = {"graph": graph, "host": host, "meta": meta, "out": out, "pick": pick}
        self._chains[key] = g
        return g

    @torch.inference_mode()
    def step(self, rows: Sequence[DraftStep]) -> torch.Tensor:
        r = self.runner
        self._check_rows(rows)
        width = max(len(row.table) for row in rows)
        m = self._meta(rows, width).to(r.device, non_blocking=True)
        ids, pos, slots, lens, wpage, wrow = m[:, :6].t().contiguous()
        table = m[:, 6: 6 + width].to(torch.int32)
        given = [row.prev_hidden for row in rows]
        prev = r.cache.hidden.index_select(0, slots)
        if any(p is not None for p in given):
            prev = torch.stack([prev[i] if p is None else p.to(prev.dtype) for i, p in enumerate(given)])
        return self._body(ids, pos, slots, lens.to(torch.int32), wpage, wrow, table, prev)
