"""Gated DeltaNet prefill through flash-linear-attention (fla-core), with the CPU fallback.

`gdn_prefill` runs one sequence's chunk: the state slot is the fla `initial_state` and the
`final_state` is written back into the same slot. fla needs triton and CUDA; elsewhere the
torch reference (`ninfer_core.nn.gdn.chunk_gated_delta_rule`) runs the same math.

`GdnPrefillGraphs` runs the same call as a CUDA Graph for chunks of up to 1024 tokens. On the
H200, fla's Python side costs ~1.25 ms of host time per call (autotuner keys, wrappers, about ten
launches), which for a chunk of a few hundred tokens is more than the device work of the whole
layer: a 281-token chunk of the 27B shape took 106 ms of host time against 48 ms of kernels. A
graph is captured per bucket length; a chunk is padded at its end to the bucket with rows whose
decay g is 0 and whose beta is 0. Such a row changes nothing: it writes beta * (...) = 0 into the
state and decays it by exp(0) = 1, and rows before it never see it (the rule is causal), so the
real rows' outputs and the final state are those of the unpadded chunk. One graph per bucket
serves every GDN layer: the layer's A_log / dt_bias, the chunk and the initial state are copied
into the graph's static inputs, and the output and final state copied out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer_core.nn import gdn as ref_gdn

_FLA = None


def fla_chunk():
    """fla's chunk_gated_delta_rule, or None when fla is not importable."""
    global _FLA
    if _FLA is None:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            _FLA = chunk_gated_delta_rule
        except Exception:  # pragma: no cover - depends on the install
            _FLA = False
    return _FLA or None


def gdn_gates(a_raw: torch.Tensor, b_raw: torch.Tensor, A_log, dt_bias):
    """(g fp32 log decay, beta fp32) from the raw projections, as the reference computes them."""
    g = -A_log.float().exp() * F.softplus(a_raw.float() + dt_bias.float())
    beta = torch.sigmoid(b_raw).float()
    return g, beta


def gdn_prefill(mod, conv_out: torch.Tensor, a_raw, b_raw, ssm_all: torch.Tensor, slot: int) -> torch.Tensor:
    """conv_out [T, conv_dim] (after SiLU) of one sequence -> core output [T, Hv, dv] (input
    dtype); reads and writes `ssm_all[slot]`."""
    g, beta = gdn_gates(a_raw, b_raw, mod.A_log, mod.dt_bias)
    fn = fla_chunk() if conv_out.is_cuda else None
    if fn is None:
        q, k, v = mod._qkv_heads(conv_out)
        o, s = ref_gdn.chunk_gated_delta_rule(q, k, v, g, beta, ssm_all[slot])
        ssm_all[slot] = s
        return o.to(conv_out.dtype)
    t = conv_out.shape[0]
    q, k, v = torch.split(conv_out, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
    q = q.reshape(1, t, mod.hk, mod.dk)
    k = k.reshape(1, t, mod.hk, mod.dk)
    v = v.reshape(1, t, mod.hv, mod.dv)
    o, final = fn(
        q.contiguous(), k.contiguous(), v.contiguous(), g[None].contiguous(), torch.sigmoid(b_raw)[None].contiguous(),  # beta in q's dtype, as transformers passes it
        scale=mod.dk**-0.5, initial_state=ssm_all[slot][None].contiguous(), output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    ssm_all[slot] = final[0]
    return o[0]


GRAPH_BUCKETS = (128, 256, 384, 512, 768, 1024)


def graph_bucket(t: int) -> int | None:
    """The padded length a chunk of t tokens runs at, or None (chunks longer than the largest bucket
    are device-bound and run eagerly)."""
    for b in GRAPH_BUCKETS:
        if t <= b:
            return b
    return None


def padded_gdn_core(fn, xin, nreal, A, dtb, h0, dims, scale):
    """The graph body: xin [Tp, conv_dim + 2*Hv] = [conv_out | a_raw | b_raw] with rows at and past
    `nreal` (a 1-element device tensor) being padding; A = A_log (fp32), dtb = dt_bias (fp32),
    h0 [1, Hv, dk, dv] fp32. Returns fla-shaped (o [1, Tp, Hv, dv], final [1, Hv, dk, dv])."""
    hk, hv, dk, dv = dims
    tp = xin.shape[0]
    kd, vd = hk * dk, hv * dv
    cd = 2 * kd + vd
    conv, a, b = xin[:, :cd], xin[:, cd:cd + hv], xin[:, cd + hv:]
    live = (torch.arange(tp, device=xin.device) < nreal).unsqueeze(1)  # [Tp, 1]
    g = (-A.exp() * F.softplus(a.float() + dtb)) * live.float()
    beta = torch.sigmoid(b) * live.to(b.dtype)
    q, k, v = torch.split(conv, [kd, kd, vd], dim=-1)
    return fn(
        q.reshape(1, tp, hk, dk).contiguous(), k.reshape(1, tp, hk, dk).contiguous(),
        v.reshape(1, tp, hv, dv).contiguous(), g[None].contiguous(), beta[None].contiguous(),
        scale=scale, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )


class _Entry:
    __slots__ = ("graph", "xin", "nreal", "A", "dtb", "h0", "o", "final")


class GdnPrefillGraphs:
    """CUDA Graphs of fla's chunked GDN forward, one per bucket length and layer geometry."""

    def __init__(self):
        self._entries: dict[tuple, _Entry] = {}
        self._pool = None

    def clear(self) -> None:
        self._entries.clear()
        self._pool = None

    def __len__(self) -> int:
        return len(self._entries)

    def run(self, mod, conv_out: torch.Tensor, a_raw, b_raw, ssm_all: torch.Tensor, slot: int):
        """Like `gdn_prefill` (same arguments, same result); None when this chunk does not take the
        graph path (no fla, not CUDA, or longer than the largest bucket)."""
        t = conv_out.shape[0]
        tp = graph_bucket(t)
        fn = fla_chunk() if conv_out.is_cuda else None
        if tp is None or fn is None:
            return None
        dims = (mod.hk, mod.hv, mod.dk, mod.dv)
        key = (tp, dims, conv_out.dtype, conv_out.device)
        e = self._entries.get(key)
        fresh = e is None
        if fresh:
            e = self._alloc(tp, dims, conv_out)
        cd, hv = conv_out.shape[1], mod.hv
        e.xin[:t, :cd].copy_(conv_out)
        e.xin[:t, cd:cd + hv].copy_(a_raw)
        e.xin[:t, cd + hv:].copy_(b_raw)
        if t < tp:
            e.xin[t:].zero_()
        e.nreal.fill_(t)
        e.A.copy_(mod.A_log)
        e.dtb.copy_(mod.dt_bias)
        e.h0[0].copy_(ssm_all[slot])
        if fresh:
            self._capture(e, fn, dims, mod.dk**-0.5)
            self._entries[key] = e
        e.graph.replay()
        ssm_all[slot].copy_(e.final[0])
        return e.o[0, :t].clone()

    @staticmethod
    def _alloc(tp, dims, like):
        hk, hv, dk, dv = dims
        e = _Entry()
        dev = like.device
        e.xin = torch.zeros(tp, 2 * hk * dk + hv * dv + 2 * hv, dtype=like.dtype, device=dev)
        e.nreal = torch.zeros((), dtype=torch.int64, device=dev)
        e.A = torch.zeros(hv, dtype=torch.float32, device=dev)
        e.dtb = torch.zeros(hv, dtype=torch.float32, device=dev)
        e.h0 = torch.zeros(1, hv, dk, dv, dtype=torch.float32, device=dev)
        return e

    def _capture(self, e: _Entry, fn, dims, scale) -> None:
        dev = e.xin.device

        def body():
            return padded_gdn_core(fn, e.xin, e.nreal, e.A, e.dtb, e.h0, dims, scale)

        torch.cuda.synchronize(dev)
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # compilation and autotuning happen outside the capture
                body()
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        e.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(e.graph, pool=self._pool):
            e.o, e.final = body()
        torch.cuda.synchronize(dev)
