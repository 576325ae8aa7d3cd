"""The geometry the hybrid layers of `ninfer_core.nn` are built from: `HybridConfig` and `RopeConfig`.

A family parses its checkpoint's config.json into a `HybridConfig` (or a subclass that adds its
parser, as a family plugin's own config class does) and hands it to the layers; this module reads
no config file and knows no family's defaults. No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class ConfigError(ValueError):
    """The stored config cannot describe a model the family's layers can run."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    partial_rotary_factor: float
    rope_type: str = "default"  # default | linear
    factor: float = 1.0  # linear scaling factor
    mrope_section: tuple[int, ...] = (11, 11, 10)  # frequencies per (t, h, w) axis of multimodal positions
    mrope_interleaved: bool = True


@dataclass(frozen=True)
class HybridConfig:
    """A decoder stack of Gated DeltaNet ("linear_attention") and gated full-attention
    ("full_attention") layers, each followed by a dense SwiGLU or a sparse MoE block."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # per layer: "linear_attention" | "full_attention"
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    rope: RopeConfig
    max_position_embeddings: int
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    tie_word_embeddings: bool
    intermediate_size: int = 0  # dense MLP width (0 for MoE models)
    is_moe: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    mtp_num_hidden_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict)

    # ---- derived geometry -------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_key_head_dim * self.linear_num_key_heads

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_value_head_dim * self.linear_num_value_heads

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")
