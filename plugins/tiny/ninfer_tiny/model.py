"""The training module: transformers' Qwen3_5ForCausalLM plus the MTP head, under checkpoint names.

The main model is transformers' text-only Qwen3.5 (Gated DeltaNet and gated full-attention
layers in the 3:1 pattern, zero-centred RMSNorms, partial interleaved-mrope RoPE), always on
transformers' torch Gated DeltaNet path: `use_torch_gdn` undoes transformers' choice of
flash-linear-attention (fla) or causal-conv1d kernels when those are installed (fla 0.6.0 refuses
its backward on Hopper with Triton 3.6, and the torch path is the one the tests check).

The MTP head follows `ninfer_core.nn.mtp`: at position t it reads the main model's final-normed
hidden state h[t] and the embedding of token x[t+1], h' = fc(cat[pre_fc_norm_embedding(embed(x[t+1])), pre_fc_norm_hidden(h[t])]), one
full-attention decoder layer at position t+1, `mtp.norm`, then the shared lm_head, and is
trained to predict x[t+2]. Parameter names are the checkpoint's (`model.*`, `lm_head.weight`
when untied, `mtp.*`), so the state dict is written to the artifact as it is.
"""

from __future__ import annotations

import inspect
import sys

import torch
import torch.nn.functional as F
from torch import nn

# transformers' torch implementations of the Gated DeltaNet pieces, by their module-level names
_TORCH_GDN_FUNCS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                    "torch_causal_conv1d_update", "causal_conv1d_fn", "causal_conv1d_update")


def text_config(
    vocab_size: int, *, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
    lin_key_heads: int, lin_value_heads: int, lin_head_dim: int, intermediate: int, eos_token_id: int,
) -> dict:
    """A Qwen3.5 text config (the real keys and RoPE settings) with the given widths."""
    from ninfer_qwen35.testing import tiny_text_config

    if layers % 4:
        raise ValueError("layers must be a multiple of 4 (3 Gated DeltaNet : 1 full attention)")
    cfg = tiny_text_config("dense", vocab_size, layers, hidden, tie_word_embeddings=True, mtp=True)
    cfg.update(
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        linear_num_key_heads=lin_key_heads, linear_num_value_heads=lin_value_heads,
        linear_key_head_dim=lin_head_dim, linear_value_head_dim=lin_head_dim,
        intermediate_size=intermediate, eos_token_id=eos_token_id, max_position_embeddings=32768,
    )  # fmt: skip
    return cfg


def _hf_config(cfg: dict):
    from transformers import Qwen3_5TextConfig

    text = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
    hf = Qwen3_5TextConfig(**text)
    hf._attn_implementation = "sdpa"
    return hf


def use_torch_gdn(model: nn.Module) -> int:
    """Make every Gated DeltaNet layer of `model` run transformers' torch path; returns the count.

    Two shapes of transformers are handled. Recent versions wrap the torch functions of the
    modeling module at import time so that they call fla / causal-conv1d when importable; the
    wrappers keep the torch function as `__wrapped__`, and the module globals are set back to it
    (process-wide: the torch path computes the same function, only slower). Older versions pick per
    layer (`layer.chunk_gated_delta_rule = fla or torch`, `causal_conv1d_fn`, a fused
    `FusedRMSNormGated`); those attributes are set to the torch versions and a fused norm is
    replaced by transformers' own gated RMSNorm with the same weight.
    """
    count = 0
    for layer in model.modules():
        if not type(layer).__name__.endswith("GatedDeltaNet"):
            continue
        count += 1
        mod = sys.modules[type(layer).__module__]
        for name in _TORCH_GDN_FUNCS:
            fn = getattr(mod, name, None)
            base = inspect.unwrap(fn) if callable(fn) else None
            if base is not None and base is not fn and getattr(base, "__module__", None) == mod.__name__:
                setattr(mod, name, base)
        for attr, torch_name in (("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"),
                                 ("recurrent_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
                                 ("causal_conv1d_update", "torch_causal_conv1d_update")):
            if attr in vars(layer) and hasattr(mod, torch_name):
                setattr(layer, attr, getattr(mod, torch_name))
        if "causal_conv1d_fn" in vars(layer):
            layer.causal_conv1d_fn = None  # None selects the nn.Conv1d path
        norm_cls = next((c for n, c in vars(mod).items() if n.endswith("RMSNormGated") and isinstance(c, type)
                         and c.__module__ == mod.__name__), None)  # transformers' own, not fla's  # fmt: skip
        norm = getattr(layer, "norm", None)
        if norm_cls is not None and norm is not None and not isinstance(norm, norm_cls):
            eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6))
            torch_norm = norm_cls(norm.weight.shape[0], eps=eps)
            with torch.no_grad():
                torch_norm.weight.copy_(norm.weight)
            layer.norm = torch_norm.to(norm.weight.device)
    return count


class MtpHead(nn.Module):
    def __init__(self, hf_cfg):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        h = hf_cfg.hidden_size
        full = hf_cfg.layer_types.index("full_attention")
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=hf_cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=hf_cfg.rms_norm_eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(hf_cfg, full)])
        self.norm = Qwen3_5RMSNorm(h, eps=hf_cfg.rms_norm_eps)


class TinyQwen(nn.Module):
    """Qwen3_5ForCausalLM (`model.*`, tied lm_head) + `mtp.*`; forward returns the losses."""

    def __init__(self, cfg: dict, seed: int = 0):
        super().__init__()
        from transformers import Qwen3_5ForCausalLM

        self.cfg = cfg
        hf = _hf_config(cfg)
        torch.manual_seed(seed)
        lm = Qwen3_5ForCausalLM(hf)
        # registered under the checkpoint's names: model.*, lm_head.*, mtp.*
        self.model, self.lm_head = lm.model, lm.lm_head
        use_torch_gdn(self.model)
        self.mtp = MtpHead(hf)
        if cfg.get("tie_word_embeddings"):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids: torch.Tensor, mtp_weight: float = 0.3):
        """ids [B, T]. Returns (total loss, main next-token loss, MTP next-next-token loss)."""
        hidden = self.model(input_ids=ids, use_cache=False).last_hidden_state  # [B, T, H], final-normed
        logits = self.lm_head(hidden[:, :-1]).float()
        main = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        mtp_hidden = self.mtp_hidden(ids[:, 1:], hidden[:, :-1], start=1)
        mlogits = self.lm_head(mtp_hidden[:, :-1]).float()
        mtp = F.cross_entropy(mlogits.reshape(-1, mlogits.shape[-1]), ids[:, 2:].reshape(-1))
        return main + mtp_weight * mtp, main, mtp

    def mtp_hidden(self, next_ids: torch.Tensor, target_hidden: torch.Tensor, start: int) -> torch.Tensor:
        """MTP hidden [B, T, H] for tokens next_ids [B, T] at positions start.., target_hidden [B, T, H]."""
        b, t = next_ids.shape
        m = self.mtp
        x = m.fc(torch.cat([m.pre_fc_norm_embedding(self.model.embed_tokens(next_ids)),
                            m.pre_fc_norm_hidden(target_hidden)], -1))  # fmt: skip
        pos = torch.arange(start, start + t, device=next_ids.device).view(1, 1, -1).expand(3, b, -1)
        pe = self.model.rotary_emb(x, pos)
        for layer in m.layers:
            x = layer(x, position_embeddings=pe, attention_mask=None)
        return m.norm(x)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The artifact's tensors: checkpoint names, the tied lm_head left out."""
        state = {k: v for k, v in self.state_dict().items()}
        if self.cfg.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        return state



def count_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied head counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
