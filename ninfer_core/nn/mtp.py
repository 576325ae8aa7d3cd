"""The multi-token-prediction head some hybrid checkpoints ship (`mtp.*`; transformers ignores it).

h = fc(cat[pre_fc_norm_embedding(embed(next_token)), pre_fc_norm_hidden(target_hidden)]) (2H -> H),
then `mtp_num_hidden_layers` full-attention decoder layers with their own KV, then `mtp.norm`;
the target's embed_tokens and lm_head are shared. `target_hidden` is the target model's last
hidden state (after its final norm, the input of lm_head) at the position before the token.

Not wired into serving yet: the MTP speculative backend will drive it through the family
contract. This reference forward keeps its KV as plain per-layer tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer_core.nn.attention import grouped_attention
from ninfer_core.nn.config import HybridConfig
from ninfer_core.nn.decoder import DecoderLayer
from ninfer_core.nn.layers import RotaryEmbedding, ZeroCenteredRMSNorm

KV = tuple[torch.Tensor, torch.Tensor]  # K, V: [T_past, kv_heads, head_dim]


class MtpHead(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        h = cfg.hidden_size
        n = max(cfg.mtp_num_hidden_layers, 1)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, cfg.num_hidden_layers + i, layer_type="full_attention") for i in range(n)
        )
        self.norm = ZeroCenteredRMSNorm(h, cfg.rms_norm_eps)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(
        self,
        embeds: torch.Tensor,
        target_hidden: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        past: list[KV] | None = None,
    ) -> tuple[torch.Tensor, list[KV]]:
        """One sequence: embeds, target_hidden [T, H] at positions [T] (contiguous, following
        the past). Returns (normed hidden [T, H], the KV of every MTP layer including `past`)."""
        x = self.fc(
            torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(target_hidden)], -1)
        )
        cos, sin = rotary.cos_sin(positions, x.dtype)
        present: list[KV] = []
        t = x.shape[0]
        for i, layer in enumerate(self.layers):
            attn_mod = layer.self_attn
            q, gate, k, v = attn_mod.project(layer.input_layernorm(x), cos, sin)
            if past is not None:
                k = torch.cat([past[i][0], k])
                v = torch.cat([past[i][1], v])
            present.append((k, v))
            n_past = k.shape[0] - t
            mask = torch.arange(k.shape[0], device=x.device)[None, :] <= (
                n_past + torch.arange(t, device=x.device)[:, None]
            )
            attn = grouped_attention(q[None], k[None], v[None], mask[None], attn_mod.scale)[0]
            x = x + attn_mod.finish(attn.to(x.dtype), gate)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x), present
