"""Named Gemma 4 shapes for `ninfer bench` (random weights at these shapes; nothing is downloaded),
registered through `ninfer_register_bench_shapes`, and the real widths the GPU tests use.

Widths of the published text configs (google/gemma-4-31B and google/gemma-4-26B-A4B, text_config).
The 26B-A4B figures agree with its GGUF metadata (30 blocks, 2816 wide, 16 heads, 8 sliding KV
heads of 256, 512-wide global heads, window 1024, 128 experts top 8 of width 704, dense MLP 2112);
the 31B's 60 layers and window 1024 agree with published llama.cpp configurations.
"""

from __future__ import annotations

from ninfer_gemma4.testing import layer_pattern

REAL_WIDTHS = {
    "31b": {"hidden_size": 5376, "intermediate_size": 21504, "num_attention_heads": 32, "num_key_value_heads": 16,
            "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 4, "sliding_window": 1024},
    "26b-a4b": {"hidden_size": 2816, "intermediate_size": 2112, "num_attention_heads": 16, "num_key_value_heads": 8,
                "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 2, "sliding_window": 1024,
                "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704},
}
LAYERS = {"31b": 60, "26b-a4b": 30}


def real_config(kind: str, num_layers: int | None = None) -> dict:
    """The text config (model_type gemma4_text) of `kind` at its real widths; `num_layers` cuts the
    layer count (kept a whole number of 5-sliding + 1-global periods, the last layer global)."""
    from ninfer_gemma4.testing import shrunk_config

    n = num_layers or LAYERS[kind]
    cfg = shrunk_config(kind, vocab_size=262144, num_layers=n, multimodal=False)
    cfg.update(REAL_WIDTHS[kind], vocab_size_per_layer_input=262144, max_position_embeddings=262144,
               layer_types=layer_pattern(n, 6), eos_token_id=[1, 106])
    return cfg


GEMMA4_31B = real_config("31b")
GEMMA4_26B_A4B = real_config("26b-a4b")
