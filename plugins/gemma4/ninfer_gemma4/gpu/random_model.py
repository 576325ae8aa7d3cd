"""Random-weight Gemma 4 models at real shapes, drawn on the device (no artifact written), and a
transformers model sharing the runner's weight tensors (`ninfer bench`, the GPU tests).

`RandomArtifact` looks like an open artifact to `Gemma4Family.load`: it names the checkpoint
tensors (`model.language_model.*`) and draws each when the loader asks, so the loader's own path
runs unchanged. Matrices ~ N(0, (0.5 / sqrt(fan_in))^2), norm weights and scales ~ N(1, 0.1^2)
(Gemma 4 norms multiply by the weight itself), embeddings ~ N(0, 1 / hidden) (they are scaled by
sqrt(hidden)), layer scalars 1.
"""

from __future__ import annotations

import math
import zlib

import torch

from ninfer_gemma4.config import Gemma4Config

PREFIX = "model.language_model."


class RandomArtifact:
    path = "<random>"
    chat_template = None
    components = ["text"]

    def __init__(self, hf_config: dict, device="cuda", dtype=torch.bfloat16, seed: int = 0, name="random",
                 tokenizer_section: dict | None = None, chat_template: str | None = None, **_):
        from ninfer_gemma4.model import Gemma4TextModel

        self.config = dict(hf_config)
        self.architecture = self.config.get("model_type", "gemma4_text")
        self.name = name
        self.manifest = {"name": name, "architecture": self.architecture, "config": self.config}
        self.tokenizer_section = tokenizer_section
        if chat_template is not None:
            self.chat_template = chat_template
        self.device, self.dtype, self.seed = torch.device(device), dtype, seed
        cfg = Gemma4Config.from_hf(self.config, self.architecture)
        with torch.device("meta"):
            model = Gemma4TextModel(cfg)
        self._shapes = {PREFIX + n: tuple(p.shape) for n, p in model.named_parameters()}
        self._shapes.pop(PREFIX + "lm_head.weight", None)  # tied to the embeddings
        self.cfg = cfg

    def tensor_names(self, component=None) -> list[str]:
        return list(self._shapes) if component in (None, "text") else []

    def has_tensor(self, name) -> bool:
        return name in self._shapes

    def get_tensor(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        gen = torch.Generator(device=self.device)
        gen.manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFFFFFF)
        t = torch.empty(shape, dtype=torch.float32, device=self.device)
        if len(shape) == 1:
            t.normal_(1.0, 0.1, generator=gen)
        elif "embed_tokens" in name:
            t.normal_(0.0, 1.0 / math.sqrt(self.cfg.hidden_size), generator=gen)
        else:
            t.normal_(0.0, 0.5 / math.sqrt(shape[-1]), generator=gen)
        return t.to(self.dtype)

    def close(self):
        pass


def transformers_model(runner, hf_config: dict, attn_implementation: str = "sdpa"):
    """transformers' Gemma4ForCausalLM whose parameters ARE the runner's tensors (no copy): built
    on the meta device, each parameter re-pointed at the runner's tensor of the same name, the
    layer scalars copied, the rotary tables made fresh."""
    import transformers

    cfg_dict = dict(hf_config.get("text_config") or hf_config)
    cfg_dict = {k: v for k, v in cfg_dict.items() if k not in ("model_type", "architectures")}
    hf_cfg = transformers.Gemma4TextConfig(**cfg_dict)
    hf_cfg._attn_implementation = attn_implementation
    with torch.device("meta"):
        hf = transformers.Gemma4ForCausalLM(hf_cfg)
    ours = dict(runner.model.named_parameters())
    ours["lm_head.weight"] = runner.model.embed_tokens.weight
    for name, _ in list(hf.named_parameters()):
        key = name.removeprefix("model.")
        if key not in ours:
            raise RuntimeError(f"transformers parameter {name} has no NInfer tensor")
        owner, _, leaf = name.rpartition(".")
        setattr(hf.get_submodule(owner), leaf, torch.nn.Parameter(ours[key], requires_grad=False))
    hf.lm_head.weight = hf.model.embed_tokens.weight  # tied: named_parameters() listed it once
    bufs = dict(runner.model.named_buffers())
    for name, b in list(hf.named_buffers()):
        key = name.removeprefix("model.")
        owner, _, leaf = name.rpartition(".")
        if key in bufs:
            hf.get_submodule(owner).register_buffer(leaf, bufs[key].clone(), persistent=False)
    scales = {"model.embed_tokens.embed_scale": runner.cfg.hidden_size ** 0.5,
              "model.embed_tokens_per_layer.embed_scale": (runner.cfg.hidden_size_per_layer_input or 1) ** 0.5}
    for name, value in scales.items():  # the scaled embeddings' constant (made on meta above)
        owner, _, leaf = name.rpartition(".")
        if any(n == name for n, _ in hf.named_buffers()):
            hf.get_submodule(owner).register_buffer(leaf, torch.tensor(value, device=runner.device), persistent=False)
    rot = hf.model.rotary_emb
    with torch.device("cpu"):
        hf.model.rotary_emb = type(rot)(config=hf_cfg).to(runner.device)
    left = [n for n, b in hf.named_buffers() if b.is_meta]
    if left:
        raise RuntimeError(f"buffers left on the meta device: {left[:4]}")
    return hf.eval()
