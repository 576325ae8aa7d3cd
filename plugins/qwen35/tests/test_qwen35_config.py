import pytest
from ninfer_qwen35.config import ConfigError, Qwen35Config
from ninfer_qwen35.testing import tiny_text_config


def test_nested_and_flat_parse_the_same():
    text = tiny_text_config("moe")
    nested = Qwen35Config.from_hf(
        {"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": True}
    )
    flat = Qwen35Config.from_hf(dict(text, tie_word_embeddings=True))
    assert nested.is_moe and flat.is_moe
    for f in ("hidden_size", "layer_types", "num_experts", "moe_intermediate_size", "rope", "head_dim"):
        assert getattr(nested, f) == getattr(flat, f)
    assert nested.tie_word_embeddings and flat.tie_word_embeddings
    assert nested.full_attention_layers == (3,) and nested.linear_attention_layers == (0, 1, 2)
    assert nested.rotary_dim == 8 and nested.gdn_conv_dim == 2 * 32 + 64


def test_layer_types_from_interval():
    text = tiny_text_config("dense", num_layers=8)
    del text["layer_types"]
    cfg = Qwen35Config.from_hf(text)
    assert cfg.full_attention_layers == (3, 7)


def test_top_level_tie_wins_over_text_config():
    text = dict(tiny_text_config("dense"), tie_word_embeddings=True)
    assert not Qwen35Config.from_hf({"text_config": text, "tie_word_embeddings": False}).tie_word_embeddings


def test_rope_nesting_and_precedence():
    base = tiny_text_config("dense")
    del base["rope_parameters"]
    # old style: top-level theta / partial factor, rope_scaling holding the mrope section
    old = dict(
        base,
        rope_theta=5e6,
        partial_rotary_factor=0.5,
        rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
    )
    r = Qwen35Config.from_hf(old).rope
    assert (r.theta, r.partial_rotary_factor, r.rope_type, r.mrope_section) == (
        5e6,
        0.5,
        "default",
        (2, 1, 1),
    )
    # keys inside rope_parameters win over top-level ones
    new = dict(base, rope_theta=1.0, rope_parameters={"rope_type": "default", "rope_theta": 1e7})
    r = Qwen35Config.from_hf(new).rope
    assert r.theta == 1e7 and r.partial_rotary_factor == 0.25  # Qwen3.5 default partial factor
    lin = dict(base, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4})
    assert Qwen35Config.from_hf(lin).rope.factor == 4.0
    with pytest.raises(ConfigError, match="rope_type"):
        Qwen35Config.from_hf(dict(base, rope_parameters={"rope_type": "yarn", "factor": 4.0}))


def test_bad_configs_are_refused():
    with pytest.raises(ConfigError):
        Qwen35Config.from_hf(dict(tiny_text_config("dense"), layer_types=["linear_attention", "sliding"] * 2))
    with pytest.raises(ConfigError):
        Qwen35Config.from_hf(dict(tiny_text_config("dense"), hidden_act="gelu"))
