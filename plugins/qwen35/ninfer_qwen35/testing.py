"""Tiny random-weight Qwen3.5 artifacts for tests (this plugin's, the engine's, the server's).

The real layer pattern (3 Gated DeltaNet : 1 full attention) and the real checkpoint names, with
shrunk widths. Weights are drawn per tensor from a generator seeded by (seed, tensor name), so an
artifact is the same bytes on every build and tensors can be produced one at a time while the
writer streams them. Scales keep activations O(1) and logits spread (not near-uniform).
"""

from __future__ import annotations

import base64
import os

import torch

from ninfer_core.nn.testing import decoder_layer_shapes, random_tensor

# Qwen control and marker tokens, so the project's chat template renders with the small tokenizer.
_MINIMAL_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<tool_call>", False), ("</tool_call>", False), ("<tool_response>", False),
    ("</tool_response>", False), ("<think>", False), ("</think>", False),
]  # fmt: skip
_MINIMAL_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def minimal_tokenizer_section() -> dict:
    """A byte-level tokenizer section: 256 byte tokens, then the Qwen control tokens (ids 256..)."""
    ranks = "\n".join(f"{base64.b64encode(bytes([i])).decode()} {i}" for i in range(256)) + "\n"
    added = [{"id": 256 + i, "content": c, "special": s} for i, (c, s) in enumerate(_MINIMAL_ADDED)]
    return {
        "type": "bpe",
        "ranks": ranks,
        "pattern": _MINIMAL_PATTERN,
        "added_tokens": added,
        "eos_tokens": ["<|im_end|>", "<|endoftext|>"],
        "pad_token": "<|endoftext|>",
        "bos_token": None,
    }


def section_vocab_size(section: dict) -> int:
    """Max token id + 1 over the section's BPE ranks and added tokens."""
    top = -1
    for line in section.get("ranks", "").splitlines():
        parts = line.split()
        if len(parts) == 2:
            top = max(top, int(parts[1]))
    for t in section.get("added_tokens") or []:
        top = max(top, int(t["id"]))
    return top + 1


def tiny_text_config(
    kind: str = "dense",
    vocab_size: int = 512,
    num_layers: int = 4,
    hidden: int = 64,
    tie_word_embeddings: bool = False,
    mtp: bool = True,
) -> dict:
    """An HF text config (the `text_config` of Qwen3_5(Moe)Config) with shrunk widths."""
    if kind not in ("dense", "moe"):
        raise ValueError(f"kind must be 'dense' or 'moe', not {kind!r}")
    cfg = {
        "model_type": "qwen3_5_text" if kind == "dense" else "qwen3_5_moe_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)
        ],
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": 32768,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "tie_word_embeddings": tie_word_embeddings,
    }
    if mtp:
        cfg.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    if kind == "dense":
        cfg["intermediate_size"] = 2 * hidden
    else:
        cfg.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            router_aux_loss_coef=0.001,
        )
    return cfg


def tiny_tensor_shapes(cfg: dict, text_prefix: str = "model.language_model.") -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes of a text config (plus `mtp.*` when it has an MTP head)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    shapes = {f"{text_prefix}embed_tokens.weight": (v, h)}
    for i, lt in enumerate(cfg["layer_types"]):
        shapes.update(decoder_layer_shapes(cfg, f"{text_prefix}layers.{i}.", lt))
    shapes[f"{text_prefix}norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    for j in range(cfg.get("mtp_num_hidden_layers", 0) or 0):
        shapes.update(decoder_layer_shapes(cfg, f"mtp.layers.{j}.", "full_attention"))
    if cfg.get("mtp_num_hidden_layers"):
        shapes.update(
            {
                "mtp.fc.weight": (h, 2 * h),
                "mtp.norm.weight": (h,),
                "mtp.pre_fc_norm_embedding.weight": (h,),
                "mtp.pre_fc_norm_hidden.weight": (h,),
            }
        )
    return shapes


def build_tiny_artifact(
    path,
    kind: str = "dense",
    seed: int = 0,
    tokenizer_section: dict | None = None,
    vocab_size: int | None = None,
    *,
    num_layers: int = 4,
    hidden: int = 64,
    layout: str = "nested",
    expert_layout: str = "fused",
    tie_word_embeddings: bool = False,
    mtp: bool = True,
    dtype: torch.dtype = torch.float32,
    name: str | None = None,
    chat_template: str | None | bool = True,
) -> str:
    """Write a tiny random Qwen3.5 artifact at `path`; returns the path.

    kind "dense" | "moe"; layout "nested" (Qwen3_5ForConditionalGeneration names and config,
    like the published checkpoints) or "flat" (text-only CausalLM); expert_layout "fused" or
    "per_expert" (MoE weights as `experts.N.gate_proj.weight` ...). Without a tokenizer section a
    byte-level one is used (vocab 512). vocab_size defaults to the tokenizer's size rounded up to
    a multiple of 256 (248320 for the real Qwen3.5 tokenizer). chat_template True = the project's
    Qwen3.5 template.
    """
    from ninfer_core.artifact import TensorSpec, write_artifact

    section = tokenizer_section if tokenizer_section is not None else minimal_tokenizer_section()
    tok_vocab = section_vocab_size(section)
    if vocab_size is None:
        vocab_size = max(512, -(-tok_vocab // 256) * 256)
    if vocab_size < tok_vocab:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tok_vocab}")
    text_cfg = tiny_text_config(kind, vocab_size, num_layers, hidden, tie_word_embeddings, mtp)
    by_text = {t["content"]: t["id"] for t in section.get("added_tokens") or []}
    eos_ids = [by_text[e] for e in section.get("eos_tokens") or [] if e in by_text]
    if eos_ids:
        text_cfg["eos_token_id"] = eos_ids[0]
    moe = kind == "moe"
    if layout == "nested":
        arch = "qwen3_5_moe" if moe else "qwen3_5"
        config = {
            "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
            "model_type": arch,
            "text_config": text_cfg,
            "tie_word_embeddings": tie_word_embeddings,
            "image_token_id": 248056, "video_token_id": 248057,
            "vision_start_token_id": 248053, "vision_end_token_id": 248054,
        }  # fmt: skip
        prefix = "model.language_model."
    elif layout == "flat":
        arch = text_cfg["model_type"]
        config = dict(text_cfg, architectures=["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"])
        prefix = "model."
    else:
        raise ValueError(f"layout must be 'nested' or 'flat', not {layout!r}")

    specs = []
    for tname, shape in tiny_tensor_shapes(text_cfg, prefix).items():
        if expert_layout == "per_expert" and tname.endswith(("experts.gate_up_proj", "experts.down_proj")):
            specs.extend(_per_expert_specs(tname, shape, seed, dtype))
            continue
        specs.append(TensorSpec(tname, dtype, shape, _loader(tname, shape, seed, dtype, tie_word_embeddings)))

    if chat_template is True:
        chat_template = _project_template()
    name = name or f"tiny-qwen35-{kind}"
    manifest = {
        "name": name,
        "architecture": arch,
        "config": config,
        "tokenizer": section,
        "chat_template": chat_template or None,
        "identity": {"model_id": name},
        "generation": {},
    }
    path = os.fspath(path)
    write_artifact(path, manifest, specs)
    return path


def _loader(name, shape, seed, dtype, tied):
    return lambda: random_tensor(name, shape, seed, dtype, tied=tied)


def _per_expert_specs(name: str, shape: tuple[int, ...], seed: int, dtype):
    """Split a fused expert tensor into HF's per-expert names (same values as the fused one)."""
    from ninfer_core.artifact import TensorSpec

    base = name.rsplit(".", 1)[0]  # ...mlp.experts
    e = shape[0]
    specs = []
    if name.endswith("gate_up_proj"):
        i2, h = shape[1], shape[2]
        for k in range(e):
            specs.append(
                TensorSpec(
                    f"{base}.{k}.gate_proj.weight",
                    dtype,
                    (i2 // 2, h),
                    lambda k=k: random_tensor(name, shape, seed, dtype)[k, : i2 // 2].contiguous(),
                )
            )
            specs.append(
                TensorSpec(
                    f"{base}.{k}.up_proj.weight",
                    dtype,
                    (i2 // 2, h),
                    lambda k=k: random_tensor(name, shape, seed, dtype)[k, i2 // 2 :].contiguous(),
                )
            )
    else:
        for k in range(e):
            specs.append(
                TensorSpec(
                    f"{base}.{k}.down_proj.weight",
                    dtype,
                    tuple(shape[1:]),
                    lambda k=k: random_tensor(name, shape, seed, dtype)[k].contiguous(),
                )
            )
    return specs


def _project_template() -> str | None:
    try:
        from ninfer_qwen35.chat import QWEN35_TEMPLATE
    except ImportError:  # the tokenizer package not installed yet: artifacts work without a template
        return None
    return QWEN35_TEMPLATE
