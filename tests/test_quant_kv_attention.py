"""Paged attention over quantised KV pages (ninfer_core.quant.kv_attention): the Triton kernels
against the torch reference under TRITON_INTERPRET=1, and the reference against float attention."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ninfer_core.quant import kv_attention as KA
from ninfer_core.quant.kv import FP8, INT8, K8V4, write_rows

PAGE, KVH, D = 16, 2, 32


def _cache(fmt, pages: int, seed: int = 0):
    """A random cache of `fmt` filled through write_rows, and the float K/V it was written from."""
    g = torch.Generator().manual_seed(seed)
    kf = torch.randn(pages, PAGE, KVH, D, generator=g) * torch.rand(pages, PAGE, KVH, 1, generator=g) * 3
    vf = torch.randn(pages, PAGE, KVH, D, generator=g)
    k, ks = fmt.allocate(fmt.k_kind, pages, PAGE, KVH, D, torch.float32, "cpu")
    v, vs = fmt.allocate(fmt.v_kind, pages, PAGE, KVH, D, torch.float32, "cpu")
    p = torch.arange(pages).repeat_interleave(PAGE)
    r = torch.arange(PAGE).repeat(pages)
    write_rows(fmt, k, v, ks, vs, p, r, kf.reshape(-1, KVH, D), vf.reshape(-1, KVH, D))
    return (k, v, ks, vs), (kf, vf)


def _float_decode(q, kf, vf, table, lens, scale):
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        n = int(lens[i])
        kk = kf[table[i].long()].reshape(-1, KVH, D)[:n]
        vv = vf[table[i].long()].reshape(-1, KVH, D)[:n]
        g = q.shape[1] // KVH
        s = torch.einsum("kgd,nkd->kgn", q[i].reshape(KVH, g, D), kk) * scale
        out[i] = torch.einsum("kgn,nkd->kgd", torch.softmax(s, -1), vv).reshape(-1, D)
    return out


@pytest.mark.parametrize("fmt,tol", [(INT8, 0.02), (FP8, 0.08), (K8V4, 0.15)])
def test_reference_decode_is_close_to_float_attention(fmt, tol):
    (k, v, ks, vs), (kf, vf) = _cache(fmt, 6)
    q = torch.randn(3, 4, D)
    table = torch.tensor([[0, 1, 2], [3, 4, 0], [5, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([40, 20, 3], dtype=torch.int32)
    got = KA.ref_paged_decode_attention(q, fmt, k, v, ks, vs, table, lens, D ** -0.5)
    want = _float_decode(q, kf, vf, table, lens, D ** -0.5)
    err = float((got - want).abs().max() / want.abs().max())
    assert err < tol, err
    # and the quantisation is really there: the values differ from float attention
    assert float((got - want).abs().max()) > 0


def test_kernel_args_refuse_pages_without_scales():
    k = torch.zeros(2, PAGE, KVH, D)
    with pytest.raises(ValueError, match="without scales"):
        KA._kernel_args(INT8, k, k, None, None)


KERNEL_CASE = r"""
import torch
from ninfer_core.quant import kv_attention as KA
from ninfer_core.quant.kv import FP8, INT8, K8V4
import test_quant_kv_attention as T

for fmt in (INT8, FP8, K8V4):
    (k, v, ks, vs), _ = T._cache(fmt, 7, seed=1)
    for dtype, tol in ((torch.float32, 2e-3), (torch.bfloat16, 3e-2)):
        q = torch.randn(3, 4, T.D).to(dtype)
        table = torch.tensor([[0, 1, 2, 6, 0], [3, 4, 0, 0, 0], [5, 2, 1, 0, 4]], dtype=torch.int32)
        lens = torch.tensor([60, 17, 80], dtype=torch.int32)
        for pps in (None, 1, 2):
            got = KA.paged_decode_attention(q, fmt, k, v, ks, vs, table, lens, 0.2, pages_per_split=pps).float()
            want = KA.ref_paged_decode_attention(q, fmt, k, v, ks, vs, table, lens, 0.2).float()
            err = float((got - want).abs().max())
            assert err < tol * max(1.0, float(want.abs().max())), (fmt.name, dtype, pps, "decode", err)
        # the default split count comes from the layer: a lane alone (its table cut to its own pages)
        # gets the bits it gets in the batch
        got = KA.paged_decode_attention(q, fmt, k, v, ks, vs, table, lens, 0.2)
        for i in range(3):
            n = -(-int(lens[i]) // k.shape[1])
            alone = KA.paged_decode_attention(q[i:i + 1], fmt, k, v, ks, vs, table[i:i + 1, :n].contiguous(),
                                              lens[i:i + 1], 0.2)
            assert torch.equal(alone, got[i:i + 1]), (fmt.name, dtype, i, "a lane alone differs from the batch")
        pages = torch.tensor([4, 0, 6, 2, 1], dtype=torch.int32)
        for start, t in ((0, 21), (17, 5), (40, 33)):
            q = torch.randn(t, 4, T.D).to(dtype)
            got = KA.paged_prefill_attention(q, fmt, k, v, ks, vs, pages, start, 0.2).float()
            want = KA.ref_paged_prefill_attention(q, fmt, k, v, ks, vs, pages, start, 0.2).float()
            err = float((got - want).abs().max())
            assert err < tol * max(1.0, float(want.abs().max())), (fmt.name, dtype, start, t, "prefill", err)
# the fused page write stores the torch write's bits (data and scales), a zero row included (fp8:
# on CUDA only, test_fused_write_on_cuda: the interpreter's float8 cast rounds some values a binade low)
from ninfer_core.quant.kv import write_rows
for fmt in (INT8, K8V4):
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        kx = (torch.randn(9, T.KVH, T.D, generator=g) * 5).to(dtype)
        vx = torch.randn(9, T.KVH, T.D, generator=g).to(dtype)
        kx[4] = 0
        pages, rows = torch.tensor([0, 2, 2, 1, 0, 3, 3, 1, 2]), torch.tensor([0, 5, 6, 15, 3, 0, 1, 2, 9])
        outs = []
        for fused in (True, False):
            k, ks = fmt.allocate(fmt.k_kind, 4, T.PAGE, T.KVH, T.D, dtype, "cpu")
            v, vs = fmt.allocate(fmt.v_kind, 4, T.PAGE, T.KVH, T.D, dtype, "cpu")
            write_rows(fmt, k, v, ks, vs, pages, rows, kx, vx, fused=fused)
            outs.append([t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (k, v, ks, vs)])
        for a, b in zip(*outs):
            assert torch.equal(a, b), (fmt.name, dtype)
print("kernels ok")
"""


def test_triton_kernels_match_the_reference_under_the_interpreter():
    pytest.importorskip("triton")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", KERNEL_CASE], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "kernels ok" in r.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_on_cuda_at_the_qwen35_27b_attention_shape():
    """bf16 queries, 24 heads over 4 KV heads of 256, 64-row pages (scripts/gpu_check.py --order quant)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    page, kvh, d, h, pages = 64, 4, 256, 24, 40
    for fmt in (INT8, FP8, K8V4):
        k, ks = fmt.allocate(fmt.k_kind, pages, page, kvh, d, torch.bfloat16, dev)
        v, vs = fmt.allocate(fmt.v_kind, pages, page, kvh, d, torch.bfloat16, dev)
        rows = pages * page
        write_rows(fmt, k, v, ks, vs, torch.arange(pages, device=dev).repeat_interleave(page),
                   torch.arange(page, device=dev).repeat(pages),
                   torch.randn(rows, kvh, d, generator=g, device=dev, dtype=torch.bfloat16),
                   torch.randn(rows, kvh, d, generator=g, device=dev, dtype=torch.bfloat16))
        table = torch.randperm(pages, generator=g, device=dev)[:36].to(torch.int32).reshape(3, 12)
        lens = torch.tensor([700, 65, 768], dtype=torch.int32, device=dev)
        q = torch.randn(3, h, d, generator=g, device=dev, dtype=torch.bfloat16)
        got = KA.paged_decode_attention(q, fmt, k, v, ks, vs, table, lens, d ** -0.5).float()
        want = KA.ref_paged_decode_attention(q, fmt, k, v, ks, vs, table, lens, d ** -0.5).float()
        e1 = float((got - want).abs().max() / want.abs().max())
        qp = torch.randn(300, h, d, generator=g, device=dev, dtype=torch.bfloat16)
        got = KA.paged_prefill_attention(qp, fmt, k, v, ks, vs, table[0].contiguous(), 400, d ** -0.5).float()
        want = KA.ref_paged_prefill_attention(qp, fmt, k, v, ks, vs, table[0], 400, d ** -0.5).float()
        e2 = float((got - want).abs().max() / want.abs().max())
        print(f"QUANT kv attention {fmt.name} on CUDA: decode rel err {e1:.1e}, prefill rel err {e2:.1e}")
        assert e1 < 2e-2 and e2 < 2e-2, (fmt.name, e1, e2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_write_on_cuda_stores_the_torch_writes_bits():
    for fmt in (INT8, FP8, K8V4):
        g = torch.Generator(device="cuda").manual_seed(4)
        kx = (torch.randn(40, 4, 256, generator=g, device="cuda") * 7).to(torch.bfloat16)
        vx = torch.randn(40, 4, 256, generator=g, device="cuda").to(torch.bfloat16)
        kx[3] = 0
        pages = torch.arange(40, device="cuda") % 6  # distinct (page, row) pairs
        rows = torch.arange(40, device="cuda") % 64
        outs = []
        for fused in (True, False):
            k, ks = fmt.allocate(fmt.k_kind, 6, 64, 4, 256, torch.bfloat16, "cuda")
            v, vs = fmt.allocate(fmt.v_kind, 6, 64, 4, 256, torch.bfloat16, "cuda")
            write_rows(fmt, k, v, ks, vs, pages, rows, kx, vx, fused=fused)
            outs.append([t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (k, v, ks, vs)])
        for a, b in zip(*outs):
            assert torch.equal(a, b), fmt.name
        print(f"QUANT fused KV write {fmt.name} on CUDA: same bits as the torch write")
