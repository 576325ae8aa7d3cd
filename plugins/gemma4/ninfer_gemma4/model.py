"""The Gemma 4 text model over a flattened batch of lanes (torch reference path).

Each decoder layer: x += post_attn_norm(attn(input_norm(x))); then the MLP branch
post_ff_norm(mlp(pre_ff_norm(x))), or with the MoE block post_ff_norm(post_ff_norm_1(mlp(...)) +
post_ff_norm_2(experts(pre_ff_norm_2(x)))) with the router reading x; then, with per-layer
embeddings (PLE), x += post_ple_norm(ple_proj(act(ple_gate(x)) * ple_row)); finally x *= layer_scalar.
Token embeddings are scaled by sqrt(hidden) (cast to the weight dtype, as transformers does); the
LM head is tied to them; logits are soft-capped: cap * tanh(logits / cap).
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer_gemma4 import layers
from ninfer_gemma4.attention import Attention, Context
from ninfer_gemma4.config import GLOBAL, SLIDING, Gemma4Config
from ninfer_gemma4.layers import MLP, Experts, RMSNorm, Router, act, inv_freq, rope_tables


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma4Config, i: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, i)
        self.mlp = MLP(h, cfg.mlp_width(i), cfg.hidden_activation)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.ple = cfg.hidden_size_per_layer_input
        self.activation = cfg.hidden_activation
        if self.ple:
            self.per_layer_input_gate = nn.Linear(h, self.ple, bias=False)
            self.per_layer_projection = nn.Linear(self.ple, h, bias=False)
            self.post_per_layer_input_norm = RMSNorm(h, eps)
        self.moe = cfg.enable_moe_block
        if self.moe:
            self.router = Router(cfg)
            self.experts = Experts(cfg)
            self.post_feedforward_layernorm_1 = RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, ple_row: torch.Tensor | None, ctx: Context) -> torch.Tensor:
        if layers._use_kernels(x):  # the residual adds fused with their norms (gpu/fused.py)
            return self._forward_fused(x, ple_row, ctx)
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ctx))
        residual = x
        y = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
            weights, index = self.router(residual)
            routed = self.experts(self.pre_feedforward_layernorm_2(residual), weights, index)
            y = self.post_feedforward_layernorm_1(y) + self.post_feedforward_layernorm_2(routed)
        x = residual + self.post_feedforward_layernorm(y)
        if self.ple:
            g = act(self.activation, self.per_layer_input_gate(x)) * ple_row
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


    def _forward_fused(self, x: torch.Tensor, ple_row: torch.Tensor | None, ctx: Context) -> torch.Tensor:
        """`forward` with (base + norm(y) * w) [* layer scalar] in one launch each; the same math."""
        from ninfer_gemma4.gpu.fused import add_rms_norm

        def post(base, y, norm, scale=None):
            return add_rms_norm(base, y, norm.weight, norm.eps, scale)

        x = post(x, self.self_attn(self.input_layernorm(x), ctx), self.post_attention_layernorm)
        residual = x
        y = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
            weights, index = self.router(residual)
            routed = self.experts(self.pre_feedforward_layernorm_2(residual), weights, index)
            y = post(self.post_feedforward_layernorm_2(routed), y, self.post_feedforward_layernorm_1)
        if not self.ple:
            return post(residual, y, self.post_feedforward_layernorm, self.layer_scalar)
        x = post(residual, y, self.post_feedforward_layernorm)
        g = act(self.activation, self.per_layer_input_gate(x)) * ple_row
        return post(x, self.per_layer_projection(g), self.post_per_layer_input_norm, self.layer_scalar)


class Gemma4TextModel(nn.Module):
    def __init__(self, cfg: Gemma4Config):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        p = cfg.hidden_size_per_layer_input
        if p:
            self.embed_tokens_per_layer = nn.Embedding(cfg.vocab_size_per_layer_input, cfg.num_hidden_layers * p)
            self.per_layer_model_projection = nn.Linear(h, cfg.num_hidden_layers * p, bias=False)
            self.per_layer_projection_norm = RMSNorm(p, cfg.rms_norm_eps)
        self.freqs: dict[str, torch.Tensor] = {}
        self._consts: dict = {}

    def init_rotary(self, device) -> None:
        cfg = self.cfg
        self.freqs = {SLIDING: inv_freq(cfg.rope[SLIDING], cfg.head_dim, device),
                      GLOBAL: inv_freq(cfg.rope[GLOBAL], cfg.global_head_dim, device)}

    def _const(self, value: float, like: torch.Tensor) -> torch.Tensor:
        """A scalar in `like`'s dtype on its device, made once: rounded to the dtype as transformers
        rounds its embedding scales, and no host copy inside a CUDA-Graph capture."""
        key = (value, like.dtype, like.device)
        t = self._consts.get(key)
        if t is None:
            t = self._consts[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
        return t

    def scaled_embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight
        return self.embed_tokens(ids) * self._const(self.cfg.hidden_size ** 0.5, w)

    def per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[N, layers, ple] = (norm(proj(x) / sqrt(hidden)) + table[ids] * sqrt(ple)) / sqrt(2)."""
        cfg = self.cfg
        n, p = ids.shape[0], cfg.hidden_size_per_layer_input
        w = self.embed_tokens_per_layer.weight
        table = self.embed_tokens_per_layer(ids) * self._const(p ** 0.5, w)
        proj = self.per_layer_model_projection(x) * (cfg.hidden_size ** -0.5)
        proj = self.per_layer_projection_norm(proj.reshape(n, cfg.num_hidden_layers, p))
        return (proj + table.reshape(n, cfg.num_hidden_layers, p)) * (2.0 ** -0.5)

    def forward(self, ids: torch.Tensor, ctx: Context, embeds: torch.Tensor | None = None,
                ple_ids: torch.Tensor | None = None, collect: tuple[int, ...] = ()):
        """Final-normed hidden [N, hidden]; `collect` layer outputs land in the returned dict."""
        if getattr(self, "_fused_step", False) and layers._use_kernels(self.norm.weight):
            from ninfer_gemma4.gpu import step

            if step.applies(self, ctx, self.norm.weight):  # the GPU path's fused forward (gpu/step.py)
                return step.forward(self, ids, ctx, embeds, ple_ids, collect)
        x = self.scaled_embed(ids) if embeds is None else embeds
        ple = self.per_layer_inputs(ids if ple_ids is None else ple_ids, x) if self.cfg.hidden_size_per_layer_input else None
        ctx.rope = {kind: rope_tables(f, ctx.positions, x.dtype) for kind, f in self.freqs.items()}
        outs = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, None if ple is None else ple[:, i], ctx)
            if i in collect:
                outs[i] = x
        return self.norm(x), outs

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if getattr(self, "_fused_step", False) and layers._use_kernels(hidden):
            from ninfer_gemma4.gpu import step

            if step.enabled():
                out = step.logits(self, hidden)
                if out is not None:
                    return out
        out = self.lm_head(hidden).float()
        cap = self.cfg.final_logit_softcapping
        if cap:
            out = torch.tanh(out / cap) * cap
        return out
