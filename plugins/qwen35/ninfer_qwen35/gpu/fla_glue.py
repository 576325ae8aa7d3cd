"""Gated DeltaNet prefill through flash-linear-attention (fla-core), with the CPU fallback.

`gdn_prefill` runs one sequence's chunk: the state slot is the fla `initial_state` and the
`final_state` is written back into the same slot. fla needs triton and CUDA; elsewhere the
plugin's torch reference (`ninfer_qwen35.gdn.chunk_gated_delta_rule`) runs the same math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer_qwen35 import gdn as ref_gdn

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
