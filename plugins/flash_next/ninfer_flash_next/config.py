"""The Flash-Next (qwen4_exp) configuration: the hybrid backbone's geometry plus what this family adds.

The backbone part is a `ninfer_core.nn.config.HybridConfig` (core's GDN, gated attention and MoE
layers are built from it), with the checkpoint's "indexed_attention" layers read as the backbone's
full-attention layers. Defaults are transformers' `Qwen4ExpTextConfig`. No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ninfer_core.nn.config import ConfigError, HybridConfig, RopeConfig

ARCHITECTURES = ("qwen4_exp", "qwen4_exp_text")

_DEFAULTS = {
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "max_position_embeddings": 32768,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10,
    "num_experts": 512,
}  # fmt: skip

# transformers' n-gram hash constants (splitmix64 and the per-layer seed stride)
_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_LAYER_STRIDE = 10007


@dataclass(frozen=True)
class FlashNextConfig:
    base: HybridConfig  # the backbone: GDN / full-attention layers, MoE widths, RoPE
    hc_count: int
    hc_lowrank: int
    ple_layer_ids: tuple[int, ...]  # zero-based layer indices with a PLE module
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    ngram_vocab_divisor: int
    seed: int
    indexer: tuple[int, int, int, int] | None  # (query heads, head_dim, budget, compress ratio) or None
    output_gate: str  # GDN output gate activation: silu | sigmoid
    eos_token_id: int | None

    # ---- derived ------------------------------------------------------------------------------
    @property
    def hc_hidden(self) -> int:
        return self.hc_count * self.base.hidden_size

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ngram_context(self) -> int:
        return self.ngram_size - 1

    @property
    def ngram_row_dim(self) -> int:
        return self.ple_embed_dim // self.ngram_heads

    @property
    def ple_conv_state(self) -> int:
        """Columns the dilated PLE convolution keeps: (kernel - 1) * dilation (dilation = n-gram size)."""
        return (self.ple_conv_kernel_size - 1) * self.ngram_size

    def ngram_head_sizes(self, ple_index: int) -> list[int]:
        """The prime vocabulary of each hashed head of the `ple_index`-th PLE layer."""
        first = ple_index * self.ngram_heads
        primes, p = [], self.ngram_vocab_size_base - 1
        while len(primes) < first + self.ngram_heads:
            p += 1
            while not _is_prime(p):
                p += 1
            primes.append(p)
        return primes[first:]

    def ngram_table_rows(self, ple_index: int) -> int:
        total = sum(self.ngram_head_sizes(ple_index))
        return -(-total // self.ngram_vocab_divisor) * self.ngram_vocab_divisor

    def ngram_multipliers(self, ple_index: int) -> list[int]:
        """Odd hash multipliers of each n-gram position, as transformers derives them from the seed."""
        multiplier_max = ((1 << 63) - 1) // max(self.base.vocab_size, 1)
        half = max(1, multiplier_max // 2)
        seed = self.seed + _LAYER_STRIDE * ple_index
        out = []
        for i in range(self.ngram_size):
            out.append(2 * (_splitmix64((seed + _GAMMA * (i + 1)) & _MASK64) % half) + 1)
        return out

    @classmethod
    def from_hf(cls, hf_config: dict, architecture: str | None = None) -> FlashNextConfig:
        top = dict(hf_config)
        text = dict(top.get("text_config") or top)
        arch = architecture or top.get("model_type") or "qwen4_exp"
        for k, v in _DEFAULTS.items():
            if text.get(k) is None:
                text[k] = v
        n = int(text["num_hidden_layers"])
        types = text.get("layer_types")
        if types is None:
            interval = int(text.get("full_attention_interval", 4))
            types = ["linear_attention" if (i + 1) % interval else "indexed_attention" for i in range(n)]
        unknown = set(types) - {"linear_attention", "indexed_attention", "full_attention"}
        if unknown:
            raise ConfigError(f"unsupported Flash-Next layer types {sorted(unknown)}")
        # the backbone parser knows full_attention; which of them are indexed is the indexer's business
        text["layer_types"] = ["full_attention" if t != "linear_attention" else t for t in types]
        base = _backbone(text, top, arch)
        hc = int(text.get("hc_count", 4))
        if hc <= 1:
            raise ConfigError(f"Flash-Next needs hc_count > 1, got {hc}")
        ple = sorted({int(i) for i in text.get("ple_layer_ids") or []})
        if any(not 1 <= i <= n for i in ple):
            raise ConfigError(f"ple_layer_ids must be one-indexed layer ids in 1..{n}, got {ple}")
        if any(base.layer_types[i - 1] != "linear_attention" for i in ple):
            raise ConfigError("PLE is only supported on linear_attention layers")
        eos = text.get("eos_token_id", top.get("eos_token_id"))
        eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        if ple and eos is None:
            raise ConfigError("eos_token_id must be set when PLE layers are enabled")
        ngram_size = int(text.get("ngram_size", 3))
        heads = int(text.get("heads_per_ngram", 8))
        ple_dim = int(text.get("ple_embed_dim") or base.hidden_size)
        if ple and (ngram_size < 2 or ple_dim % ((ngram_size - 1) * heads)):
            raise ConfigError("ple_embed_dim must be divisible by (ngram_size - 1) * heads_per_ngram")
        fields = [text.get(k) for k in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim",
                                        "indexer_budget", "indexer_compress_ratio")]
        indexer = None
        if any(f is not None for f in fields):
            if any(f is None or int(f) <= 0 for f in fields):
                raise ConfigError("the indexer config needs positive indexer_n_heads, indexer_kv_heads, "
                                  "indexer_head_dim, indexer_budget and indexer_compress_ratio")
            nh, kvh, hd, budget, ratio = (int(f) for f in fields)
            if kvh != 1:
                raise ConfigError("Flash-Next's indexer has one key head (indexer_kv_heads=1)")
            if budget % ratio:
                raise ConfigError("indexer_budget must be divisible by indexer_compress_ratio")
            if base.rotary_dim > hd:
                raise ConfigError("the attention's rotary dims must fit the indexer head")
            indexer = (nh, hd, budget, ratio)
        gate = text.get("output_gate_type") or text.get("hidden_act", "silu")
        if gate not in ("silu", "sigmoid"):
            raise ConfigError(f"unsupported output_gate_type {gate!r}")
        return cls(
            base=base, hc_count=hc, hc_lowrank=int(text.get("hc_lowrank", 320)),
            ple_layer_ids=tuple(i - 1 for i in ple), ple_embed_dim=ple_dim,
            ple_conv_kernel_size=int(text.get("ple_conv_kernel_size", 4)), ngram_size=ngram_size,
            heads_per_ngram=heads, ngram_vocab_size_base=int(text.get("ngram_vocab_size_base", 20_000_000)),
            ngram_vocab_divisor=int(text.get("make_ngram_vocab_size_divisible_by", 128)),
            seed=int(text.get("seed", 1234)), indexer=indexer, output_gate=gate,
            eos_token_id=None if eos is None else int(eos),
        )


def _backbone(text: dict, top: dict, arch: str) -> HybridConfig:
    """The GDN / attention / MoE geometry of a text config whose defaults are already filled in."""
    n, heads, kv_heads = int(text["num_hidden_layers"]), int(text["num_attention_heads"]), int(text["num_key_value_heads"])
    if text.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"unsupported hidden_act {text.get('hidden_act')!r} (Flash-Next uses silu)")
    eos = text.get("eos_token_id", top.get("eos_token_id"))
    base = HybridConfig(
        architecture=arch, vocab_size=int(text["vocab_size"]), hidden_size=int(text["hidden_size"]),
        num_hidden_layers=n, layer_types=tuple(text["layer_types"][:n]), num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // heads),
        rms_norm_eps=float(text.get("rms_norm_eps") or 1e-6), attention_bias=bool(text.get("attention_bias", False)),
        rope=_parse_rope(text), max_position_embeddings=int(text["max_position_embeddings"]),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim") or 4),
        linear_key_head_dim=int(text.get("linear_key_head_dim") or 128),
        linear_value_head_dim=int(text.get("linear_value_head_dim") or 128),
        linear_num_key_heads=int(text.get("linear_num_key_heads") or 16),
        linear_num_value_heads=int(text.get("linear_num_value_heads") or 32),
        # tying follows the top-level config, as transformers does for the outer model
        tie_word_embeddings=bool(top.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        is_moe=True, num_experts=int(text["num_experts"]), num_experts_per_tok=int(text["num_experts_per_tok"]),
        moe_intermediate_size=int(text["moe_intermediate_size"]),
        shared_expert_intermediate_size=int(text["shared_expert_intermediate_size"]),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers") or 0),
        eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),)),
    )  # fmt: skip
    if len(base.layer_types) != n:
        raise ConfigError(f"layer_types has {len(base.layer_types)} entries for {n} layers")
    if base.linear_num_value_heads % base.linear_num_key_heads:
        raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if heads % kv_heads:
        raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
    return base


def _parse_rope(text: dict) -> RopeConfig:
    """RoPE settings with transformers' precedence: rope_scaling replaces rope_parameters; keys
    inside the dict win over top-level rope_theta / partial_rotary_factor (default 0.25)."""
    params = dict(text.get("rope_scaling") or text.get("rope_parameters") or {})
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    rope_type = "default" if rope_type == "mrope" else rope_type
    if rope_type not in ("default", "linear"):
        raise ConfigError(f"unsupported rope_type {rope_type!r} (supported: default, linear)")
    return RopeConfig(
        theta=float(params.get("rope_theta", text.get("rope_theta", 10000.0))),
        partial_rotary_factor=float(params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
        rope_type=rope_type, factor=float(params.get("factor", 1.0)) if rope_type == "linear" else 1.0,
        mrope_section=tuple(int(s) for s in params.get("mrope_section", (11, 11, 10))),
        mrope_interleaved=bool(params.get("mrope_interleaved", True)),
    )


def _splitmix64(v: int) -> int:
    v = (v + _GAMMA) & _MASK64
    v = ((v ^ (v >> 30)) * _M1) & _MASK64
    v = ((v ^ (v >> 27)) * _M2) & _MASK64
    return (v ^ (v >> 31)) & _MASK64


def _is_prime(v: int) -> bool:
    if v < 2:
        return False
    if v % 2 == 0:
        return v == 2
    return all(v % d for d in range(3, math.isqrt(v) + 1, 2))
