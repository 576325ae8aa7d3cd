"""The published Qwen3.8-Flash-Next text shape (`ninfer bench --shape qwen3.8-flash-next`), from
REFERENCE.md: 48 layers (36 GDN + 12 indexed full attention), hidden 2560, 4 hyper-connection
streams of rank 320, indexer budget 2048 / ratio 4, one PLE layer of 16 rows per token, 512
experts top-10 of width 640 with a shared expert. Head counts follow the Qwen3.5-MoE defaults."""

FLASH_NEXT = {
    "model_type": "qwen4_exp_text",
    "vocab_size": 248320, "hidden_size": 2560, "num_hidden_layers": 48,
    "layer_types": ["indexed_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)],
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "moe_intermediate_size": 640, "shared_expert_intermediate_size": 640,
    "num_experts": 512, "num_experts_per_tok": 10, "norm_topk_prob": True,
    "hc_count": 4, "hc_lowrank": 320,
    "ple_layer_ids": [2], "ple_embed_dim": 2560, "ngram_size": 3, "heads_per_ngram": 8,
    "indexer_n_heads": 16, "indexer_kv_heads": 1, "indexer_head_dim": 128,
    "indexer_budget": 2048, "indexer_compress_ratio": 4,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "eos_token_id": 248046,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "tie_word_embeddings": False,
}  # fmt: skip


def bench_config(layers: int = 4, ngram_vocab_base: int = 200_000) -> dict:
    """The real widths with the first `layers` layers (a period of 4 keeps 3 GDN, the PLE layer and
    one indexed attention layer) and a smaller n-gram vocabulary: the 512 experts of all 48 layers
    (~120 B parameters) and the ~45 B-row table do not fit one GPU; a pass reads 16 rows per token
    whatever the table's size, and the per-layer figures scale by layer count."""
    cfg = dict(FLASH_NEXT)
    cfg["num_hidden_layers"] = layers
    cfg["layer_types"] = FLASH_NEXT["layer_types"][:layers]
    cfg["ple_layer_ids"] = [i for i in FLASH_NEXT["ple_layer_ids"] if i <= layers]
    cfg["ngram_vocab_size_base"] = ngram_vocab_base
    return cfg


def parity_config(ngram_vocab_base: int = 200_000) -> dict:
    """The real widths in two layers: the PLE layer's GDN, then one indexed attention layer (the
    GPU parity tests: half the expert bytes and compile work of the 4-layer period)."""
    cfg = bench_config(2, ngram_vocab_base)
    cfg["layer_types"] = ["linear_attention", "indexed_attention"]
    cfg["ple_layer_ids"] = [1]  # one-based: layer 0
    return cfg


def model_bytes(cfg: dict, dtype_bytes: int = 2) -> dict:
    """Weight bytes of a config by part at `dtype_bytes` per parameter, counted on a meta-device
    model: routed experts, everything else, the n-gram tables (the bench sizes `--layers max` by it)."""
    import torch

    from ninfer_flash_next.config import FlashNextConfig
    from ninfer_flash_next.model import FlashNextModel

    f = FlashNextConfig.from_hf(cfg)
    with torch.device("meta"):
        m = FlashNextModel(f)
    experts = sum(p.numel() for n, p in m.named_parameters() if ".mlp.experts." in n)
    dense = sum(p.numel() for n, p in m.named_parameters() if ".mlp.experts." not in n)
    ngram = sum(f.ngram_table_rows(i) * f.ngram_row_dim for i in range(len(f.ple_layer_ids)))
    return {"experts": experts * dtype_bytes, "dense": dense * dtype_bytes, "ngram": ngram * dtype_bytes}


FLASH_NEXT_4L = bench_config()
