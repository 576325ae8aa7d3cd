"""Tiny random-weight Flash-Next checkpoints for tests: the real structure at shrunk widths.

`tiny_config()` keeps the published model's pattern (3 GDN : 1 indexed full attention, 4
hyper-connection streams, one PLE layer, a top-k MoE with a shared expert) with small widths, a
small n-gram vocabulary and an indexer budget of 8 keys in blocks of 4 (dense up to 11 keys), so
short prompts cross the sparse threshold. `hf_model` draws weights with transformers' own
`Qwen4ExpForCausalLM`; `write_hf_checkpoint` saves a Hugging Face directory (with a byte-level
tokenizer carrying the chat format's control tokens); `build_tiny_artifact` converts one with `ninfer convert`.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

EOS_ID = 258  # <|im_end|> in the byte-level tokenizer (256 + 2)

# The control and marker tokens of the chat format (chat.py), so its template renders with the
# byte-level tokenizer: ids 256.. in this order.
_MINIMAL_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<tool_call>", False), ("</tool_call>", False), ("<tool_response>", False),
    ("</tool_response>", False), ("<think>", False), ("</think>", False),
]  # fmt: skip
_MINIMAL_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def minimal_tokenizer_section() -> dict:
    """A byte-level tokenizer section: 256 byte tokens, then the chat format's control tokens (ids 256..)."""
    ranks = "\n".join(f"{base64.b64encode(bytes([i])).decode()} {i}" for i in range(256)) + "\n"
    added = [{"id": 256 + i, "content": c, "special": s} for i, (c, s) in enumerate(_MINIMAL_ADDED)]
    return {"type": "bpe", "ranks": ranks, "pattern": _MINIMAL_PATTERN, "added_tokens": added,
            "eos_tokens": ["<|im_end|>", "<|endoftext|>"], "pad_token": "<|endoftext|>", "bos_token": None}


def tiny_config(num_layers: int = 4, vocab_size: int = 512, mtp: bool = False, **over) -> dict:
    cfg = {
        "model_type": "qwen4_exp_text", "architectures": ["Qwen4ExpForCausalLM"],
        "vocab_size": vocab_size, "hidden_size": 64, "num_hidden_layers": num_layers,
        "layer_types": ["indexed_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": True,
        "hc_count": 4, "hc_lowrank": 16,
        "ple_layer_ids": [2], "ple_embed_dim": 32, "ngram_size": 3, "heads_per_ngram": 4,
        "ngram_vocab_size_base": 101, "make_ngram_vocab_size_divisible_by": 8, "split_ngram_parts": 4,
        "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
        "indexer_budget": 8, "indexer_compress_ratio": 4,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "hidden_act": "silu",
        "eos_token_id": EOS_ID, "pad_token_id": 256, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    }  # fmt: skip
    if mtp:
        cfg["mtp_num_hidden_layers"] = 1
    cfg.update(over)
    return cfg


def hf_model(config: dict, seed: int = 0):
    """transformers' Qwen4ExpForCausalLM of `config`, random weights (fp32, eager attention).

    Norm weights, the PLE convolution and the n-gram rows are drawn too (transformers initialises
    them to zeros or tiny values, which would hide a weight the reference forgets to apply)."""
    import math

    import torch
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    torch.manual_seed(seed)
    keep = {"model_type", "architectures", "mtp_num_hidden_layers"}
    cfg = Qwen4ExpTextConfig(**{k: v for k, v in config.items() if k not in keep})
    cfg._attn_implementation = "eager"
    model = Qwen4ExpForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "norm" in name.rsplit(".", 2)[-2]:
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith(("A_log", "dt_bias")):
                continue
            elif "ngram_embedding" in name or name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0)
            elif name.endswith("lm_head.weight"):
                p.normal_(0.0, 2.0 / math.sqrt(p.shape[-1]))
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    return model.eval()


def tokenizer_json() -> dict:
    """A byte-level BPE tokenizer.json (no merges) with the Qwen control tokens at ids 256.."""
    from ninfer_core.tokenizer.hf import bytes_to_unicode

    chars = bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    added = [{"id": 256 + i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": s} for i, (c, s) in enumerate(_MINIMAL_ADDED)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _MINIMAL_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }  # fmt: skip


def write_hf_checkpoint(path, seed: int = 0, mtp: bool = False, **over) -> Path:
    """A Hugging Face directory: config.json, model.safetensors (+ mtp.* when asked), tokenizer files."""
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(mtp=mtp, **over)
    model = hf_model(config, seed=seed)
    model.save_pretrained(path, safe_serialization=True)
    if mtp:  # transformers has no MTP module for qwen4_exp: the block is Qwen3.5-MoE's MTP layout
        from ninfer_core.nn.testing import decoder_layer_shapes, random_tensor

        weights = load_file(path / "model.safetensors")
        h = config["hidden_size"]
        shapes = decoder_layer_shapes(config, "mtp.layers.0.", "full_attention")
        shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,),
                       "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,)})
        for name, shape in shapes.items():
            weights[name] = random_tensor(name, shape, seed).contiguous()
        save_file({k: v.contiguous() for k, v in weights.items()}, path / "model.safetensors",
                  metadata={"format": "pt"})
        del torch
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json(), ensure_ascii=False))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS_ID, 256]}))
    return path


def build_tiny_artifact(out, seed: int = 0, mtp: bool = False, **over) -> str:
    """Write a random HF checkpoint next to `out` and convert it (as `ninfer convert` does)."""
    import tempfile

    from ninfer_core.artifact.convert import convert_hf_dir
    from ninfer_core.cli import _convert_check

    out = os.fspath(out)
    if os.path.exists(out):
        return out
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(out))) as tmp:
        hf = write_hf_checkpoint(Path(tmp) / "flash-next", seed=seed, mtp=mtp, **over)
        convert_hf_dir(hf, out, name="flash-next-tiny", check_manifest=_convert_check)
    return out


def hf_from_artifact(artifact):
    """transformers' model with an artifact's weights (the parity oracle; tests only)."""
    import torch
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    config = dict(artifact.config.get("text_config") or artifact.config)
    keep = {"model_type", "architectures", "mtp_num_hidden_layers", "transformers_version", "dtype"}
    cfg = Qwen4ExpTextConfig(**{k: v for k, v in config.items() if k not in keep})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(cfg).eval()
    state = {}
    for name in artifact.tensor_names():
        if name.startswith("mtp."):
            continue
        state[name] = artifact.get_tensor(name).clone()
    sd = model.state_dict()
    # transformers loads the n-gram table shards concatenated and per-expert weights fused
    fused = {}
    for key in list(state):
        if ".ngram_embedding.shard_" in key:
            base = key.split(".shard_")[0] + ".weight"
            fused.setdefault(base, []).append((int(key.split(".shard_")[1].split(".")[0]), state.pop(key)))
    for base, parts in fused.items():
        state[base] = torch.cat([t for _, t in sorted(parts)])
    from ninfer_core.nn.loading import fuse_experts

    state = fuse_experts(state)
    missing = set(sd) - set(state)
    unexpected = set(state) - set(sd)
    assert not missing and not unexpected, (sorted(missing)[:5], sorted(unexpected)[:5])
    model.load_state_dict(state, strict=True)
    return model
