"""Gemma 4 building blocks (torch reference): RMSNorm, RoPE tables per layer type, the GeGLU MLP and
the routed-expert block of the MoE variant. Module and parameter names follow the Hugging Face
checkpoint so weights load by name."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ninfer_core.quant.weight import QuantizedWeight
from ninfer_gemma4.config import Gemma4Config, RopeSpec


def _use_kernels(x: torch.Tensor) -> bool:
    from ninfer_gemma4.gpu.attention import use_triton

    return use_triton(x)


class RMSNorm(nn.Module):
    """x * (mean(x^2) + eps)^-1/2 * weight, in fp32 (Gemma 4 scales by the weight itself, not 1 + w)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _use_kernels(x):  # one launch on the GPU path (gpu/norm.py); the lines below are its reference
            from ninfer_gemma4.gpu.norm import rms_norm

            return rms_norm(x, self.weight, self.eps)
        xf = x.float()
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.type_as(x)


def act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu(x)
    if name == "silu":
        return F.silu(x)
    raise ValueError(f"unsupported hidden_activation {name!r}")


def inv_freq(spec: RopeSpec, head_dim: int, device=None) -> torch.Tensor:
    """[head_dim // 2] inverse frequencies; "proportional" RoPE rotates only the first
    partial * head_dim / 2 pairs (the rest have frequency 0, so cos 1 and sin 0)."""
    if spec.kind == "proportional":
        angles = int(spec.partial * head_dim // 2)
        rot = 1.0 / (spec.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float32, device=device) / head_dim))
        freq = torch.cat([rot, torch.zeros(head_dim // 2 - angles, dtype=torch.float32, device=device)])
        return freq / spec.factor
    return 1.0 / (spec.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def rope_tables(freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin [N, head_dim] for int positions [N] (the two halves repeat, as rotate_half expects)."""
    f = positions.float()[:, None] * freq[None, :]
    emb = torch.cat([f, f], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d]; cos/sin [N, d]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


class MLP(nn.Module):
    def __init__(self, hidden: int, width: int, activation: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(act(self.activation, self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Softmax over experts of a scaled, unweighted-RMS-normed input; top-k renormalised, then
    multiplied by a learned per-expert scale."""

    def __init__(self, cfg: Gemma4Config):
        super().__init__()
        h = cfg.hidden_size
        self.top_k = cfg.top_k_experts
        self.norm = RMSNorm(h, cfg.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(h, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(h))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        self.root = h ** -0.5

    def forward(self, x: torch.Tensor):
        scores = self.proj(self.norm(x) * self.scale * self.root)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.per_expert_scale[index], index


DECODE_TOKENS = 16  # at most this many tokens take the sync-free expert GEMV (a decode or verify batch)


class Experts(nn.Module):
    """Fused expert weights: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, cfg: Gemma4Config):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.activation = cfg.hidden_activation

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        from ninfer_gemma4.gpu import moe

        if moe.use_triton(x) and not isinstance(self.gate_up_proj, QuantizedWeight):
            # the GPU paths (gpu/moe.py, bf16 experts); the loop below is their reference and runs
            # encoded experts through the dequantising linear
            if index.shape[0] <= DECODE_TOKENS:
                return moe.experts_decode(x, weights, index, self.gate_up_proj, self.down_proj, self.activation)
            out = moe.experts_grouped(x, weights, index, self.gate_up_proj, self.down_proj, self.activation)
            if out is not None:
                return out
        return self.forward_loop(x, weights, index)

    def forward_loop(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in torch.unique(index).tolist():
            tok, slot = torch.where(index == e)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(act(self.activation, gate) * up, self.down_proj[e])
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
        return out
