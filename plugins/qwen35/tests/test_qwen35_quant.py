"""Quantised Qwen3.5 artifacts end to end: convert -> inspect -> load (dense, MoE fused and per
expert) -> serve with the openai client; KV dtypes in the runner and their refused restores."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch
from ninfer_qwen35.family import Qwen35Family
from ninfer_qwen35.testing import build_tiny_artifact

from ninfer_core.artifact import Artifact
from ninfer_core.artifact.convert import _encoding_of, convert_artifact
from ninfer_core.engine.model_api import SeqView
from ninfer_core.quant.kv import BF16, FP8, INT8, K8V4
from ninfer_core.quant.weight import QuantizedWeight

DRIFT = {"int8": 0.05, "fp8": 0.5, "int4": 1.0}  # of the max |logit|, random weights amplify noise


def _logits(path, **opts):
    r = Qwen35Family().load(Artifact.open(path), options=argparse.Namespace(**opts))
    r.allocate_cache(8, 2)
    seq = SeqView(0, list(range(8)), 0)
    first = r.prefill(seq, list(range(1, 70)))
    seq.num_cached = 69
    return r, torch.stack([first, r.decode([seq], [7])[0]])


@pytest.mark.parametrize("kind,layout", [("dense", "fused"), ("moe", "fused"), ("moe", "per_expert")])
def test_encoded_artifacts_load_and_track_the_float_model(tmp_path, kind, layout):
    src = build_tiny_artifact(str(tmp_path / "src.ninfer"), kind=kind, expert_layout=layout, hidden=128)
    _, base = _logits(src)
    for q in ("int8", "int4", "fp8"):
        out = str(tmp_path / f"{q}.ninfer")
        manifest = convert_artifact(src, out, encoding=_encoding_of(argparse.Namespace(quantize=q, group_size=32)))
        encoded = {n: e for n, e in manifest["tensors"].items() if e.get("scale")}
        assert encoded and all(e["encoding"].startswith({"fp8": "fp8_e4m3"}.get(q, q)) for e in encoded.values())
        assert not any("embed" in n or "lm_head" in n or n.startswith("mtp.") for n in encoded)
        art = Artifact.open(out)
        assert art.num_parameters() == Artifact.open(src).num_parameters()
        r, got = _logits(out)
        experts = [m.gate_up_proj for m in r.model.modules() if hasattr(m, "gate_up_proj")]
        assert all(isinstance(w, QuantizedWeight) for w in experts)
        assert isinstance(r.model.layers[3].self_attn.q_proj.weight, QuantizedWeight)
        drift = float((got - base).abs().max() / base.abs().max())
        assert 0 < drift < DRIFT[q], (q, drift)


def test_convert_cli_and_inspect_show_the_encoding(tmp_path):
    src = build_tiny_artifact(str(tmp_path / "src.ninfer"), hidden=128)
    out = tmp_path / "q.ninfer"
    run = [sys.executable, "-m", "ninfer_core.cli"]
    r = subprocess.run([*run, "convert", src, str(out), "--quantize", "int4", "--group-size", "64", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([*run, "inspect", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "int4-g64 (" in r.stdout, r.stdout
    bad = subprocess.run([*run, "convert", src, str(tmp_path / "b.ninfer"), "--quantize", "int4", "--group-size", "48"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "--group-size 48: choose one of 32, 64, 128" in bad.stderr
    again = subprocess.run([*run, "convert", str(out), str(tmp_path / "c.ninfer"), "--quantize", "int8"],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and "already quantised" in again.stderr


def test_kv_dtypes_track_bf16_and_refuse_another_dtypes_pages(tmp_path):
    src = build_tiny_artifact(str(tmp_path / "src.ninfer"), hidden=128)
    ref, base = _logits(src, kv_dtype=BF16)
    bf16_pages = ref.read_pages([0, 1])
    for fmt, bound in ((INT8, 0.01), (FP8, 0.05), (K8V4, 0.05)):
        r, got = _logits(src, kv_dtype=fmt)
        drift = float((got - base).abs().max() / base.abs().max())
        assert 0 < drift < bound, (fmt.name, drift)
        assert r.cache_spec().kv_bytes_per_token < ref.cache_spec().kv_bytes_per_token
        pages = r.read_pages([0, 1])
        r.write_pages([2, 3], pages)  # its own pages round-trip
        assert all(torch.equal(r.read_pages([2, 3])[n].view(torch.uint8) if v.dtype == torch.float8_e4m3fn
                               else r.read_pages([2, 3])[n], v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn
                               else v) for n, v in pages.items())
        with pytest.raises(ValueError, match=f"another --kv-dtype than this cache's {fmt.name}"):
            r.write_pages([2, 3], bf16_pages)
        with pytest.raises(ValueError, match="bf16"):
            ref.write_pages([2, 3], pages)


def test_gdn_state_fp16_halves_the_state_image_and_refuses_fp32_images(tmp_path):
    src = build_tiny_artifact(str(tmp_path / "src.ninfer"), hidden=128)
    full, _ = _logits(src)
    half, _ = _logits(src, gdn_state_fp16=True)
    a, b = full.capture_state(0), half.capture_state(0)
    ssm = [n for n in a.tensors if n.startswith("ssm.")]
    assert all(b.tensors[n].dtype == torch.float16 for n in ssm)
    assert sum(b.tensors[n].nbytes for n in ssm) * 2 == sum(a.tensors[n].nbytes for n in ssm)
    assert half.cache_spec().state_bytes < full.cache_spec().state_bytes
    half.restore_state(b, 1)
    with pytest.raises(ValueError, match="--gdn-state-fp16 differs"):
        half.restore_state(a, 1)


def test_load_time_head_and_embedding_encodings(tmp_path):
    src = build_tiny_artifact(str(tmp_path / "src.ninfer"), hidden=128)
    _, base = _logits(src)
    r, got = _logits(src, lm_head_q="q6", embedding_q="q4")
    assert isinstance(r.model.lm_head.weight, QuantizedWeight) and r.model.lm_head.weight.enc.name == "q6-g32"
    assert isinstance(r.model.embed_tokens.weight, QuantizedWeight) and r.model.embed_tokens.weight.enc.scheme == "q4"
    assert 0 < float((got - base).abs().max() / base.abs().max()) < 1.0


def test_bench_runs_with_quantised_weights_and_kv(tmp_path):
    """`ninfer bench --quantize int8 --kv-dtype int8` (gpu_check --order quant's long-context run), on
    the CPU: the JSON names both and the long decode ran over the int8 pages."""
    import json

    src = build_tiny_artifact(str(tmp_path / "src.ninfer"), hidden=128)
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "bench", "--shape", src, "--device", "cpu",
                        "--quantize", "int8", "--kv-dtype", "int8", "--prefill-lens", "", "--decode-batches", "1",
                        "--decode-steps", "2", "--decode-prompt", "16", "--long-context", "80", "--long-chunk", "64",
                        "--repeats", "1", "--no-hf", "--http-clients", "", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["kv_dtype"] == "int8" and res["quantize"] == "int8-g128"
    assert res["decode_long"]["total_tok_s"] > 0 and res["decode_long"]["context"] >= 80
    bad = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "bench", "--kv-dtype", "nvfp4"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--kv-dtype" in bad.stderr
