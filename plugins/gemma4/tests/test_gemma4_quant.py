"""Gemma 4 with quantised weights and KV: `ninfer convert --quantize` artifacts load with their
projections (attention, MLP, the fused MoE experts) as QuantizedWeights and track the float model;
`--kv-dtype int8|fp8|k8v4` stores the global layers' pages quantised (fewer bytes per token, page
data that round-trips and is refused by a cache of another dtype); the GPU path's attention over
those pages (interpreted Triton) equals the reference; `ninfer serve` answers with both."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch
from gemma4_test_support import plugin_flags
from ninfer_gemma4.family import Gemma4Family

from ninfer_core.artifact import Artifact
from ninfer_core.artifact.convert import _encoding_of, convert_artifact
from ninfer_core.engine.model_api import DECODE, LOGITS_ALL, ForwardBatch, LaneSegment
from ninfer_core.quant.kv import BF16, FP8, INT8, K8V4, KVFormat
from ninfer_core.quant.weight import QuantizedWeight

IDS = [int(x) for x in torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(5))]


def _run(r):
    """A batch of two prefills (one past the window), then two decode steps: fp32 logits."""
    r.allocate_cache(12, 2, page_size=16)
    groups = r.cache_spec().group_names
    tab = {i: {g: list(range(i * 5, i * 5 + 5)) for g in groups} for i in range(2)}
    prompts = [IDS[:30], IDS[4:11]]
    outs = [o.logits for o in r.forward(ForwardBatch(
        [LaneSegment(i, tab[i], 0, p, logits=LOGITS_ALL) for i, p in enumerate(prompts)]))]
    for step in range(2):
        outs += [o.logits[None] for o in r.forward(ForwardBatch(
            [LaneSegment(i, tab[i], len(prompts[i]) + step, [IDS[32 + step]], DECODE) for i in range(2)]))]
    return torch.cat(outs)


def _logits(path, **opts):
    r = Gemma4Family().load(Artifact.open(str(path)), options=argparse.Namespace(**opts))
    return r, _run(r)


def _dequantised_twin(src, encoded_runner):
    """The float model of `src` with every weight the encoded runner holds encoded replaced by its
    dequantised values: what the encoded model must compute (random weights magnify any noise,
    so the float model itself is no tight reference)."""
    from ninfer_core.quant.transform import named_weights

    twin = Gemma4Family().load(Artifact.open(str(src)))
    params = dict(twin.model.named_parameters())
    n = 0
    for name, w in named_weights(encoded_runner.model):
        if isinstance(w, QuantizedWeight):
            params[name].data.copy_(w.dequantize(torch.float32))
            n += 1
    assert n
    return twin


@pytest.mark.parametrize("kind", ["e2b", "26b-a4b"])
def test_encoded_artifacts_load_and_track_the_float_model(gemma_artifacts, tmp_path, kind):
    src = gemma_artifacts[kind]
    plain, base = _logits(src)
    for q in ("int8", "int4", "fp8"):
        out = str(tmp_path / f"{q}.ninfer")
        manifest = convert_artifact(src, out, encoding=_encoding_of(argparse.Namespace(quantize=q, group_size=32)))
        encoded = {n for n, e in manifest["tensors"].items() if e.get("scale")}
        assert encoded and not any("embed" in n or "lm_head" in n for n in encoded)
        r, got = _logits(out)
        attn = r.model.layers[0].self_attn
        assert isinstance(attn.q_proj.weight, QuantizedWeight) and isinstance(attn.o_proj.weight, QuantizedWeight)
        assert isinstance(r.model.layers[0].mlp.down_proj.weight, QuantizedWeight)
        if kind == "26b-a4b":
            experts = [m for m in r.model.modules() if hasattr(m, "gate_up_proj")]
            assert experts and all(isinstance(m.gate_up_proj, QuantizedWeight) and isinstance(m.down_proj, QuantizedWeight)
                                   for m in experts)
        assert r.info.n_params == plain.info.n_params  # encoded weights counted
        want = _run(_dequantised_twin(src, r))
        assert float((got - want).abs().max() / want.abs().max()) < 1e-4, q
        assert float((got - base).abs().max()) > 0  # and the encoding is really there


def test_quantize_at_load_and_head_encodings(gemma_artifacts):
    from ninfer_core.quant.transform import convert_encoding

    src = gemma_artifacts["e2b"]
    r, got = _logits(src, quantize=convert_encoding("int8", 32))  # `ninfer bench --quantize`
    assert isinstance(r.model.layers[1].self_attn.q_proj.weight, QuantizedWeight)
    want = _run(_dequantised_twin(src, r))
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    r, _ = _logits(src, embedding_q="q6")
    emb = r.model.embed_tokens.weight
    assert isinstance(emb, QuantizedWeight) and emb.enc.name == "q6-g32"
    assert not isinstance(r.model.lm_head.weight, QuantizedWeight)  # the tied head keeps the float table


@pytest.mark.parametrize("kind", ["e2b", "26b-a4b"])
def test_kv_dtypes_track_bf16_and_refuse_another_dtypes_pages(gemma_artifacts, kind):
    src = gemma_artifacts[kind]
    ref, base = _logits(src, kv_dtype=BF16)
    bf16_pages = ref.read_pages([0, 1])
    first = min(int(n.split(".")[1]) for n in bf16_pages)  # the first global layer: its inputs match bf16's
    drifts = {}
    for fmt, bound, row_tol in ((INT8, 0.05, 0.01), (FP8, 0.12, 0.07), (K8V4, 0.4, 0.15)):
        r, got = _logits(src, kv_dtype=fmt)
        assert r.info.extra["kv_dtype"] == fmt.name and r.kv_scale
        # the median over positions of the max relative drift (a random MoE's routing flips at a few)
        per_pos = (got - base).abs().amax(-1) / base.abs().amax(-1)
        drifts[fmt.name] = drift = float(per_pos.median())
        assert 0 < drift < bound, (fmt.name, drift)
        stored = r.read_pages([0, 1])
        for side, skind in (("k", fmt.k_kind), ("v", fmt.v_kind)):  # the rows written are bf16's, encoded
            want = bf16_pages[f"{side}.{first}"]
            back = KVFormat.decode(skind, stored[f"{side}.{first}"], stored[f"{side}s.{first}"], torch.float32)
            amax = want.abs().amax(-1, keepdim=True).clamp_min(1e-6)
            assert float(((back - want).abs() / amax).max()) < row_tol, (fmt.name, side)
        assert r.cache_spec().kv_bytes_per_token < ref.cache_spec().kv_bytes_per_token
        pages = r.read_pages([0, 1])
        assert {n.split(".")[0] for n in pages} == {"k", "v", "ks", "vs"}
        r.write_pages([7, 8], pages)  # its own pages round-trip, fp8 bytes included
        again = r.read_pages([7, 8])
        assert all(torch.equal(again[n].view(torch.uint8), v.view(torch.uint8)) for n, v in pages.items())
        with pytest.raises(ValueError, match=f"another --kv-dtype than this cache's {fmt.name}"):
            r.write_pages([7, 8], bf16_pages)
        with pytest.raises(ValueError, match="bf16"):
            ref.write_pages([7, 8], pages)
        r.copy_page(0, 9)
        assert torch.equal(r.read_pages([9])[f"ks.{first}"], pages[f"ks.{first}"][:1])
    assert drifts["int8"] < drifts["k8v4"]


KERNEL_CASE = r"""
import argparse, tempfile
import torch
from ninfer_gemma4 import attention, layers
from ninfer_gemma4.family import Gemma4Family
from ninfer_core.artifact import Artifact
from ninfer_core.quant.kv import FP8, INT8, K8V4
import test_gemma4_quant as T

kernel = attention.use_triton
worst = 0.0
for path, fmts in zip({paths!r}, ((INT8, FP8, K8V4), (K8V4,))):
    for fmt in fmts:
        outs = []
        for use in (lambda t: False, kernel):
            attention.use_triton = use
            try:
                outs.append(T._logits(path, kv_dtype=fmt)[1])
            finally:
                attention.use_triton = kernel
        err = float((outs[1] - outs[0]).abs().max() / outs[0].abs().max())
        worst = max(worst, err)
        # the two paths agree to fp32 rounding, but a rounding difference can move a later layer's
        # K/V value across a quantisation step (~1/254 of its row): a wrong kernel errs by O(1)
        assert err < 1e-2, (path, fmt.name, err)
print(f"gemma4 quantised KV kernel path: worst {{worst:.2e}}")
"""


def test_gpu_attention_over_quantised_pages_matches_the_reference_under_the_interpreter(gemma_artifacts):
    pytest.importorskip("triton")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = KERNEL_CASE.format(paths=[str(gemma_artifacts[k]) for k in ("e2b", "26b-a4b")])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "gemma4 quantised KV kernel path: worst" in r.stdout


def test_serve_a_quantised_artifact_with_quantised_kv(gemma_artifacts, launch, tmp_path):
    openai = pytest.importorskip("openai")
    out = tmp_path / "int8.ninfer"
    run = [sys.executable, "-m", "ninfer_core.cli", *plugin_flags()]
    c = subprocess.run([*run, "convert", str(gemma_artifacts["26b-a4b"]), str(out), "--quantize", "int8",
                        "--group-size", "32", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert c.returncode == 0, c.stderr
    (tmp_path / "logs").mkdir()
    s = launch(str(out), *plugin_flags(), "--greedy", "--kv-dtype", "k8v4", log_dir=tmp_path / "logs")
    try:
        client = openai.OpenAI(base_url=s.api_base, api_key="none", max_retries=0)
        r = client.chat.completions.create(model=client.models.list().data[0].id,
                                           messages=[{"role": "user", "content": "Hello"}], max_tokens=8)
        assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("length", "stop")
        bad = subprocess.run([*run, "serve", str(out), "--kv-dtype", "nvfp4", "--port", "0"], capture_output=True,
                             text=True, timeout=120)
        assert bad.returncode != 0 and "--kv-dtype nvfp4 is not built yet" in bad.stderr + bad.stdout
    finally:
        s.stop()
