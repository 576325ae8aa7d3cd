"""Gated DeltaNet through core's GPU kernels (`ninfer_core.accel`; the layer is `ninfer_core.nn.gdn`'s).

Decode batches: the Triton conv update and gated-delta step on the state slots in place
(`conv_update`, `gdn_decode_inplace`); prefill chunks: the Triton causal conv and fla's chunked
rule (`conv_prefill`, `gdn_prefill`), the recurrent Triton kernel for short chunks. Verify
segments keep the reference's per-token steps (commit needs the state after every token). Off
CUDA (and without TRITON_INTERPRET=1) every kernel call is its torch reference, which is how the
CPU tests check this glue.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer_core.accel import kernels as K
from ninfer_core.accel.fla_glue import gdn_prefill
from ninfer_core.nn.gdn import GatedDeltaNet


class KernelGatedDeltaNet(GatedDeltaNet):
    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        conv_all = ctx.cache.conv[self.layer_idx]
        ssm_all = ctx.cache.ssm[self.layer_idx]
        weight = self.conv1d.weight[:, 0, :].contiguous()
        mixed = self.in_proj_qkv(x)
        z = self.in_proj_z(x)
        b_raw = self.in_proj_b(x).contiguous()
        a_raw = self.in_proj_a(x).contiguous()
        scale = self.dk**-0.5
        if all(s.kind == "decode" for s in ctx.segments):
            slots = torch.tensor(ctx.slots, dtype=torch.int64, device=x.device)
            conv_out = K.conv_update(mixed.contiguous(), conv_all, weight, slots)
            core = K.gdn_decode_inplace(conv_out, a_raw, b_raw, self.A_log, self.dt_bias, ssm_all, slots,
                                        self.hk, self.dk, self.dv, scale)
        else:
            outs = []
            for seg in ctx.segments:
                rows = slice(seg.offset, seg.offset + seg.length)
                if seg.stepwise:
                    g = -self.A_log.float().exp() * F.softplus(a_raw[rows].float() + self.dt_bias.float())
                    beta = torch.sigmoid(b_raw[rows]).float()
                    outs.append(self._steps(seg, mixed[rows], g, beta, conv_all, ssm_all, weight, ctx).to(x.dtype))
                    continue
                conv_out = K.conv_prefill(mixed[rows].contiguous(), conv_all, weight, seg.slot)
                if seg.length <= K.RECURRENT_PREFILL_MAX_T and K.use_triton(conv_out):
                    core = K.gdn_prefill_recurrent(conv_out, a_raw[rows], b_raw[rows], self.A_log, self.dt_bias,
                                                   ssm_all, seg.slot, self.hk, self.dk, self.dv, scale)
                else:
                    core = gdn_prefill(self, conv_out, a_raw[rows], b_raw[rows], ssm_all, seg.slot)
                outs.append(core.to(x.dtype))
            core = torch.cat(outs) if len(outs) > 1 else outs[0]
        core = core.to(x.dtype)
        out = self.norm(core, z.reshape(core.shape))
        return self.out_proj(out.reshape(x.shape[0], self.value_dim))


def use_kernels(model) -> None:
    """Swap every GDN and indexed attention layer of `model` to the kernel path (same parameters,
    same cache layout; gpu/indexed.py is the attention's)."""
    from ninfer_flash_next.attention import IndexedAttention
    from ninfer_flash_next.gpu.indexed import KernelIndexedAttention

    for layer in model.layers:
        if layer.layer_type == "linear_attention" and type(layer.linear_attn) is GatedDeltaNet:
            layer.linear_attn.__class__ = KernelGatedDeltaNet
        elif layer.layer_type != "linear_attention" and type(layer.self_attn) is IndexedAttention:
            layer.self_attn.__class__ = KernelIndexedAttention
