"""Hyper-connections: `hc_count` residual streams per token instead of one residual.

Each block reads one input mixed from the streams and writes its output back into every stream
with a per-stream weight (transformers' `Qwen4ExpTextGatedResidual`):

    n = grouped_rmsnorm(streams)                    # [N, hc * H], normalised per stream
    w = sigmoid(up(silu(down(n) / hc)))             # low-rank mixer, [N, hc, H]
    x = mean_s(w[s] * n[s])                         # the block's input [N, H]
    inject = 2 * sigmoid(block_inject(n) / hc)      # [N, hc]
    streams = streams + inject[:, s] * block(x)     # every stream gets the block's output

The model's last mixer has no injection: its mixed output is the final hidden state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GroupedRMSNorm(nn.Module):
    """Zero-centred RMSNorm over groups of `group` features (one group per stream), in fp32."""

    def __init__(self, dim: int, group: int, eps: float):
        super().__init__()
        self.group, self.eps = group, eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().unflatten(-1, (-1, self.group))
        xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedResidual(nn.Module):
    def __init__(self, hidden: int, hc: int, lowrank: int, eps: float, combine: bool = True):
        super().__init__()
        self.hidden, self.hc = hidden, hc
        self.hc_norm = GroupedRMSNorm(hc * hidden, hidden, eps)
        self.input_mix_weight_down = nn.Linear(hc * hidden, lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(lowrank, hc * hidden, bias=False)
        self.block_inject_weight = nn.Linear(hc * hidden, hc, bias=False) if combine else None

    def mix(self, streams: torch.Tensor):
        """streams [N, hc*H] -> (block input [N, H], injection weights [N, hc] or None)."""
        n = self.hc_norm(streams)
        w = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(n) / self.hc)))
        x = (w.unflatten(-1, (self.hc, self.hidden)) * n.unflatten(-1, (self.hc, self.hidden))).mean(dim=-2)
        if self.block_inject_weight is None:
            return x, None
        return x, 2 * torch.sigmoid(self.block_inject_weight(n) / self.hc)

    @staticmethod
    def inject(streams: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """streams [N, hc*H] + out [N, H] weighted per stream by weights [N, hc]."""
        return streams + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)
