"""Named model shapes for `ninfer bench`: Hugging Face configs of the public Qwen3.5 models
(weights are drawn at random at these shapes; nothing is downloaded). Registered through
`ninfer_register_bench_shapes` (ninfer_qwen35.plugin); qwen3.5-9b is the default shape."""

from __future__ import annotations

_ROPE = {
    "rope_type": "default",
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}


def _dense(hidden, layers, heads, kv_heads, inter, lin_k, lin_v):
    return {
        "model_type": "qwen3_5",
        "vocab_size": 248320,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "full_attention_interval": 4,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": 256,
        "linear_num_key_heads": lin_k,
        "linear_num_value_heads": lin_v,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "max_position_embeddings": 262144,
        "rope_parameters": dict(_ROPE),
        "tie_word_embeddings": False,
        "eos_token_id": 248046,
    }


def _moe():
    cfg = _dense(2048, 40, 16, 2, 0, 16, 32)
    cfg.pop("intermediate_size")
    cfg.update(model_type="qwen3_5_moe", num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
               shared_expert_intermediate_size=512)
    return cfg


SHAPES = {
    "qwen3.5-9b": _dense(4096, 32, 16, 4, 12288, 16, 32),
    "qwen3.5-27b": _dense(5120, 64, 24, 4, 17408, 16, 48),
    "qwen3.5-35b-a3b": _moe(),
}

QWEN35_9B = SHAPES["qwen3.5-9b"]
QWEN35_27B = SHAPES["qwen3.5-27b"]
QWEN35_35B_A3B = SHAPES["qwen3.5-35b-a3b"]
