"""Gemma4Family: builds a Gemma 4 (dense, PLE or MoE) runner from an artifact.

Loading follows the Qwen3.5 family: modules are built on the meta device, then the artifact's
memory-mapped tensors are assigned by name (cast to the run dtype). Both Hugging Face layouts load:
`model.language_model.*` (Gemma4ForConditionalGeneration, the published checkpoints) and `model.*`
(Gemma4ForCausalLM). Vision and audio towers (`model.vision_tower.*`, `model.embed_vision.*`,
`model.audio_tower.*`, `model.embed_audio.*`) are not loaded by the text model; `--vision` loads
the vision tower and its embedder through `vision_tower` (ninfer_gemma4.vision). Checkpoints that
still carry K/V projections for KV-shared layers have them dropped, as transformers does.
Encoded weights (`ninfer convert --quantize`) are swapped in as QuantizedWeights after the model is
built, so every projection (attention, MLP, the fused MoE experts) runs through the dequantising
linear; `--kv-dtype` picks the global layers' page format (runner.py).
"""

from __future__ import annotations

import re

import torch

from ninfer_core.accel import resolve_dtype
from ninfer_core.engine.model_api import ModelFamily
from ninfer_core.quant.kv import kv_format
from ninfer_core.quant.transform import apply_load_encodings, assign_encoded, quantize_model, split_encoded
from ninfer_gemma4.chat import GEMMA4_TEMPLATE
from ninfer_gemma4.config import Gemma4Config
from ninfer_gemma4.model import Gemma4TextModel
from ninfer_gemma4.runner import Gemma4Runner

TEXT_PREFIXES = ("model.language_model.", "model.")
MEDIA_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")
_SHARED_KV = re.compile(r"^layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")
class LoadError(ValueError):
    """The artifact's tensors do not fit the model its config describes."""


class Gemma4Family(ModelFamily):
    name = "gemma4"
    chat_template = GEMMA4_TEMPLATE  # stored by `ninfer convert` when a checkpoint has none

    def load(self, artifact, device: str = "cpu", dtype: str | None = None, options=None) -> Gemma4Runner:
        dev = torch.device(device)
        run_dtype = resolve_dtype(dtype, dev)
        cfg = Gemma4Config.from_hf(artifact.config, getattr(artifact, "architecture", None))
        with torch.device("meta"):
            model = Gemma4TextModel(cfg)
        state = text_state(artifact, cfg)
        prefix = _text_prefix(artifact)
        encoded = split_encoded(artifact, state, lambda n: n.removeprefix(prefix))
        tied = cfg.tie_word_embeddings or ("lm_head.weight" not in state and "lm_head.weight" not in encoded)
        if tied:
            state.pop("lm_head.weight", None)
        assign(model, state, run_dtype, dev, skip=set(encoded) | ({"lm_head.weight"} if tied else set()))
        assign_encoded(model, artifact, encoded, run_dtype, dev)
        if tied:
            model.lm_head.weight = model.embed_tokens.weight
        apply_load_encodings(model, options)  # --lm-head-q4|q6, --embedding-q4|q6
        if getattr(options, "quantize", None) is not None:  # `ninfer bench --quantize` (random weights)
            quantize_model(model, options.quantize)
        model.init_rotary(dev)
        return Gemma4Runner(model, cfg, dev, run_dtype, eos_token_ids=_eos_ids(artifact),
                            kv_format=kv_format(getattr(options, "kv_dtype", None)))

    # ---- pipeline stages (ninfer_core.engine.pipeline; ninfer_gemma4.stage) ---------------------
    def pipeline_layers(self, artifact) -> int:
        return Gemma4Config.from_hf(artifact.config, getattr(artifact, "architecture", None)).num_hidden_layers

    def pipeline_cuts(self, artifact):
        from ninfer_gemma4.stage import stage_cuts

        return stage_cuts(Gemma4Config.from_hf(artifact.config, getattr(artifact, "architecture", None)))

    def load_stage(self, artifact, layers: range, device: str = "cpu", dtype: str | None = None, options=None):
        """A stage runner over the decoder layers `layers`: only their tensors are read, the first
        stage's embeddings and per-layer input tables, the last stage's norm and LM head."""
        from ninfer_gemma4.stage import Gemma4StageRunner, stage_cuts

        dev = torch.device(device)
        run_dtype = resolve_dtype(dtype, dev)
        cfg = Gemma4Config.from_hf(artifact.config, getattr(artifact, "architecture", None))
        n = cfg.num_hidden_layers
        if not (0 <= layers.start < layers.stop <= n and layers.step == 1):
            raise LoadError(f"stage layers {layers.start}..{layers.stop - 1} outside the model's {n} layers")
        if layers.start and layers.start not in stage_cuts(cfg):
            raise LoadError(f"a stage cannot start at layer {layers.start}: a later layer reads the K/V of a layer "
                            "before it")
        first, last = layers.start == 0, layers.stop == n

        def wanted(name: str) -> bool:
            m = re.match(r"layers\.(\d+)\.", name)
            if m is not None:
                return int(m.group(1)) in layers
            if name == "embed_tokens.weight":
                return first or last  # the last stage's tied LM head
            if name.startswith("norm.") or name == "lm_head.weight":
                return last
            return first  # the per-layer input tables and projection

        state = text_state(artifact, cfg, wanted)
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in state
        if tied:
            state.pop("lm_head.weight", None)
            if last and not first:
                state["lm_head.weight"] = state.pop("embed_tokens.weight")
        elif not first:
            state.pop("embed_tokens.weight", None)
        with torch.device("meta"):
            model = Gemma4TextModel(cfg)
        for i in range(n):
            if i not in layers:
                model.layers[i] = torch.nn.Identity()  # held by another stage
        if not first:
            model.embed_tokens = None
            for name in ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm"):
                if hasattr(model, name):
                    setattr(model, name, None)
        if not last:
            model.norm = model.lm_head = None
        share = first and last and tied
        assign(model, state, run_dtype, dev, skip={"lm_head.weight"} if share else set())
        if share:
            model.lm_head.weight = model.embed_tokens.weight
        model.init_rotary(dev)
        return Gemma4StageRunner(model, cfg, dev, run_dtype, layers, eos_token_ids=_eos_ids(artifact))

    # ---- vision (model.vision_tower.*, model.embed_vision.*; ninfer_core.media) -------------------
    def media_processor(self, artifact):
        """Gemma 4's image/video preprocessing for an artifact with a vision tower, else None."""
        if "vision" not in (getattr(artifact, "components", None) or []) or not artifact.config.get("vision_config"):
            return None
        from ninfer_gemma4.media import Gemma4MediaProcessor

        return Gemma4MediaProcessor(artifact.config)

    def vision_tower(self, artifact, device: str, dtype=None):
        """The tower (and its embedder) over `device` in `dtype` (default: the run dtype there)."""
        from ninfer_gemma4.vision import Gemma4VisionTower, load_vision_model

        dev = torch.device(device)
        dt = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, dev)
        return Gemma4VisionTower(load_vision_model(artifact, dev, dt), dev)

    def random_artifact(self, hf_config: dict, device: str = "cuda", seed: int = 0, **kw):
        """An artifact-like source of random weights at `hf_config`'s shape, drawn on `device` as
        the loader asks for them (`ninfer bench`; nothing is written)."""
        from ninfer_gemma4.gpu.random_model import RandomArtifact
        from ninfer_gemma4.test_tokenizer import tokenizer_section

        kw.setdefault("tokenizer_section", tokenizer_section())
        kw.setdefault("chat_template", GEMMA4_TEMPLATE)
        dev = torch.device(device)
        return RandomArtifact(hf_config, device=dev, dtype=resolve_dtype(None, dev), seed=seed, **kw)

    def transformers_model(self, runner, hf_config: dict):
        """transformers' model of the same weights, sharing `runner`'s tensors (no copy)."""
        from ninfer_gemma4.gpu.random_model import transformers_model

        return transformers_model(runner, hf_config)

    def chat_format(self, artifact):
        from ninfer_gemma4.chat import GEMMA4_CHAT_FORMAT

        return GEMMA4_CHAT_FORMAT

    def sampling_presets(self, architecture: str) -> dict | None:
        from ninfer_gemma4.chat import SAMPLING_PRESET

        return {"thinking": dict(SAMPLING_PRESET), "non_thinking": dict(SAMPLING_PRESET)}


def _eos_ids(artifact) -> tuple[int, ...]:
    tok = getattr(artifact, "tokenizer_section", None)
    if not isinstance(tok, dict):
        return ()
    by_text = {t.get("content"): t.get("id") for t in tok.get("added_tokens", [])}
    return tuple(by_text[e] for e in tok.get("eos_tokens", []) if by_text.get(e) is not None)


def _text_prefix(artifact) -> str:
    names = [n for n in artifact.tensor_names() if not n.startswith(MEDIA_PREFIXES)]
    prefix = next((p for p in TEXT_PREFIXES if any(n.startswith(p + "layers.") for n in names)), None)
    if prefix is None:
        raise LoadError("no text-model layers found (expected model.language_model.layers.* or model.layers.*)")
    return prefix


def text_state(artifact, cfg: Gemma4Config, wanted=None) -> dict[str, torch.Tensor]:
    """The text model's tensors by their model names; `wanted(name)` (a pipeline stage) picks
    which are read at all."""
    names = [n for n in artifact.tensor_names() if not n.startswith(MEDIA_PREFIXES)]
    prefix = _text_prefix(artifact)
    state = {}
    for n in names:
        if n.startswith(prefix):
            short = n[len(prefix):]
            m = _SHARED_KV.match(short)
            if m and cfg.shares_kv(int(m.group(1))):
                continue
            if wanted is None or wanted(short):
                state[short] = artifact.get_tensor(n)
        elif n == "lm_head.weight" and (wanted is None or wanted(n)):
            state[n] = artifact.get_tensor(n)
    return state


def assign(module: torch.nn.Module, state: dict, dtype: torch.dtype, device: torch.device, skip=()) -> None:
    expected = {n: p for n, p in module.named_parameters() if n not in skip}
    buffers = dict(module.named_buffers())
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected) - set(buffers))
    if missing or unexpected:
        raise LoadError(
            f"weights do not match the config: missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    for name, param in expected.items():
        t = state[name]
        if tuple(t.shape) != tuple(param.shape):
            raise LoadError(f"{name}: stored shape {tuple(t.shape)}, config expects {tuple(param.shape)}")
        owner, _, leaf = name.rpartition(".")
        mod = module.get_submodule(owner) if owner else module
        setattr(mod, leaf, torch.nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False))
    for name, buf in buffers.items():  # layer_scalar: stored by transformers, ones when absent
        owner, _, leaf = name.rpartition(".")
        mod = module.get_submodule(owner) if owner else module
        value = state.get(name)
        if value is not None and tuple(value.shape) != tuple(buf.shape):
            raise LoadError(f"{name}: stored shape {tuple(value.shape)}, config expects {tuple(buf.shape)}")
        mod.register_buffer(leaf, (value if value is not None else torch.ones(buf.shape)).to(device=device, dtype=dtype))
