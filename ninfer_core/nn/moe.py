"""The sparse MoE block of the hybrid models: softmax top-k router, fused experts, gated shared expert.

Expert weights are kept fused as the published MoE checkpoints store them and transformers does:
`experts.gate_up_proj` [E, 2*I, H] (rows [gate | up]) and `experts.down_proj` [E, H, I], so that
expert e computes down[e] @ (silu(gate[e] @ x) * up[e] @ x).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ninfer_core.nn.config import HybridConfig
from ninfer_core.nn.layers import SwiGLU


class Router(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.normalize = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor):
        """x [N, H] -> (weights [N, k] in x's dtype, expert ids [N, k])."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_w.to(logits.dtype), top_i


class Experts(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i), requires_grad=False)

    def forward(self, x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        """On CUDA: sorted token-expert pairs through two grouped GEMMs, no host synchronisation
        (gpu/moe_kernels.py); elsewhere, or where the grouped GEMM is unavailable, the expert loop."""
        if x.is_cuda and isinstance(self.gate_up_proj, torch.Tensor):  # encoded experts take the loop
            from ninfer_core.accel.moe_kernels import grouped_experts

            out = grouped_experts(x, top_w, top_i, self.gate_up_proj, self.down_proj)
            if out is not None:
                return out
        return self.forward_loop(x, top_w, top_i)

    def forward_loop(self, x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        """The reference: loop over the experts that received tokens; each runs on its tokens only
        (reads the expert counts back to the host). Encoded experts (`ninfer_core.quant`) run each
        expert's rows through the dequantising linear."""
        out = torch.zeros_like(x)
        flat_i = top_i.reshape(-1)
        order = torch.argsort(flat_i, stable=True)
        counts = torch.bincount(flat_i, minlength=self.num_experts).tolist()
        token_of = order // top_i.shape[1]
        weight_of = top_w.reshape(-1)[order]
        start = 0
        for e, cnt in enumerate(counts):
            if cnt == 0:
                continue
            tok = token_of[start : start + cnt]
            w = weight_of[start : start + cnt]
            start += cnt
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, tok, (y * w[:, None]).to(out.dtype))
        return out


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_w, top_i = self.gate(x)
        routed = self.experts(x, top_w, top_i)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared
