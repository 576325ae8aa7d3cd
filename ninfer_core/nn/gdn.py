"""Gated DeltaNet ("linear_attention") layers: torch reference of the conv and the gated delta rule.

Per head the recurrent state S is [dk, dv] (fp32). One step with decay g (log space), rate beta:
    S <- exp(g) * S;   u = beta * (v - S^T k);   S <- S + k u^T;   o = S^T q
q and k are L2-normalised and q is scaled by dk^-0.5 before the rule.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ninfer_core.nn.config import HybridConfig
from ninfer_core.nn.context import ForwardContext
from ninfer_core.nn.layers import GatedRMSNorm

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # rsqrt(sum + eps), the form fla's kernels (and transformers) use
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The gated delta rule over T tokens of one sequence, chunk by chunk, from `state`.

    q, k: [T, H, dk]; v: [T, H, dv]; g, beta: [T, H]; state: [H, dk, dv]; all fp32, q and k
    already normalised and scaled. Returns (out [T, H, dv], final state [H, dk, dv]).

    Inside a chunk with cumulative log decay c_i, the values written to the state are
    u = (I + A)^-1 (beta*v - beta*exp(c)*k S0) with A_ij = beta_i exp(c_i - c_j) k_i.k_j (j < i),
    so one triangular solve replaces the token loop; the chunks run in sequence.
    """
    T, H, _dk = k.shape
    dv = v.shape[-1]
    C = min(chunk, T)
    pad = (-T) % C
    if pad:
        # padded tokens have k = v = 0, beta = 0, g = 0: they leave the state unchanged
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (T + pad) // C
    # [H, n, C, d]
    q, k, v = (x.reshape(n, C, H, -1).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.reshape(n, C, H).permute(2, 0, 1) for x in (g, beta))

    c = g.cumsum(-1)  # [H, n, C]
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = (c[..., :, None] - c[..., None, :]).masked_fill(~lower, float("-inf"))
    decay = diff.exp()  # [H, n, C, C], exp(c_i - c_j) on and below the diagonal

    kb = k * beta[..., None]
    a = (kb @ k.transpose(-1, -2)) * decay
    system = a.tril(-1) + torch.eye(C, dtype=q.dtype, device=q.device)
    u0 = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * c.exp()[..., None], upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * c.exp()[..., None]
    k_dec = k * (c[..., -1:] - c).exp()[..., None]
    end_decay = c[..., -1].exp()  # [H, n]

    out = torch.empty(H, n, C, dv, dtype=q.dtype, device=q.device)
    s = state
    for i in range(n):
        u = u0[:, i] - w[:, i] @ s  # [H, C, dv]
        out[:, i] = q_dec[:, i] @ s + qk[:, i] @ u
        s = s * end_decay[:, i, None, None] + k_dec[:, i].transpose(-1, -2) @ u
    out = out.permute(1, 2, 0, 3).reshape(n * C, H, dv)[:T]
    return out, s


def recurrent_gated_delta_step(q, k, v, g, beta, state):
    """One token for each of B sequences: q, k [B, H, dk]; v [B, H, dv]; g, beta [B, H];
    state [B, H, dk, dv]. Returns (out [B, H, dv], new state)."""
    s = state * g.exp()[..., None, None]
    kv = torch.einsum("bhk,bhkv->bhv", k, s)
    u = beta[..., None] * (v - kv)
    s = s + k[..., :, None] * u[..., None, :]
    out = torch.einsum("bhk,bhkv->bhv", q, s)
    return out, s


def causal_conv_prefill(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor):
    """Depthwise causal conv over T new columns after the cached ones, then SiLU.

    x: [conv_dim, T]; conv_state: [conv_dim, K-1] (the previous inputs); weight: [conv_dim, K].
    Returns (out [conv_dim, T], new state [conv_dim, K-1]).
    """
    km1 = weight.shape[-1] - 1
    full = torch.cat([conv_state.to(x.dtype), x], dim=-1)
    out = F.conv1d(full[None], weight[:, None, :], groups=weight.shape[0])[0]
    return F.silu(out), full[:, full.shape[-1] - km1 :]


def causal_conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor):
    """One new column per sequence: x [B, conv_dim]; conv_state [B, conv_dim, K-1]."""
    full = torch.cat([conv_state.to(x.dtype), x[..., None]], dim=-1)  # [B, conv_dim, K]
    out = (full * weight[None]).sum(-1)
    return F.silu(out), full[..., 1:]


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: HybridConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = cfg.gdn_key_dim, cfg.gdn_value_dim
        self.conv_dim = cfg.gdn_conv_dim
        self.kernel = cfg.linear_conv_kernel_dim
        h = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.hv, bias=False)
        self.in_proj_a = nn.Linear(h, self.hv, bias=False)
        # depthwise conv weight as stored by HF's nn.Conv1d: [conv_dim, 1, kernel]
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.kernel), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.hv), requires_grad=False)
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state shape, recurrent state shape) of one slot."""
        return (self.conv_dim, self.kernel - 1), (self.hv, self.dk, self.dv)

    def _qkv_heads(self, mixed: torch.Tensor):
        """Split conv output [N, conv_dim] into fp32 q, k (repeated to Hv heads, normalised) and v."""
        n = mixed.shape[0]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(n, self.hk, self.dk)
        k = k.reshape(n, self.hk, self.dk)
        v = v.reshape(n, self.hv, self.dv).float()
        if self.hv != self.hk:
            # each key head serves hv/hk consecutive value heads
            q = q.repeat_interleave(self.hv // self.hk, dim=1)
            k = k.repeat_interleave(self.hv // self.hk, dim=1)
        q = l2norm(q.float()) * (self.dk**-0.5)
        k = l2norm(k.float())
        return q, k, v

    def _steps(self, seg, mixed, g, beta, conv_all, ssm_all, weight, ctx: ForwardContext) -> torch.Tensor:
        """A decode or verify segment: one recurrent step per token (the decode math), from the
        slot's state. A verify segment also records the state after every token, so `commit` can
        keep any prefix (GDN state cannot be truncated)."""
        conv_s, ssm_s = conv_all[seg.slot][None], ssm_all[seg.slot][None]
        outs, conv_hist, ssm_hist = [], [], []
        for j in range(seg.length):
            conv_out, conv_s = causal_conv_step(mixed[j : j + 1], conv_s, weight)
            conv_s = conv_s.to(conv_all.dtype)
            q, k, v = self._qkv_heads(conv_out)
            o, ssm_s = recurrent_gated_delta_step(q, k, v, g[j : j + 1], beta[j : j + 1], ssm_s)
            outs.append(o)
            if seg.kind == "verify":
                conv_hist.append(conv_s[0].clone())
                ssm_hist.append(ssm_s[0].clone())
        conv_all[seg.slot] = conv_s[0]
        ssm_all[seg.slot] = ssm_s[0]
        if seg.kind == "verify":
            ctx.verify_states.setdefault(seg.slot, {})[self.layer_idx] = (torch.stack(conv_hist), torch.stack(ssm_hist))
        return torch.cat(outs)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [N, hidden] for the flattened batch; reads and advances each segment's slot state."""
        conv_all = ctx.cache.conv[self.layer_idx]
        ssm_all = ctx.cache.ssm[self.layer_idx]
        weight = self.conv1d.weight[:, 0, :]
        mixed = self.in_proj_qkv(x)  # [N, conv_dim]
        z = self.in_proj_z(x)
        beta = torch.sigmoid(self.in_proj_b(x)).float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())

        if ctx.is_decode and all(s.kind == "decode" for s in ctx.segments):
            slots = torch.tensor(ctx.slots, device=x.device)
            conv_out, new_conv = causal_conv_step(mixed, conv_all[slots], weight)
            conv_all[slots] = new_conv.to(conv_all.dtype)
            q, k, v = self._qkv_heads(conv_out)
            core, new_s = recurrent_gated_delta_step(q, k, v, g, beta, ssm_all[slots])
            ssm_all[slots] = new_s
        else:
            outs = []
            for seg in ctx.segments:
                rows = slice(seg.offset, seg.offset + seg.length)
                if seg.stepwise:
                    outs.append(self._steps(seg, mixed[rows], g[rows], beta[rows], conv_all, ssm_all, weight, ctx))
                    continue
                conv_out, new_conv = causal_conv_prefill(mixed[rows].t(), conv_all[seg.slot], weight)
                conv_all[seg.slot] = new_conv.to(conv_all.dtype)
                q, k, v = self._qkv_heads(conv_out.t())
                o, s = chunk_gated_delta_rule(q, k, v, g[rows], beta[rows], ssm_all[seg.slot])
                ssm_all[seg.slot] = s
                outs.append(o)
            core = torch.cat(outs) if len(outs) > 1 else outs[0]

        core = core.to(x.dtype)  # [N, Hv, dv]
        out = self.norm(core, z.reshape(core.shape))
        return self.out_proj(out.reshape(x.shape[0], self.value_dim))
