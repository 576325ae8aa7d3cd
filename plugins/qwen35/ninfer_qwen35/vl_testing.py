"""A small Qwen3.5 vision-language checkpoint with random weights, as transformers saves it.

`build_hf_vl_dir` writes config.json + model.safetensors (Qwen3_5ForConditionalGeneration's own
`save_pretrained`), a byte-level tokenizer.json carrying Qwen's control and vision tokens, and the
project's chat template; `ninfer convert` turns it into an artifact with the vision component.
Tests and the GPU check build their models from it (weights can never be downloaded here).
"""

from __future__ import annotations

import json
import os

from ninfer_qwen35.chat import QWEN35_TEMPLATE
from ninfer_qwen35.testing import tiny_text_config

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CONTROL = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<tool_call>", False),
           ("</tool_call>", False), ("<tool_response>", False), ("</tool_response>", False), ("<think>", False),
           ("</think>", False)] + [(t, True) for t in VISION_TOKENS]
TINY_VISION = {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "num_position_embeddings": 64}
SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest map above 255."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def tokenizer_json() -> dict:
    vocab = {c: i for i, c in enumerate(_byte_chars())}
    added = [{"id": 256 + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": s} for i, (t, s) in enumerate(CONTROL)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": SPLIT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def token_id(text: str) -> int:
    return 256 + [t for t, _ in CONTROL].index(text)


def hf_vl_config(vision: dict | None = None, num_layers: int = 4, hidden: int = 64):
    """transformers' Qwen3_5Config at a small shape, its token ids those of `tokenizer_json`."""
    import transformers as tr

    text = tiny_text_config("dense", 512, num_layers, hidden, False, mtp=False)
    text.pop("model_type")
    text["eos_token_id"] = token_id("<|im_end|>")
    v = dict(TINY_VISION, out_hidden_size=hidden, **(vision or {}))
    cfg = tr.Qwen3_5Config(text_config=text, vision_config=v, image_token_id=token_id("<|image_pad|>"),
                           video_token_id=token_id("<|video_pad|>"),
                           vision_start_token_id=token_id("<|vision_start|>"),
                           vision_end_token_id=token_id("<|vision_end|>"))
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    cfg.vision_config._attn_implementation = "eager"
    return cfg


def random_vl_model(seed: int = 0, std: float = 0.5, **kw):
    """Qwen3_5ForConditionalGeneration with random weights drawn so activations keep a spread
    (transformers' 0.02 init leaves a random model's logits nearly flat)."""
    import torch
    import transformers as tr

    torch.manual_seed(seed)
    model = tr.Qwen3_5ForConditionalGeneration(hf_vl_config(**kw)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")) and "visual" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or "pos_embed" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std / p[0].numel() ** 0.5)
    return model


def build_hf_vl_dir(root, seed: int = 0, **kw) -> str:
    """A saved Qwen3.5 VL checkpoint directory (random weights), ready for `ninfer convert`."""
    root = os.fspath(root)
    model = random_vl_model(seed, **kw)
    model.save_pretrained(root)
    with open(os.path.join(root, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_json(), f, ensure_ascii=False)
    with open(os.path.join(root, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, f)
    with open(os.path.join(root, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(QWEN35_TEMPLATE)
    return root


def build_vl_artifact(path, seed: int = 0, **kw) -> str:
    """`ninfer convert` of `build_hf_vl_dir` (the HF directory beside `path`, suffix .hf)."""
    from ninfer_core.artifact.convert import convert_hf_dir

    hf = build_hf_vl_dir(os.fspath(path) + ".hf", seed, **kw)
    convert_hf_dir(hf, os.fspath(path))
    return os.fspath(path)
