"""Qwen35Family: builds a Qwen3.5 (dense or MoE) runner from an artifact.

Loading follows gpt-fast: build the modules on the meta device, then assign the artifact's
memory-mapped tensors (cast to the run dtype / device) by name. Hugging Face names are accepted
in both layouts: `model.language_model.*` (Qwen3_5ForConditionalGeneration, the published
checkpoints) and `model.*` (the text-only CausalLM). MoE experts may be stored fused
(`mlp.experts.gate_up_proj` / `down_proj`) or per expert (`mlp.experts.N.gate_proj.weight` ...).
"""

from __future__ import annotations

import logging
import re

import torch

from ninfer_core.accel import resolve_dtype  # noqa: F401  (re-exported: tests and tools import it here)
from ninfer_core.engine.hybrid_runner import HybridRunner
from ninfer_core.engine.model_api import ModelFamily
from ninfer_core.nn.loading import LoadError, assign_weights, eos_token_ids, fuse_experts
from ninfer_core.nn.mtp import MtpHead
from ninfer_core.quant.kv import kv_format
from ninfer_core.quant.transform import (
    apply_load_encodings,
    encoded_weight,
    is_encoded_or_scale,
    quantize_model,
    set_weight,
)
from ninfer_qwen35.chat import QWEN35_CHAT_FORMAT, QWEN35_TEMPLATE, SAMPLING_PRESETS
from ninfer_qwen35.config import Qwen35Config
from ninfer_qwen35.model import Qwen35TextModel

TEXT_PREFIXES = ("model.language_model.", "model.")
log = logging.getLogger("ninfer.qwen35")


class Qwen35Family(ModelFamily):
    name = "qwen35"
    chat_template = QWEN35_TEMPLATE  # stored by `ninfer convert` when a checkpoint has none

    def chat_format(self, artifact):
        return QWEN35_CHAT_FORMAT

    def sampling_presets(self, architecture: str) -> dict | None:
        return {k: dict(v) for k, v in SAMPLING_PRESETS.items()}

    def load(self, artifact, device: str = "cpu", dtype: str | None = None, options=None) -> HybridRunner:
        dev = torch.device(device)
        run_dtype = resolve_dtype(dtype, dev)
        cfg = Qwen35Config.from_hf(artifact.config, getattr(artifact, "architecture", None))

        names = list(artifact.tensor_names())
        text_names = [n for n in names if not n.startswith(("mtp.", "model.visual."))]
        mtp_names = [n for n in names if n.startswith("mtp.")]

        with torch.device("meta"):
            model = Qwen35TextModel(cfg)
        encoded = _encoded_state(artifact, text_names, run_dtype, dev)
        state = _text_state(artifact, [n for n in text_names if not is_encoded_or_scale(artifact, n)], cfg)
        tied = cfg.tie_word_embeddings or ("lm_head.weight" not in state and "lm_head.weight" not in encoded)
        if tied:
            state.pop("lm_head.weight", None)
        assign_weights(model, state, run_dtype, dev, skip=set(encoded) | ({"lm_head.weight"} if tied else set()))
        _assign_encoded(model, encoded)
        if tied:
            model.lm_head.weight = model.embed_tokens.weight
        apply_load_encodings(model, options)
        if getattr(options, "quantize", None) is not None:  # `ninfer bench --quantize` (random weights)
            quantize_model(model, options.quantize)
        model.init_rotary(dev)

        mtp = None
        if mtp_names:
            with torch.device("meta"):
                mtp = MtpHead(cfg)
            mtp_state = {n.removeprefix("mtp."): artifact.get_tensor(n) for n in mtp_names}
            assign_weights(mtp, fuse_experts(mtp_state), run_dtype, dev)
        eos = ()
        tok = getattr(artifact, "tokenizer_section", None)
        if isinstance(tok, dict):
            eos = eos_token_ids(tok)
        kv = kv_format(getattr(options, "kv_dtype", None))
        extra = dict(kv_format=kv, gdn_state_fp16=bool(getattr(options, "gdn_state_fp16", False)))
        if dev.type == "cuda":  # the fast path: fused projections, Triton/fla kernels, graphs (any --kv-dtype)
            from ninfer_qwen35.gpu.runner import GpuQwen35Runner

            return GpuQwen35Runner(model, cfg, dev, run_dtype, mtp=mtp, eos_token_ids=eos, **extra)
        return HybridRunner(model, cfg, dev, run_dtype, mtp=mtp, eos_token_ids=eos, **extra)

    # ---- pipeline stages (ninfer_core.engine.pipeline; model_api's StageRunner contract) ---------
    def pipeline_layers(self, artifact) -> int:
        return Qwen35Config.from_hf(artifact.config, getattr(artifact, "architecture", None)).num_hidden_layers

    def load_stage(self, artifact, layers: range, device: str = "cpu", dtype: str | None = None, options=None):
        """A runner over the decoder layers `layers` only: the first stage also embeds, the last
        also applies the final norm and the LM head (the embedding matrix when they are tied)."""
        dev = torch.device(device)
        run_dtype = resolve_dtype(dtype, dev)
        cfg = Qwen35Config.from_hf(artifact.config, getattr(artifact, "architecture", None))
        n = cfg.num_hidden_layers
        if not (0 <= layers.start < layers.stop <= n and layers.step == 1):
            raise LoadError(f"stage layers {layers.start}..{layers.stop - 1} outside the model's {n} layers")
        all_names = list(artifact.tensor_names())
        text_names = [m for m in all_names if not m.startswith(("mtp.", "model.visual."))]
        first, last = layers.start == 0, layers.stop == n
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in text_names
        # the MTP head lives on the last stage, beside the final hidden and the LM head it drafts
        # from; it embeds its tokens, so that stage keeps the embedding matrix too
        mtp_names = [m for m in all_names if m.startswith("mtp.")] if last else []

        def wanted(name: str) -> bool:  # read only this stage's tensors (a random source draws what it is asked)
            m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
            if m is not None:
                return int(m.group(1)) in layers
            if name.endswith("embed_tokens.weight"):
                return first or (last and (tied or bool(mtp_names)))
            return last

        state = _text_state(artifact, [m for m in text_names if wanted(m)], cfg)
        keep = {}
        for name, t in state.items():
            m = re.match(r"layers\.(\d+)\.", name)
            if m is not None:
                if int(m.group(1)) in layers:
                    keep[name] = t
            elif name == "embed_tokens.weight":
                if first or mtp_names:
                    keep[name] = t
                if last and tied and not first:  # the head is the embedding matrix: the last stage holds a copy
                    keep["lm_head.weight"] = t
            elif name.startswith("norm.") or name == "lm_head.weight":
                if last and not (name == "lm_head.weight" and tied):
                    keep[name] = t
        with torch.device("meta"):
            model = Qwen35TextModel(cfg, layers)
        share = first and last and tied
        embed_copy = keep.pop("embed_tokens.weight", None) if (mtp_names and not first) else None
        assign_weights(model, keep, run_dtype, dev, skip={"lm_head.weight"} if share else set())
        if share:
            model.lm_head.weight = model.embed_tokens.weight
        if embed_copy is not None:  # the MTP head's embeddings (the first stage embeds the prompt)
            model.embed_tokens = torch.nn.Embedding.from_pretrained(
                model.lm_head.weight if tied else embed_copy.to(device=dev, dtype=run_dtype), freeze=True)
        model.init_rotary(dev)
        mtp = None
        if mtp_names:
            with torch.device("meta"):
                mtp = MtpHead(cfg)
            assign_weights(mtp, fuse_experts({m.removeprefix("mtp."): artifact.get_tensor(m) for m in mtp_names}),
                           run_dtype, dev)
        tok = getattr(artifact, "tokenizer_section", None)
        eos = eos_token_ids(tok) if isinstance(tok, dict) else ()
        if dev.type == "cuda":  # the fast path's kernels, eager (a stage captures no decode graph)
            from ninfer_qwen35.gpu.runner import GpuQwen35Runner

            return GpuQwen35Runner(model, cfg, dev, run_dtype, mtp=mtp, eos_token_ids=eos)
        return HybridRunner(model, cfg, dev, run_dtype, mtp=mtp, eos_token_ids=eos)

    # ---- vision (model.visual.*; ninfer_core.media) ---------------------------------------------
    def media_processor(self, artifact):
        """Qwen3.5's image/video preprocessing for an artifact with a vision tower, else None."""
        if "vision" not in (getattr(artifact, "components", None) or []):
            return None
        from ninfer_qwen35.media import Qwen35MediaProcessor

        return Qwen35MediaProcessor(artifact.config)

    def vision_tower(self, artifact, device: str, dtype=None):
        """The tower over `device` in `dtype` (default: the text model's run dtype there)."""
        from ninfer_qwen35.vision import Qwen35VisionTower, load_vision_model

        dev = torch.device(device)
        dt = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, dev)
        return Qwen35VisionTower(load_vision_model(artifact, dev, dt), dev)

    def random_artifact(self, hf_config: dict, device: str = "cuda", seed: int = 0, **kw):
        """An artifact-like source of random weights at `hf_config`'s shape, drawn on `device`
        as the loader asks for them (`ninfer bench`; nothing is written)."""
        import torch

        from ninfer_qwen35.gpu.random_model import RandomArtifact
        from ninfer_qwen35.testing import minimal_tokenizer_section

        kw.setdefault("tokenizer_section", minimal_tokenizer_section())
        kw.setdefault("chat_template", QWEN35_TEMPLATE)
        dev = torch.device(device)
        return RandomArtifact(hf_config, device=dev, dtype=resolve_dtype(None, dev), seed=seed, **kw)

    def transformers_model(self, runner, hf_config: dict):
        """transformers' model of the same family sharing `runner`'s weight tensors (no copy)."""
        from ninfer_qwen35.gpu.random_model import transformers_model

        return transformers_model(runner, hf_config)


def _text_state(artifact, names: list[str], cfg: Qwen35Config) -> dict[str, torch.Tensor]:
    prefix = next((p for p in TEXT_PREFIXES if any(n.startswith(p + "layers.") for n in names)), None)
    if prefix is None:
        raise LoadError(
            "no text-model layers found (expected model.language_model.layers.* or model.layers.*)"
        )
    state = {}
    for n in names:
        if n.startswith(prefix):
            state[n[len(prefix) :]] = artifact.get_tensor(n)
        elif n == "lm_head.weight":
            state[n] = artifact.get_tensor(n)
    return fuse_experts(state)


def _encoded_state(artifact, names: list[str], dtype, device) -> dict:
    """{param name: QuantizedWeight} of the artifact's encoded text weights (per-expert weights
    fused into the [E, 2I, H] / [E, H, I] layout by stacking their packed rows and scales)."""
    table = (getattr(artifact, "manifest", None) or {}).get("tensors", {})  # artifact-like sources may have none
    enc_names = [n for n in names if (table.get(n) or {}).get("scale")]
    if not enc_names:
        return {}
    prefix = next((p for p in TEXT_PREFIXES if any(n.startswith(p + "layers.") for n in names)), "")
    state = {}
    for n in enc_names:
        key = n.removeprefix(prefix)
        state[key] = encoded_weight(artifact, n, dtype, device)
    return fuse_experts(state)


def _assign_encoded(module: torch.nn.Module, encoded: dict) -> None:
    params = dict(module.named_parameters())
    for name, w in encoded.items():
        p = params.get(name)
        if p is None:
            raise LoadError(f"encoded weight {name} does not fit the config: the model has no such parameter")
        if tuple(w.shape) != tuple(p.shape):
            raise LoadError(f"{name}: stored shape {tuple(w.shape)}, config expects {tuple(p.shape)}")
        set_weight(module, name, w)
