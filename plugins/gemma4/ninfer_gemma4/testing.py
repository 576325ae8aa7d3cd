"""Random-weight Gemma 4 checkpoints for tests: the real models' layer patterns at shrunk widths.

`shrunk_config(kind)` keeps each published model's structure -- the sliding/global mix, K=V global
layers, KV-shared layers, double-wide MLPs, per-layer embeddings (PLE), the MoE block, the logit
softcap -- with small widths, few layers and a short window (so chunks of 7 cross it);
`write_hf_checkpoint` draws the weights with transformers and saves a Hugging Face directory with a
Gemma-4-format tokenizer and chat template; `build_tiny_artifact` converts one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

S, G = "sliding_attention", "full_attention"

# Structural settings of the published checkpoints (google/gemma-4-*): layer pattern period, KV
# sharing, PLE, MoE and the attention geometry ratios. Widths are shrunk by `shrunk_config`.
REAL = {
    "e2b": {"num_hidden_layers": 35, "period": 5, "num_kv_shared_layers": 20, "hidden_size_per_layer_input": 256,
            "use_double_wide_mlp": True, "attention_k_eq_v": False, "hidden_size": 1536, "sliding_window": 512},
    "e4b": {"num_hidden_layers": 42, "period": 6, "num_kv_shared_layers": 18, "hidden_size_per_layer_input": 256,
            "use_double_wide_mlp": False, "attention_k_eq_v": False, "hidden_size": 2560, "sliding_window": 512},
    "26b-a4b": {"num_hidden_layers": 30, "period": 6, "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0,
                "attention_k_eq_v": True, "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8,
                "hidden_size": 2816, "sliding_window": 1024},
    "31b": {"num_hidden_layers": 60, "period": 6, "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0,
            "attention_k_eq_v": True, "hidden_size": 5376, "sliding_window": 1024},
}
KINDS = tuple(REAL)


def layer_pattern(n: int, period: int) -> list[str]:
    return [S if (i + 1) % period else G for i in range(n)]


# the test tokenizer's media tokens (ninfer_gemma4.test_tokenizer.CONTROL)
MEDIA_TOKENS = {"image_token_id": 107, "boi_token_id": 108, "eoi_token_id": 109, "video_token_id": 110}


def shrunk_vision_config(**over) -> dict:
    """A Gemma 4 vision_config at test size with the published tower's structure (bidirectional
    blocks, axial RoPE, 3x3 pooling, standardization); the KV heads grouped to exercise GQA."""
    cfg = {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "patch_size": 16,
           "pooling_kernel_size": 3, "position_embedding_size": 128, "rms_norm_eps": 1e-6,
           "hidden_activation": "gelu_pytorch_tanh", "standardize": True, "use_clipped_linears": False,
           "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0}}
    cfg.update(over)
    return cfg


def shrunk_config(kind: str, vocab_size: int = 512, num_layers: int | None = None, window: int = 8,
                  multimodal: bool = True, vision: dict | None = None, bidirectional_vision: bool = False) -> dict:
    """A config.json dict of `kind` at test size (model_type gemma4 with text_config, or gemma4_text);
    `vision`: a vision_config (shrunk_vision_config) for a vision-language checkpoint, whose text
    model reads a media item's rows bidirectionally with `bidirectional_vision` (the 31B's
    use_bidirectional_attention "vision")."""
    real = REAL[kind]
    period = real["period"]
    n = num_layers or (2 * period if not real["num_kv_shared_layers"] else 3 * period)
    shared = 0
    if real["num_kv_shared_layers"]:  # the same fraction of shared layers as the real model, at least 2
        shared = max(2, round(n * real["num_kv_shared_layers"] / real["num_hidden_layers"]))
        shared = min(shared, n - period)  # every layer type keeps a producer before the shared tail
    text = {
        "model_type": "gemma4_text", "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": n, "num_attention_heads": 4,
        "num_key_value_heads": 2 if real["attention_k_eq_v"] else 1, "head_dim": 16,
        "global_head_dim": 32, "num_global_key_value_heads": 1,
        "attention_k_eq_v": real["attention_k_eq_v"], "sliding_window": window,
        "layer_types": layer_pattern(n, period), "num_kv_shared_layers": shared,
        "use_double_wide_mlp": real.get("use_double_wide_mlp", False),
        "hidden_size_per_layer_input": 8 if real["hidden_size_per_layer_input"] else 0,
        "vocab_size_per_layer_input": vocab_size,
        "final_logit_softcapping": 30.0, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_parameters": {S: {"rope_type": "default", "rope_theta": 10000.0},
                            G: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}},
        "pad_token_id": 0, "eos_token_id": [1, 106, 50], "bos_token_id": 2, "tie_word_embeddings": True,
        "enable_moe_block": bool(real.get("enable_moe_block")),
    }
    if bidirectional_vision:
        text["use_bidirectional_attention"] = "vision"
    if real.get("enable_moe_block"):
        text.update(num_experts=8, top_k_experts=2, moe_intermediate_size=32)
    if not multimodal:
        return text
    out = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text,
           "vision_config": vision, "audio_config": None, "tie_word_embeddings": True,
           "eos_token_id": [1, 106, 50], "pad_token_id": 0, "bos_token_id": 2}
    if vision is not None:
        out.update(MEDIA_TOKENS)
    return out


def hf_model(config: dict, seed: int = 0, std: float = 0.05, device=None):
    """transformers' Gemma 4 model of `config` with random weights (fp32, eager attention), built
    and drawn on `device` (the GPU tests: drawing billions of weights on the CPU took minutes).

    The norm weights and layer scalars are drawn too (transformers initialises them to ones, which
    would hide a weight the reference forgets to apply)."""
    import contextlib

    import torch

    torch.manual_seed(seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return _hf_model(config, std)


def _hf_model(config: dict, std: float):
    import torch
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    if config["model_type"] == "gemma4":
        cfg = Gemma4Config(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
        cfg._attn_implementation = "eager"
        cfg.text_config._attn_implementation = "eager"
        model = Gemma4ForConditionalGeneration(cfg)
    else:
        cfg = Gemma4TextConfig(**{k: v for k, v in config.items() if k != "model_type"})
        cfg._attn_implementation = "eager"
        model = Gemma4ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
            elif name.endswith("std_bias"):  # the vision standardization (uninitialised by transformers)
                b.normal_(0.0, 0.5)
            elif name.endswith("std_scale"):
                b.copy_(1.0 + 0.2 * torch.randn_like(b))
            elif name.endswith(("input_min", "output_min")):  # finite clip bounds, so clipping shows
                b.fill_(-0.5)
            elif name.endswith(("input_max", "output_max")):
                b.fill_(0.5)
    return model.eval()


def temper_attention(model) -> None:
    """Scale the q_norm / k_norm weights of a random model by head_dim^-1/4, so attention scores
    (Gemma 4 uses softmax scale 1, the norms set the logit size) have a spread of order one, as in
    a trained model. With norm weights near 1 the scores of a 256-wide head spread by ~16, softmax
    is one-hot and a bf16 rounding of q or k flips it: transformers' own bf16 model then differs
    from its fp32 model by more than its logits' size, and no bf16 comparison means anything."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(p.shape[0] ** -0.25)


def write_hf_checkpoint(path, kind: str = "e2b", seed: int = 0, **shrink) -> Path:
    """A Hugging Face directory: config.json, model.safetensors, tokenizer files, chat template."""
    from ninfer_gemma4.test_tokenizer import write_tokenizer_files

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = shrunk_config(kind, **shrink)
    model = hf_model(config, seed=seed)
    model.save_pretrained(path, safe_serialization=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))  # the published layout, as written
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 2, "eos_token_id": [1, 106, 50], "pad_token_id": 0,
         "temperature": 1.0, "top_p": 0.95, "top_k": 64}))
    write_tokenizer_files(path)
    return path


def build_tiny_artifact(out, kind: str = "e2b", seed: int = 0, **shrink) -> str:
    """Write a random HF checkpoint of `kind` next to `out` and convert it; returns the artifact path."""
    import tempfile

    from ninfer_core.artifact.convert import convert_hf_dir
    from ninfer_core.cli import _convert_check

    out = os.fspath(out)
    if os.path.exists(out):
        return out
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(out))) as tmp:
        hf = write_hf_checkpoint(Path(tmp) / kind, kind=kind, seed=seed, **shrink)
        convert_hf_dir(hf, out, name=f"gemma4-{kind}-tiny", check_manifest=_convert_check)
    return out
