"""Small building blocks of the hybrid layers: norms, MLP, rotary embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ninfer_core.nn.config import HybridConfig, RopeConfig


class ZeroCenteredRMSNorm(nn.Module):
    """`x * rsqrt(mean(x^2) + eps) * (1 + w)`, computed in fp32, cast back to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """The GDN output norm: plain weight (not zero-centred), gated by silu(z).

    The weight multiplies the normalised value after its cast back to the input dtype, and the
    gate is applied in fp32: the same rounding points as transformers' gated RMSNorm of the GDN models.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * F.silu(z.float())).to(dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); the dense MLP and the MoE shared expert."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RotaryEmbedding:
    """Partial neox RoPE over the first `rotary_dim` dims of each head.

    Text positions are equal on mRoPE's three axes, so the interleaved mRoPE of transformers
    reduces to this plain RoPE (checked in the tests). Tables are computed per call from the
    positions: cheap next to the projections, and no cache to invalidate.
    """

    def __init__(self, head_dim: int, rope: RopeConfig, device=None):
        dim = int(head_dim * rope.partial_rotary_factor)
        self.rotary_dim = dim
        self.mrope_section = tuple(rope.mrope_section)
        self.mrope_interleaved = rope.mrope_interleaved
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float32) / dim
        inv_freq = 1.0 / (rope.theta**exponent)
        if rope.rope_type == "linear":
            inv_freq = inv_freq / rope.factor
        self.inv_freq = inv_freq  # [rotary_dim // 2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [N, rotary_dim] for integer positions [N], or multimodal positions
        [3, N] (t, h, w): frequency i takes its axis from the interleaved mRoPE layout (i % 3 in
        the first 3 * section entries, t beyond them)."""
        inv = self.inv_freq.to(positions.device)
        if positions.dim() == 2:
            axes = positions.float()[:, :, None] * inv[None, None, :]  # [3, N, rot/2]
            freqs = axes[0].clone()
            for axis in (1, 2):
                if self.mrope_interleaved:
                    idx = slice(axis, self.mrope_section[axis] * 3, 3)
                else:  # contiguous sections t | h | w
                    lo = sum(self.mrope_section[:axis])
                    idx = slice(lo, lo + self.mrope_section[axis])
                freqs[:, idx] = axes[axis][:, idx]
        else:
            freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x [N, heads, head_dim]; cos/sin [N, rot]."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def make_mlp(cfg: HybridConfig) -> nn.Module:
    if cfg.is_moe:
        from ninfer_core.nn.moe import SparseMoeBlock

        return SparseMoeBlock(cfg)
    return SwiGLU(cfg.hidden_size, cfg.intermediate_size)
