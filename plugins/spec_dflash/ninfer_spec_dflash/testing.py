"""Random drafter checkpoints in the published layout (config.json + model.safetensors), for tests,
the bench and the GPU check: `ninfer convert SRC OUT --dflash DIR` reads them like a real one."""

from __future__ import annotations

import json
import os

import torch

from ninfer_spec_dflash.config import DrafterConfig, tensor_shapes


def drafter_hf_config(kind: str, hidden: int, vocab_size: int, target_layers, *, layers: int = 1, heads: int = 4,
                      kv_heads: int = 2, head_dim: int | None = None, intermediate: int | None = None,
                      block_size: int = 16, mask_token_id: int | None = None, num_target_layers: int | None = None,
                      selector_rank: int = 8, selector_top_k: int = 4, conv_group_size: int = 16) -> dict:
    """A drafter config.json in the z-lab layout (a Qwen3 decoder config plus dflash_config)."""
    cfg = {
        "architectures": ["DFlash2DraftModel" if kind == "dflash2" else "DFlashDraftModel"],
        "model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim or hidden // heads,
        "intermediate_size": intermediate or 2 * hidden, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "attention_bias": False, "vocab_size": vocab_size, "block_size": block_size,
        "num_target_layers": num_target_layers or (max(target_layers) + 1), "tie_word_embeddings": False,
        "dflash_config": {"mask_token_id": vocab_size - 1 if mask_token_id is None else mask_token_id,
                          "target_layer_ids": list(target_layers)},
    }  # fmt: skip
    if kind == "dflash2":
        cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=conv_group_size,
                                    selector_rank=selector_rank, selector_top_k=selector_top_k)
    return cfg


def random_tensors(cfg: DrafterConfig, vocab_size: int, seed: int = 0, scale: float = 0.08) -> dict:
    """Random weights of every checkpoint tensor (norm weights near 1, selector codebooks larger)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in tensor_shapes(cfg, vocab_size).items():
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif "codebook" in name:
            out[name] = torch.randn(shape, generator=g)
        else:
            out[name] = scale * torch.randn(shape, generator=g)
    return out


def write_drafter_checkpoint(path, config: dict, tensors: dict, dtype=torch.float32, prefix: str = "") -> str:
    """Write `config.json` and `model.safetensors` (names prefixed by `prefix`) into directory `path`."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    save_file({prefix + k: v.to(dtype).contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return os.fspath(path)


def random_drafter_checkpoint(path, kind: str, hidden: int, vocab_size: int, target_layers, seed: int = 0,
                              **kw) -> str:
    """A random drafter checkpoint directory for a target of width `hidden`."""
    config = drafter_hf_config(kind, hidden, vocab_size, target_layers, **kw)
    cfg = DrafterConfig.from_hf(config, kind)
    return write_drafter_checkpoint(path, config, random_tensors(cfg, vocab_size, seed))
