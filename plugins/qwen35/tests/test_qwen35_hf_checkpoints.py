"""Artifacts made from transformers' own `save_pretrained` output load and match transformers.

Covers the names real checkpoints use: `model.language_model.*` with `model.visual.*` beside it
(Qwen3_5(Moe)ForConditionalGeneration), `model.*` (the CausalLM), and per-expert MoE weights,
which is how transformers saves the fused experts.
"""

import json
import os

import pytest
import torch
from ninfer_qwen35.family import Qwen35Family
from ninfer_qwen35.testing import build_tiny_artifact, minimal_tokenizer_section
from qwen35_hf_reference import rel_err
from safetensors import safe_open

from ninfer_core.artifact import Artifact, TensorSpec, write_artifact
from ninfer_core.engine.model_api import SeqView

TOKS = [7, 300, 12, 45, 499, 3, 3, 250, 128, 64, 77, 11, 190, 401, 2, 9, 33]
TINY_VISION = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64}


def artifact_from_hf_dir(hf_dir, out):
    """A .ninfer from a saved HF directory: config.json as is, every tensor under its own name."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    specs = []
    for fname in sorted(os.listdir(hf_dir)):
        if fname.endswith(".safetensors"):
            h = safe_open(os.path.join(hf_dir, fname), framework="pt")
            for n in h.keys():  # noqa: SIM118 - safe_open handles are not iterable
                t = h.get_tensor(n)
                specs.append(TensorSpec(n, t.dtype, tuple(t.shape), lambda t=t: t))
    manifest = {
        "architecture": config["model_type"],
        "config": config,
        "tokenizer": minimal_tokenizer_section(),
    }
    write_artifact(out, manifest, specs)
    return Artifact.open(out)


def our_logits(art):
    r = Qwen35Family().load(art)
    r.allocate_cache(2, 1)
    return r.prefill(SeqView(0, [0], 0), TOKS, all_logits=True)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_conditional_generation_checkpoint(tmp_path, kind):
    import transformers as tr

    src = Artifact.open(build_tiny_artifact(tmp_path / "src.ninfer", kind=kind, seed=31, mtp=False))
    text = {k: v for k, v in src.config["text_config"].items() if k != "model_type"}
    cfg_cls, model_cls = (
        (tr.Qwen3_5Config, tr.Qwen3_5ForConditionalGeneration)
        if kind == "dense"
        else (tr.Qwen3_5MoeConfig, tr.Qwen3_5MoeForConditionalGeneration)
    )
    cfg = cfg_cls(text_config=text, vision_config=TINY_VISION)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = model_cls(cfg).eval()
    missing, unexpected = hf.load_state_dict({n: src.get_tensor(n) for n in src.tensor_names()}, strict=False)
    assert not unexpected and all(m.startswith("model.visual.") for m in missing)
    hf.save_pretrained(tmp_path / "hf")
    art = artifact_from_hf_dir(tmp_path / "hf", tmp_path / "conv.ninfer")
    assert art.architecture == cfg.model_type and "vision" in art.components
    if kind == "moe":
        assert art.has_tensor("model.language_model.layers.0.mlp.experts.0.gate_proj.weight")
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([TOKS]), use_cache=False).logits[0].float()
    err = rel_err(our_logits(art), ref)
    print(f"PARITY {kind:5s} HF ConditionalGeneration save  max rel err {err:.2e}")
    assert err <= 1e-4


def test_moe_causal_lm_checkpoint(tmp_path):
    from qwen35_hf_reference import hf_causal_lm, hf_logits

    src = Artifact.open(build_tiny_artifact(tmp_path / "src.ninfer", kind="moe", seed=32, layout="flat"))
    hf = hf_causal_lm(src)
    hf.save_pretrained(tmp_path / "hf")
    art = artifact_from_hf_dir(tmp_path / "hf", tmp_path / "conv.ninfer")
    assert art.architecture == "qwen3_5_moe_text"
    err = rel_err(our_logits(art), hf_logits(hf, TOKS))
    print(f"PARITY moe   HF CausalLM save               max rel err {err:.2e}")
    assert err <= 1e-4
