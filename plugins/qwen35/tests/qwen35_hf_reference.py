"""transformers models with an artifact's weights: the parity oracle (tests only)."""

from __future__ import annotations

import torch


def hf_causal_lm(artifact):
    """The transformers text-only CausalLM of a Qwen3.5 artifact, fp32, eager attention, eval."""
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    cfg = dict(artifact.config)
    text = dict(cfg.get("text_config") or cfg)
    text.pop("architectures", None)
    moe = "num_experts" in text
    text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    config_cls, model_cls = (
        (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM) if moe else (Qwen3_5TextConfig, Qwen3_5ForCausalLM)
    )
    text.pop("model_type", None)
    hf_cfg = config_cls(**text)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_cls(hf_cfg).eval()
    state = {}
    for name in artifact.tensor_names():
        if name.startswith(("mtp.", "model.visual.")):
            continue
        key = name.replace("model.language_model.", "model.", 1)
        state[key] = artifact.get_tensor(name).float()
    if hf_cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (hf_cfg.tie_word_embeddings and m == "lm_head.weight")]
    assert not missing and not unexpected, (missing, unexpected)
    if hf_cfg.tie_word_embeddings:
        model.tie_weights()
    return model


@torch.no_grad()
def hf_logits(model, tokens) -> torch.Tensor:
    """fp32 logits [T, vocab] of one full forward over `tokens`."""
    ids = torch.tensor([list(tokens)], dtype=torch.long)
    return model(input_ids=ids, use_cache=False).logits[0].float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())
