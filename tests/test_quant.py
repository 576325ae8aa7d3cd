"""Weight encodings and KV dtypes (ninfer_core.quant): round trips, the dequantising linear against
its reference, the Triton kernels under the interpreter, KV sizing, and the serve path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ninfer_core.quant.encodings import EncodingError, dequantize, parse_encoding, quantize
from ninfer_core.quant.kv import FP8, INT8, K8V4, KVFormat, check_kv_dtype
from ninfer_core.quant.weight import QuantizedWeight, reference_linear

# worst relative error (of the weight's amax) each encoding may make on Gaussian weights
BOUNDS = {"int8": 0.006, "int4": 0.08, "q4": 0.08, "q6": 0.02, "fp8_e4m3": 0.07}
NAMES = ["int8-g32", "int8-g128", "int4-g32", "int4-g64", "q6-g32", "q4-g32", "fp8_e4m3-row", "fp8_e4m3-g64"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
def test_encoding_round_trip_within_its_step(name, scale_dtype):
    enc = parse_encoding(name)
    w = torch.randn(3, 24, 256, generator=torch.Generator().manual_seed(1))  # stacked, like MoE experts
    q, s = quantize(w, enc, scale_dtype)
    assert s.dtype == scale_dtype and s.shape == (3, 24, 256 // enc.group_for(256))
    assert q.shape == (3, 24, enc.packed_cols(256))
    back = dequantize(q, s, enc, 256)
    err = float((back - w).abs().max() / w.abs().max())
    assert 0 < err < BOUNDS[enc.scheme]
    # zero groups stay exactly zero
    z = torch.zeros(2, 128)
    assert dequantize(*quantize(z, enc), enc, 128).abs().max() == 0


def test_packed_layouts_are_the_documented_ones():
    enc = parse_encoding("int4-g32")
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 7.0, -8.0 * 7 / 7  # scale = 1 (amax 8 / 7 rounds the grid: check bytes only)
    q, s = quantize(torch.tensor([[7.0, -7.0] + [0.0] * 30]), enc)
    assert int(q[0, 0]) == (7 + 8) | ((-7 + 8) << 4)
    q6, _ = quantize(torch.tensor([[31.0, -31.0, 0.0, 1.0] + [0.0] * 28]), parse_encoding("q6-g32"))
    bits = int(q6[0, 0]) | (int(q6[0, 1]) << 8) | (int(q6[0, 2]) << 16)
    assert [(bits >> sh) & 63 for sh in (0, 6, 12, 18)] == [63, 1, 32, 33]


def test_bad_encoding_names_and_shapes_are_refused():
    for bad in ("int3-g32", "int8-32", "int8-g0", "fp8"):
        with pytest.raises(EncodingError):
            parse_encoding(bad)
    with pytest.raises(EncodingError, match="multiple of the group size"):
        quantize(torch.randn(4, 48), parse_encoding("int8-g32"))


def test_quantized_weight_acts_as_the_linear_weight():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 64, generator=g)
    qw = QuantizedWeight.from_float(w, parse_encoding("int8-g32"))
    x = torch.randn(5, 64, generator=g)
    ref = x @ qw.dequantize().T
    assert torch.allclose(F.linear(x, qw), ref, atol=1e-5)
    lin = torch.nn.Linear(64, 40, bias=False)
    lin._parameters.pop("weight")
    lin.weight = qw
    assert torch.allclose(lin(x), ref, atol=1e-5)
    fused = torch.cat([qw, qw[:8]], dim=0)  # fused projections and their row views
    assert isinstance(fused, QuantizedWeight) and fused.shape == (48, 64)
    assert torch.allclose(F.linear(x, fused[40:48]), ref[:, :8], atol=1e-5)
    ids = torch.tensor([3, 0, 3])
    assert torch.allclose(F.embedding(ids, qw), qw.dequantize()[ids])
    stacked = QuantizedWeight.from_float(torch.randn(3, 8, 64, generator=g), parse_encoding("int4-g32"))
    assert torch.allclose(F.linear(x, stacked[1]), x @ stacked.dequantize()[1].T, atol=1e-5)
    assert qw.nbytes == 40 * 64 + 40 * 2 * 2  # int8 values + two bf16 scales per row
    # any other torch function sees the dequantised weight
    assert torch.allclose(torch.matmul(x, qw.dequantize().T), torch.matmul(x, torch.transpose(qw, 0, 1)))


def test_reference_linear_blocks_large_heads_without_changing_the_result():
    import ninfer_core.quant.weight as mod

    w = torch.randn(50, 32)
    qw = QuantizedWeight.from_float(w, parse_encoding("q6-g32"))
    x = torch.randn(2, 32)
    whole = reference_linear(x, qw)
    old, mod._REF_ROWS = mod._REF_ROWS, 16
    try:
        assert torch.allclose(reference_linear(x, qw), whole, atol=1e-6)
    finally:
        mod._REF_ROWS = old


KERNEL_CASE = r"""
import dataclasses
import torch
from ninfer_core.quant.encodings import parse_encoding
from ninfer_core.quant.weight import QuantizedWeight, reference_linear, quantized_linear
from ninfer_core.quant.kernels import triton_linear, dequantize_rows
from ninfer_core.quant import qgemv as QG
g = torch.Generator().manual_seed(0)
for name in ["int8-g32", "int4-g64", "q6-g32", "fp8_e4m3-row", "fp8_e4m3-g32"]:
    enc = parse_encoding(name)
    w = torch.randn(40, 192, generator=g)
    qw = QuantizedWeight.from_float(w, enc)
    for m, cfg in ((1, None), (3, ("gemv", 16, 64)), (1, ("gemm", 16, 16, 64)), (20, None), (20, ("scratch",))):
        x = torch.randn(m, 192, generator=g)
        ref = reference_linear(x, qw)
        got = triton_linear(x, qw, cfg)
        assert torch.isfinite(got).all()
        err = float((got - ref).abs().max())
        assert err < 1e-4 * max(1.0, float(ref.abs().max())), (name, m, cfg, err)
    # the dispatch the linear takes under the interpreter is the kernel
    x = torch.randn(2, 192, generator=g)
    ref = reference_linear(x, qw)
    assert float((quantized_linear(x, qw) - ref).abs().max()) < 1e-4 * float(ref.abs().max()), name
    xb = x.to(torch.bfloat16)
    qb = QuantizedWeight.from_float(w, enc, dtype=torch.bfloat16)
    rb = reference_linear(xb, qb).float()
    assert float((triton_linear(xb, qb).float() - rb).abs().max()) <= 0.01 * float(rb.abs().max()), name
# the decode GEMV on every path: K split across programs (the last one sums the partials), a K
# the tile does not divide, the FMA path, 1..8 rows read by the same programs; the streaming
# dequantiser of the scratch path equals the reference exactly
for name in ["int8-g32", "int4-g64", "int4-g128", "fp8_e4m3-row", "fp8_e4m3-g32"]:
    enc = parse_encoding(name)
    for n, k in ((40, 256), (33, 384 if "g128" in name else 320)):
        qw = QuantizedWeight.from_float(torch.randn(n, k, generator=g), enc)
        assert torch.equal(dequantize_rows(qw, torch.float32), qw.dequantize())
        for m, cfg in ((1, QG.Config(16, 64, 1, 1, 4, dot=False, split=2)), (3, QG.Config(16, 64, 1, 1, 4, split=3)),
                       (8, QG.Config(16, 128, 1, 1, 4, split=2)), (5, QG.Config(32, 64, 1, 1, 4)),
                       (12, ("gemm", 16, 16, 64)),
                       # the scale-after-dot kernel: split, several groups a tile, one row, a K tail
                       (3, QG.Config(16, 64, 1, 1, 4, split=3, group=True)),
                       (8, QG.Config(16, 128, 1, 1, 4, split=2, group=True)),
                       (1, QG.Config(32, 64, 1, 1, 4, group=True))):
            x = torch.randn(m, k, generator=g)
            ref = reference_linear(x, qw)
            err = float((triton_linear(x, qw, cfg) - ref).abs().max())
            assert err < 1e-4 * max(1.0, float(ref.abs().max())), (name, n, k, m, cfg, err)
    xb = torch.randn(4, k, generator=g).to(torch.bfloat16)
    qb = QuantizedWeight.from_float(torch.randn(n, k, generator=g), enc, dtype=torch.bfloat16)
    for c in QG.candidates(enc):  # every candidate `pick` may choose on CUDA, at its real tile
        x = torch.randn(2, k, generator=g)
        ref = reference_linear(x, qw)
        err = float((triton_linear(x, qw, dataclasses.replace(c, warps=1)) - ref).abs().max())
        assert err < 1e-4 * max(1.0, float(ref.abs().max())), (name, c, err)
    rb = reference_linear(xb, qb).float()
    assert float((triton_linear(xb, qb).float() - rb).abs().max()) <= 0.01 * float(rb.abs().max()), name
# a weight of more rows than one scratch block: blocks of whole multiples of 256 rows
import ninfer_core.quant.kernels as QK
QK._SCRATCH_ELEMS = 300 * 64
qw = QuantizedWeight.from_float(torch.randn(600, 64, generator=g), parse_encoding("int8-g32"))
x = torch.randn(20, 64, generator=g)
ref = reference_linear(x, qw)
assert float((triton_linear(x, qw, ("scratch",)) - ref).abs().max()) < 1e-4 * float(ref.abs().max())
print("kernels ok")
"""


def test_triton_kernels_match_the_reference_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", KERNEL_CASE], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "kernels ok" in r.stdout


@pytest.mark.parametrize("fmt", [INT8, FP8, K8V4])
def test_kv_formats_round_trip_per_token_and_head(fmt):
    x = torch.randn(7, 2, 64) * torch.linspace(0.01, 10, 7)[:, None, None]  # scales differ per token
    for kind, bound in ((fmt.k_kind, None), (fmt.v_kind, None)):
        data, scale = KVFormat.encode(kind, x)
        assert scale.shape == (7, 2)
        back = KVFormat.decode(kind, data, scale, torch.float32)
        rel = (back - x).abs().amax(-1) / x.abs().amax(-1)
        assert float(rel.max()) < {"int8": 0.005, "fp8": 0.07, "int4": 0.08}[kind]


def test_kv_bytes_per_token_count_the_scales():
    # 4 layers, 2 KV heads, head_dim 256, bf16 model
    bf16 = 4 * 2 * 2 * 256 * 2
    assert INT8.bytes_per_token(4, 2, 256, 2) == 4 * 2 * 2 * (256 + 4)
    assert K8V4.bytes_per_token(4, 2, 256, 2) == 4 * 2 * ((256 + 4) + (128 + 4))
    assert bf16 / INT8.bytes_per_token(4, 2, 256, 2) > 1.95


def test_kv_capacity_auto_fits_about_twice_the_tokens_with_int8():
    from types import SimpleNamespace

    from ninfer_core.engine.kv_sizing import auto_kv_capacity

    spec_bf16 = SimpleNamespace(kv_bytes_per_token=16 * 4 * 256 * 2 * 2, state_bytes=10_000_000)
    spec_int8 = SimpleNamespace(kv_bytes_per_token=INT8.bytes_per_token(16, 4, 256, 2), state_bytes=10_000_000)
    free = 20 * 2**30
    a = auto_kv_capacity(spec_bf16, "cpu", 1024, 2, 64, free_bytes=free)
    b = auto_kv_capacity(spec_int8, "cpu", 1024, 2, 64, free_bytes=free)
    assert a % 64 == 0 and b % 64 == 0
    assert 1.9 < b / a < 2.0
    assert a * spec_bf16.kv_bytes_per_token <= free - 2**30 - 2 * 10_000_000
    with pytest.raises(ValueError, match="not enough for one KV page"):
        auto_kv_capacity(spec_bf16, "cpu", 1024, 1, 64, free_bytes=2**30)


def test_planned_kv_dtypes_are_refused_naming_what_exists():
    with pytest.raises(ValueError, match=r"rk4v4 is not built yet; available: bf16, fp8, int8, k8v4"):
        check_kv_dtype("rk4v4", {"bf16": 1, "int8": 1, "fp8": 1, "k8v4": 1})
    check_kv_dtype("int8", {"int8": 1})


def test_kv_dtypes_are_registered_through_the_hook():
    from ninfer_core.plugins import PluginHost, PluginSelection

    host = PluginHost(PluginSelection.from_sources([]))
    names = set(host.registry("kv_dtype"))
    assert {"bf16", "int8", "fp8", "k8v4"} <= names
    assert host.resolve("kv_dtype", "k8v4").load() is K8V4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dequantising_kernels_on_cuda_at_a_9b_projection_shape():
    """The GEMV (decode rows, tuned), the Triton GEMM and the scratch + cuBLAS path (prefill rows)
    in bf16 on CUDA against the reference (scripts/gpu_check.py --order quant)."""
    from ninfer_core.quant.kernels import triton_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(4096, 4096, generator=g, device="cuda") * 0.02
    for name in ("int8-g128", "int4-g64", "int4-g128", "fp8_e4m3-row"):
        qw = QuantizedWeight.from_float(w, parse_encoding(name), dtype=torch.bfloat16)
        for m, cfg in ((1, None), (2, None), (8, None), (300, ("gemm", 128, 128, 64)), (300, ("scratch",)),
                       (1024, None)):
            x = torch.randn(m, 4096, generator=g, device="cuda").to(torch.bfloat16)
            ref = reference_linear(x.float(), qw.to(dtype=torch.float32)).float()
            err = float((triton_linear(x, qw, cfg).float() - ref).abs().max() / ref.abs().max())
            print(f"QUANT linear {name} m={m} {cfg[0] if cfg else 'auto'} on CUDA: rel err {err:.1e}")
            assert err < 2e-2, (name, m, err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quant_gemv_is_batch_invariant_and_replays_in_a_cuda_graph():
    """One config per weight for every row count: a row's output has the same bits alone or among
    eight; a graph of split-K launches replays to the eager result (the counters reset)."""
    from ninfer_core.quant import qgemv as QG
    from ninfer_core.quant.kernels import triton_linear

    g = torch.Generator(device="cuda").manual_seed(1)
    for name, n, k in (("int8-g128", 4096, 12288), ("int4-g64", 1024, 4096)):  # 1024 rows: K split
        qw = QuantizedWeight.from_float(torch.randn(n, k, generator=g, device="cuda") * 0.02, parse_encoding(name),
                                        dtype=torch.bfloat16)
        x = torch.randn(8, k, generator=g, device="cuda").to(torch.bfloat16)
        eight = triton_linear(x, qw)
        for m in (1, 3):
            assert torch.equal(triton_linear(x[:m].clone(), qw), eight[:m]), (name, m)
        # both kernels (per-element scale, scale-after-dot) with a forced K split
        for cfg in (QG.Config(32, 256, 4, 2, 4, split=4), QG.Config(64, 128, 4, 3, 2, split=4, group=True)):
            eager = triton_linear(x, qw, cfg)
            static_x = x.clone()
            graph = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                triton_linear(static_x, qw, cfg)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(graph):
                out = triton_linear(static_x, qw, cfg)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), (name, cfg)
        print(f"QUANT gemv {name} {n}x{k}: batch invariant, graph replay equal; tuned {QG.tuned()}")
