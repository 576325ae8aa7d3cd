"""Random-weight Flash-Next models at real widths, drawn on the device as the loader asks (no
artifact written), and transformers' model sharing the runner's tensors (bench and GPU tests).

`RandomArtifact` names the checkpoint tensors of a config (`model.*`, fused experts, one n-gram
table tensor per PLE layer) and draws each on request; the family's loader runs its own path.
Weights ~ N(0, (0.5 / sqrt(fan_in))^2), norms near their identity, n-gram rows ~ N(0, 1).
"""

from __future__ import annotations

import math
import zlib

import torch

from ninfer_flash_next.config import FlashNextConfig

PREFIX = "model."


class RandomArtifact:
    path = "<random>"
    chat_template = None
    components = ("text",)

    def __init__(self, hf_config: dict, device="cuda", dtype=torch.bfloat16, seed: int = 0, name="random",
                 tokenizer_section: dict | None = None, chat_template: str | None = None, mtp: bool = False):
        from ninfer_flash_next.model import FlashNextModel

        self.config = dict(hf_config)
        self.architecture = self.config.get("model_type", "qwen4_exp_text")
        self.name = name
        self.manifest = {"name": name, "architecture": self.architecture, "config": self.config,
                         "identity": {"model_id": name}}
        self.tokenizer_section = tokenizer_section
        if chat_template is not None:
            self.chat_template = chat_template
        self.device, self.dtype, self.seed = torch.device(device), dtype, seed
        cfg = FlashNextConfig.from_hf(self.config, self.architecture)
        with torch.device("meta"):
            model = FlashNextModel(cfg)
        self._shapes = {PREFIX + n: tuple(p.shape) for n, p in model.named_parameters()}
        self._shapes.pop(PREFIX + "lm_head.weight", None)
        self._shapes["lm_head.weight"] = (cfg.base.vocab_size, cfg.base.hidden_size)
        for i, layer in enumerate(cfg.ple_layer_ids):
            rows = cfg.ngram_table_rows(i)
            self._shapes[f"{PREFIX}layers.{layer}.ple.ple_embedding.ngram_embedding.weight"] = (rows, cfg.ngram_row_dim)
        if mtp:
            from ninfer_core.nn.mtp import MtpHead

            with torch.device("meta"):
                head = MtpHead(cfg.base)
            self._shapes.update({"mtp." + n: tuple(p.shape) for n, p in head.named_parameters()})
            self.components = ("text", "mtp")
        self.cfg = cfg

    def tensor_names(self, component=None) -> list[str]:
        if component is not None:
            return [n for n in self._shapes if n.startswith("mtp.") == (component == "mtp")]
        return list(self._shapes)

    def has_tensor(self, name) -> bool:
        return name in self._shapes

    def tensor_shape(self, name) -> tuple[int, ...]:
        return self._shapes[name]

    def get_tensor(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        gen = torch.Generator(device=self.device)
        gen.manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFFFFFF)
        t = torch.empty(shape, dtype=torch.float32 if len(shape) == 1 else self.dtype, device=self.device)
        if name.endswith("A_log"):
            t.uniform_(0.0, math.log(16.0), generator=gen)
        elif name.endswith("dt_bias"):
            t.uniform_(0.5, 1.5, generator=gen)
        elif len(shape) == 1:
            t.normal_(1.0 if name.endswith("linear_attn.norm.weight") else 0.0, 0.1, generator=gen)
        elif "ngram_embedding" in name or "embed_tokens" in name:
            t.normal_(0.0, 1.0, generator=gen)
        elif name == "lm_head.weight":
            t.normal_(0.0, 2.0 / math.sqrt(shape[-1]), generator=gen)
        else:
            t.normal_(0.0, 0.5 / math.sqrt(shape[-1]), generator=gen)
        return t


def transformers_model(runner, hf_config: dict):
    """transformers' Qwen4ExpForCausalLM with `runner`'s weights (device residency; shared storage, no
    copy). The runner's Parameters themselves are not handed over (detached views are): `hf.float()`
    then converts transformers' copies and leaves the runner's bf16 weights as they are."""
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRotaryEmbedding

    skip = {"model_type", "architectures", "mtp_num_hidden_layers", "transformers_version", "dtype"}
    cfg = Qwen4ExpTextConfig(**{k: v for k, v in hf_config.items() if k not in skip})
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = Qwen4ExpForCausalLM(cfg)
    state = {"model." + n: p.detach() for n, p in runner.model.named_parameters() if n != "lm_head.weight"}
    state["lm_head.weight"] = runner.model.lm_head.weight.detach()
    for layer in runner.fcfg.ple_layer_ids:
        ple = runner.model.layers[layer].ple
        pre = f"model.layers.{layer}.ple.ple_embedding."
        if ple.rows is None or ple.rows.full is None:
            raise ValueError("the transformers comparison needs the n-gram table resident")
        state[pre + "ngram_embedding.weight"] = ple.rows.full
        dev = runner.device
        state[pre + "layer_multipliers"] = ple.hasher.multipliers.to(dev)
        state[pre + "ngram_heads_vocab_sizes"] = ple.hasher.sizes.to(dev)
        state[pre + "ngram_heads_offsets"] = ple.hasher.offsets.to(dev)
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"transformers model does not match: missing {missing[:4]}, unexpected {unexpected[:4]}")
    with torch.device(runner.device):
        hf.model.rotary_emb = Qwen4ExpTextRotaryEmbedding(cfg)
    return hf.eval()
