"""The plugin's registrations and the config checks (no weights needed)."""

import argparse

import pytest
from ninfer_flash_next.config import FlashNextConfig
from ninfer_flash_next.testing import tiny_config

from ninfer_core.nn.config import ConfigError


def test_registrations():
    from ninfer_flash_next import plugin

    fams, shapes, flags = [], [], []
    plugin.ninfer_register_model_families(lambda name, target, architectures: fams.append((name, target, architectures)))
    plugin.ninfer_register_bench_shapes(lambda name, target, default=False: shapes.append(name))
    plugin.ninfer_add_serve_options(lambda *f, **kw: flags.extend(f))
    assert fams == [("flash_next", "ninfer_flash_next.family:FlashNextFamily", ["qwen4_exp", "qwen4_exp_text"])]
    assert shapes == ["qwen3.8-flash-next-4l"]
    for flag in ("--expert-residency", "--expert-cache-mib", "--expert-misses", "--expert-profile",
                 "--expert-profile-out", "--ngram-table", "--ngram-residency", "--ngram-io", "--ngram-io-depth",
                 "--ngram-ram-mib", "--no-ngram-table"):
        assert flag in flags


def test_option_values_are_checked_by_the_parser():
    from ninfer_flash_next import plugin

    p = argparse.ArgumentParser(exit_on_error=False)
    plugin.ninfer_add_serve_options(p.add_argument)
    ns = p.parse_args(["--expert-cache-mib", "auto", "--ngram-io-depth", "8", "--ngram-residency", "ram-hot"])
    assert ns.expert_cache_mib == "auto" and ns.ngram_io_depth == 8 and ns.ngram_residency == "ram-hot"
    for bad in (["--ngram-io-depth", "0"], ["--ngram-io-depth", "2000"], ["--expert-cache-mib", "-1"],
                ["--expert-residency", "gpu"], ["--ngram-ram-mib", "x"]):
        with pytest.raises((argparse.ArgumentError, SystemExit)):
            p.parse_args(bad)


def test_catalog_names_the_package():
    from ninfer_catalog import FAMILY_PACKAGES

    assert FAMILY_PACKAGES["qwen4_exp"] == FAMILY_PACKAGES["qwen4_exp_text"] == "ninfer-flash-next"


def test_config_parsing_and_refusals():
    cfg = FlashNextConfig.from_hf(tiny_config())
    assert cfg.base.full_attention_layers == (3,) and cfg.ple_layer_ids == (1,) and cfg.indexer == (2, 16, 8, 4)
    assert cfg.ngram_heads == 8 and cfg.ngram_row_dim == 4 and cfg.ple_conv_state == 9
    assert cfg.ngram_head_sizes(0) == [101, 103, 107, 109, 113, 127, 131, 137]
    assert cfg.ngram_table_rows(0) == 928  # 928 = sum of the primes rounded up to a multiple of 8
    nested = FlashNextConfig.from_hf({"model_type": "qwen4_exp", "text_config": tiny_config()})
    assert nested.base.architecture == "qwen4_exp" and nested.hc_count == 4
    bad = [
        ({"hc_count": 1}, "hc_count > 1"),
        ({"ple_layer_ids": [4]}, "only supported on linear_attention"),
        ({"ple_layer_ids": [9]}, "one-indexed"),
        ({"indexer_kv_heads": 2}, "one key head"),
        ({"indexer_budget": 10}, "divisible by indexer_compress_ratio"),
        ({"indexer_head_dim": None}, "indexer config needs"),
        ({"ple_embed_dim": 30}, "ple_embed_dim must be divisible"),
        ({"output_gate_type": "tanh"}, "output_gate_type"),
        ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, "layer types"),
        ({"eos_token_id": None}, "eos_token_id must be set"),
    ]
    for over, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            FlashNextConfig.from_hf(tiny_config(**over))


def test_hash_matches_transformers():
    """The n-gram rows of a prompt with EOS inside, against transformers' embedding module."""
    import torch
    from ninfer_flash_next.ngram import NgramHasher
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    raw = tiny_config()
    cfg = FlashNextConfig.from_hf(raw)
    hf_cfg = Qwen4ExpTextConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    emb = Qwen4ExpTextNGramEmbedding(hf_cfg, 32, 1, 0)
    captured = {}
    emb.ngram_embedding.forward = lambda ids: captured.setdefault("ids", ids) * 0.0
    toks = torch.tensor([[5, 258, 7, 9, 258, 258, 3, 4, 400]])
    emb(toks, None)
    ours = NgramHasher(cfg, 0).row_ids(torch.full((2,), 258), toks[0])
    assert torch.equal(ours, captured["ids"][0])
