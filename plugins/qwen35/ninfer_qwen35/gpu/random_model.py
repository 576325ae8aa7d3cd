"""Random-weight models at real shapes, made directly on the device (no artifact written), and a
transformers model that shares the runner's weight tensors (for `ninfer bench` and tests/gpu).

`RandomArtifact` looks like an open artifact to `Qwen35Family.load`: it names the checkpoint
tensors of the config and draws each one on the device when the loader asks for it, so the
loader's own path (names, shapes, fusion) runs unchanged. Values are random, never zeros: weights
~ N(0, (0.5 / sqrt(fan_in))^2) so activations stay O(1) through the layers.
"""

from __future__ import annotations

import math
import zlib

import torch

from ninfer_qwen35.config import Qwen35Config

PREFIX = "model.language_model."


class RandomArtifact:
    path = "<random>"
    chat_template = None
    components = ["text"]

    def __init__(self, hf_config: dict, device="cuda", dtype=torch.bfloat16, seed: int = 0, name="random",
                 tokenizer_section: dict | None = None, chat_template: str | None = None, mtp: bool = False):
        """`mtp`: also the checkpoint's MTP head (`mtp.*`, one layer), for the speculative bench."""
        from ninfer_qwen35.model import Qwen35TextModel

        self.config = dict(hf_config)
        self.architecture = self.config.get("model_type", "qwen3_5")
        self.name = name
        self.manifest = {"name": name, "architecture": self.architecture, "config": self.config}
        self.tokenizer_section = tokenizer_section
        if chat_template is not None:
            self.chat_template = chat_template
        self.device, self.dtype, self.seed = torch.device(device), dtype, seed
        cfg = Qwen35Config.from_hf(self.config, self.architecture)
        with torch.device("meta"):
            model = Qwen35TextModel(cfg)
        self._shapes = {PREFIX + n: tuple(p.shape) for n, p in model.named_parameters()}
        self._shapes.pop(PREFIX + "lm_head.weight", None)
        if not cfg.tie_word_embeddings:
            self._shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
        if mtp:
            from ninfer_core.nn.mtp import MtpHead

            with torch.device("meta"):
                head = MtpHead(cfg)
            self._shapes.update({"mtp." + n: tuple(p.shape) for n, p in head.named_parameters()})
            self.components = ["text", "mtp"]
        self.cfg = cfg

    def tensor_names(self, component=None) -> list[str]:
        if component is not None:
            return [n for n in self._shapes if (n.startswith("mtp.") and component == "mtp")
                    or (not n.startswith("mtp.") and component == "text")]
        return list(self._shapes)

    def has_tensor(self, name) -> bool:
        return name in self._shapes

    def get_tensor(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        gen = torch.Generator(device=self.device)
        gen.manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFFFFFF)
        leaf = name.rsplit(".", 2)
        kind = leaf[-2] if name.endswith(".weight") else leaf[-1]
        t = torch.empty(shape, dtype=torch.float32 if len(shape) == 1 else self.dtype, device=self.device)
        if name.endswith("A_log"):
            t.uniform_(0.0, math.log(16.0), generator=gen)
        elif name.endswith("dt_bias"):
            t.uniform_(0.5, 1.5, generator=gen)
        elif len(shape) == 1:  # norm weights: zero-centred norms get small offsets, GDN norm ~1
            t.normal_(1.0 if kind == "norm" and "linear_attn" in name else 0.0, 0.1, generator=gen)
        elif "conv1d" in name:
            t.normal_(0.0, 0.3, generator=gen)
        elif "embed_tokens" in name:
            t.normal_(0.0, 1.0, generator=gen)
        else:
            t.normal_(0.0, 0.5 / math.sqrt(shape[-1]), generator=gen)
        return t.to(self.dtype)

    def close(self):
        pass


def transformers_model(runner, hf_config: dict, attn_implementation: str = "sdpa"):
    """A transformers Qwen3_5(Moe)ForCausalLM whose parameters ARE the runner's tensors (no copy):
    built on the meta device, then every parameter re-pointed at the runner's tensor of the same
    name; only the rotary tables are made fresh."""
    import transformers

    top = dict(hf_config)
    cfg_dict = dict(top.get("text_config") or top)
    cfg_dict["tie_word_embeddings"] = top.get("tie_word_embeddings", cfg_dict.get("tie_word_embeddings", False))
    moe = runner.cfg.is_moe
    config_cls = transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig
    model_cls = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
    cfg_dict = {k: v for k, v in cfg_dict.items() if k not in ("model_type", "architectures")}
    hf_cfg = config_cls(**cfg_dict)
    hf_cfg._attn_implementation = attn_implementation
    with torch.device("meta"):
        hf = model_cls(hf_cfg)
    ours = dict(runner.model.named_parameters())
    if runner.cfg.tie_word_embeddings:
        ours["lm_head.weight"] = runner.model.embed_tokens.weight
    for name, _ in list(hf.named_parameters()):
        key = name.removeprefix("model.")
        if key not in ours:
            raise RuntimeError(f"transformers parameter {name} has no NInfer tensor")
        owner, _, leaf = name.rpartition(".")
        setattr(hf.get_submodule(owner), leaf, torch.nn.Parameter(ours[key], requires_grad=False))
    rot = hf.model.rotary_emb
    with torch.device("cpu"):
        hf.model.rotary_emb = type(rot)(config=hf_cfg).to(runner.device)
    left = [n for n, b in hf.named_buffers() if b.is_meta]
    if left:
        raise RuntimeError(f"buffers left on the meta device: {left[:4]}")
    return hf.eval()
