"""Checkpoint layouts, tying, dtypes and load errors."""

import pytest
import torch
from ninfer_qwen35.family import LoadError, Qwen35Family, resolve_dtype
from ninfer_qwen35.testing import build_tiny_artifact
from qwen35_hf_reference import hf_causal_lm, hf_logits, rel_err

from ninfer_core.artifact import Artifact
from ninfer_core.engine.model_api import SeqView

TOKS = [3, 141, 59, 265, 358, 97, 93, 238, 462, 64, 33, 83, 279, 502, 88]


def load(path, dtype=None):
    r = Qwen35Family().load(Artifact.open(path), dtype=dtype)
    r.allocate_cache(4, 1)
    return r


def logits_of(path, dtype=None):
    return load(path, dtype).prefill(SeqView(0, [1], 0), TOKS, all_logits=True)


def _weights(runner) -> dict:
    return {n: p.detach().clone() for n, p in runner.model.named_parameters()}


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_layouts_load_the_same_weights(tmp_path, kind):
    # The loaded parameters must be bit-identical. The logits only close: the CPU matmul kernels
    # may round differently for memory-mapped tensors at other file offsets (alignment), which
    # made a bitwise logits comparison fail on some hosts for the MoE layouts.
    paths = {"nested": build_tiny_artifact(tmp_path / "n.ninfer", kind=kind, seed=5),
             "flat": build_tiny_artifact(tmp_path / "f.ninfer", kind=kind, seed=5, layout="flat")}
    if kind == "moe":
        paths["per_expert"] = build_tiny_artifact(tmp_path / "p.ninfer", kind=kind, seed=5,
                                                  expert_layout="per_expert")
    runners = {k: load(p) for k, p in paths.items()}
    logits = {k: r.prefill(SeqView(0, [1], 0), TOKS, all_logits=True) for k, r in runners.items()}
    ref = _weights(runners["nested"])
    for name, r in runners.items():
        got = _weights(r)
        assert got.keys() == ref.keys(), name
        for n in ref:
            assert torch.equal(got[n], ref[n]), (name, n)
        torch.testing.assert_close(logits[name], logits["nested"], rtol=1e-5, atol=1e-5)


def test_flat_layout_architecture_and_text_only_artifact(tmp_path):
    path = build_tiny_artifact(tmp_path / "f.ninfer", kind="moe", layout="flat", mtp=False)
    art = Artifact.open(path)
    assert art.architecture == "qwen3_5_moe_text" and art.components == ["text"]
    r = Qwen35Family().load(art)
    assert r.mtp is None and r.info.extra["moe"]


def test_tied_embeddings_match_transformers(tmp_path):
    art = Artifact.open(build_tiny_artifact(tmp_path / "t.ninfer", tie_word_embeddings=True, seed=7))
    assert "lm_head.weight" not in art.tensor_names()
    r = Qwen35Family().load(art)
    assert r.model.lm_head.weight is r.model.embed_tokens.weight
    r.allocate_cache(4, 1)
    out = r.prefill(SeqView(0, [0], 0), TOKS, all_logits=True)
    assert rel_err(out, hf_logits(hf_causal_lm(art), TOKS)) <= 1e-4


def test_bf16_run_is_close_and_logits_are_fp32(tmp_path):
    path = build_tiny_artifact(tmp_path / "d.ninfer", seed=8)
    ref = logits_of(path)
    out = logits_of(path, dtype="bfloat16")
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < 0.1


def test_dtype_names():
    cpu = torch.device("cpu")
    assert resolve_dtype(None, cpu) is torch.float32
    assert resolve_dtype(None, torch.device("cuda")) is torch.bfloat16
    assert resolve_dtype("bf16", cpu) is torch.bfloat16 and resolve_dtype(torch.float16, cpu) is torch.float16
    with pytest.raises(ValueError):
        resolve_dtype("int3", cpu)


class _FakeArtifact:
    """Just the Artifact surface the family reads, over a dict."""

    def __init__(self, art, drop=(), change=None):
        self.config, self.architecture, self.tokenizer_section = (
            art.config,
            art.architecture,
            art.tokenizer_section,
        )
        self._t = {n: art.get_tensor(n) for n in art.tensor_names() if n not in drop}
        self._t.update(change or {})

    def tensor_names(self, component=None):
        return list(self._t)

    def get_tensor(self, name):
        return self._t[name]


def test_missing_and_misshapen_weights_are_reported(tmp_path):
    art = Artifact.open(build_tiny_artifact(tmp_path / "d.ninfer", seed=9))
    name = "model.language_model.layers.0.linear_attn.A_log"
    with pytest.raises(LoadError, match="missing"):
        Qwen35Family().load(_FakeArtifact(art, drop=[name]))
    with pytest.raises(LoadError, match="shape"):
        Qwen35Family().load(_FakeArtifact(art, change={name: torch.zeros(3)}))
