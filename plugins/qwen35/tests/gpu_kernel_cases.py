"""Kernel-vs-reference cases shared by the CPU interpreter tests and tests/gpu (device = cuda).

Each case draws fresh random inputs, poisons the outputs the kernel writes, and checks
||out - ref|| / ||ref|| against a bf16 tolerance; lanes have different lengths and pages are
scattered through the pool.
"""

from __future__ import annotations

import torch

from ninfer_qwen35.gpu import kernels as K


def act_dtype(device) -> torch.dtype:
    """bf16 on CUDA; fp16 under the CPU interpreter (its bf16 emulation is broken; the kernels
    are dtype-generic, so fp16 exercises the same code)."""
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float16


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all(), "non-finite output (unwritten element?)"
    return float((a - b).norm() / b.norm())


def _pool(num_pages, page, kvh, d, device, gen):
    k = torch.randn(num_pages, page, kvh, d, generator=gen, device=device).to(act_dtype(device))
    v = torch.randn(num_pages, page, kvh, d, generator=gen, device=device).to(act_dtype(device))
    return k, v


def decode_attention(device="cpu", heads=8, kvh=2, d=64, lens=(1, 70, 200, 64), page=64, tol=2e-2):
    gen = torch.Generator(device=device).manual_seed(1)
    width = -(-max(lens) // page) + 1
    num_pages = len(lens) * width + 3
    kc, vc = _pool(num_pages, page, kvh, d, device, gen)
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(2)).tolist()
    table = torch.tensor([perm[i * width:(i + 1) * width] for i in range(len(lens))], dtype=torch.int32)
    table = table.to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), heads, d, generator=gen, device=device).to(act_dtype(device))
    scale = d**-0.5
    ref = K.ref_paged_decode_attention(q, kc, vc, table, seq_lens, scale)
    for pps in (None, 1, 2):
        out = K.paged_decode_attention(q, kc, vc, table, seq_lens, scale, pages_per_split=pps)
        err = rel(out, ref)
        print(f"decode attention pps={pps}: rel err {err:.2e}")
        assert err < tol, err


def prefill_attention(device="cpu", heads=8, kvh=2, d=64, page=64, tol=2e-2):
    gen = torch.Generator(device=device).manual_seed(3)
    num_pages = 16
    kc, vc = _pool(num_pages, page, kvh, d, device, gen)
    pages = torch.tensor([9, 2, 14, 5, 0, 11], dtype=torch.int32, device=device)
    for start, t in ((0, 100), (70, 90), (128, 1), (0, 64), (300, 17)):
        q = torch.randn(t, heads, d, generator=gen, device=device).to(act_dtype(device))
        ref = K.ref_paged_prefill_attention(q, kc, vc, pages, start, d**-0.5)
        # splits: the automatic choice, none, and key splits whose first pages are past some rows
        for splits in (None, 1, 2, 3, 6):
            out = K.paged_prefill_attention(q, kc, vc, pages, start, d**-0.5,
                                            block_m=32 if device == "cpu" else 64, splits=splits)
            err = rel(out, ref)
            print(f"prefill attention start={start} T={t} splits={splits}: rel err {err:.2e}")
            assert err < tol, err


def gdn_decode(device="cpu", hk=2, hv=4, dk=32, dv=64, batch=3, tol=1e-4):
    gen = torch.Generator(device=device).manual_seed(4)
    slots_n = 6
    conv = 2 * hk * dk + hv * dv
    extra = 8  # mixed is a strided view into a wider projection row, as in the runner
    proj = torch.randn(batch, conv + extra, generator=gen, device=device)
    mixed = proj[:, :conv]
    a_raw = torch.randn(batch, hv, generator=gen, device=device)
    b_raw = torch.randn(batch, hv, generator=gen, device=device)
    A_log = torch.rand(hv, generator=gen, device=device) * 2
    dt_bias = torch.randn(hv, generator=gen, device=device)
    state = torch.randn(slots_n, hv, dk, dv, generator=gen, device=device)
    slots = torch.tensor([4, 0, 2][:batch], dtype=torch.int64, device=device)
    ref_state = state.clone()
    ref = K.ref_gdn_decode(mixed, a_raw, b_raw, A_log, dt_bias, ref_state, slots, hk, dk, dv, dk**-0.5)
    out = K.gdn_decode_inplace(mixed, a_raw, b_raw, A_log, dt_bias, state, slots, hk, dk, dv, dk**-0.5)
    e_out, e_state = rel(out, ref), rel(state, ref_state)
    print(f"gdn decode: out rel err {e_out:.2e}, state rel err {e_state:.2e}")
    assert e_out < tol and e_state < tol
    untouched = [i for i in range(slots_n) if i not in slots.tolist()]
    assert torch.equal(state[untouched], ref_state[untouched])


def gdn_prefill_recurrent(device="cpu", hk=2, hv=4, dk=32, dv=64, tol=1e-4):
    """The short-chunk recurrent GDN kernel against the per-token reference and against the chunked
    reference (the math fla runs for long chunks)."""
    from ninfer_qwen35 import gdn as ref_gdn

    gen = torch.Generator(device=device).manual_seed(21)
    conv = 2 * hk * dk + hv * dv
    for t in (1, 5, 17):
        mixed = torch.nn.functional.silu(torch.randn(t, conv, generator=gen, device=device))
        proj = torch.randn(t, 2 * hv + 6, generator=gen, device=device)
        a_raw, b_raw = proj[:, :hv], proj[:, hv:2 * hv]  # strided rows, as sliced from the projection
        A_log = torch.rand(hv, generator=gen, device=device) * 2
        dt_bias = torch.randn(hv, generator=gen, device=device)
        state = torch.randn(4, hv, dk, dv, generator=gen, device=device)
        ref_state = state.clone()
        ref = K.ref_gdn_prefill_recurrent(mixed, a_raw, b_raw, A_log, dt_bias, ref_state, 1, hk, dk, dv, dk**-0.5)
        out = K.gdn_prefill_recurrent(mixed, a_raw, b_raw, A_log, dt_bias, state, 1, hk, dk, dv, dk**-0.5)
        e_out, e_state = rel(out, ref), rel(state, ref_state)
        # the chunked reference from the same initial state
        q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
        q = q.reshape(t, hk, dk).repeat_interleave(hv // hk, 1)
        k = k.reshape(t, hk, dk).repeat_interleave(hv // hk, 1)
        g = -A_log.exp() * torch.nn.functional.softplus(a_raw + dt_bias)
        qn = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
        kn = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        init = torch.randn(hv, dk, dv, generator=gen, device=device)
        state2 = state.clone()
        state2[2] = init
        o_chunk, s_chunk = ref_gdn.chunk_gated_delta_rule(qn, kn, v.reshape(t, hv, dv), g, torch.sigmoid(b_raw),
                                                          init.clone())
        out2 = K.gdn_prefill_recurrent(mixed, a_raw, b_raw, A_log, dt_bias, state2, 2, hk, dk, dv, dk**-0.5)
        e_chunk = max(rel(out2, o_chunk), rel(state2[2], s_chunk))
        print(f"gdn prefill recurrent T={t}: out {e_out:.2e}, state {e_state:.2e}, vs chunked {e_chunk:.2e}")
        assert e_out < tol and e_state < tol and e_chunk < 1e-3
        assert torch.equal(state[[0, 2, 3]], ref_state[[0, 2, 3]])


def runner_interpret():
    """The GPU runner with its Triton kernels (interpreted, fp32) against the reference runner."""
    import tempfile

    from ninfer_qwen35.family import Qwen35Family
    from ninfer_qwen35.gpu.runner import GpuQwen35Runner
    from ninfer_qwen35.testing import build_tiny_artifact

    from ninfer_core.artifact import Artifact
    from ninfer_core.engine.model_api import SeqView

    with tempfile.TemporaryDirectory() as d:
        art = Artifact.open(build_tiny_artifact(f"{d}/t.ninfer", kind="dense", seed=5, num_layers=4))
        ref = Qwen35Family().load(art)
        fast = GpuQwen35Runner.from_runner(Qwen35Family().load(art))
        outs = []
        for r in (ref, fast):
            r.allocate_cache(16, 3)
            a = SeqView(slot=0, pages=[5, 2, 9], num_cached=0)
            b = SeqView(slot=2, pages=[7, 1], num_cached=0)
            g = torch.Generator().manual_seed(7)
            ta = torch.randint(0, 500, (140,), generator=g).tolist()
            tb = torch.randint(0, 500, (64,), generator=g).tolist()
            rows = [r.prefill(a, ta[:80], all_logits=True)]
            a.num_cached = 80
            rows.append(r.prefill(a, ta[80:130], all_logits=True))
            a.num_cached = 130
            rows.append(r.prefill(b, tb[:60], all_logits=True))
            b.num_cached = 60
            for i in range(3):
                rows.append(r.decode([a, b], [ta[130 + i], tb[60 + i]]))
                a.num_cached += 1
                b.num_cached += 1
            outs.append(torch.cat(rows))
        err = rel(outs[1], outs[0])
        print(f"runner with interpreted kernels vs reference: {err:.2e}")
        assert err < 1e-4, err


def fused_elementwise(device="cpu", rows=5, hidden=320, tol=None):
    """add_rmsnorm / gated_rmsnorm / silu_mul against the reference modules' math."""
    gen = torch.Generator(device=device).manual_seed(9)
    dt = act_dtype(device) if tol is None else torch.float32
    tol = tol or 1e-2
    x = torch.randn(rows, hidden, generator=gen, device=device).to(dt)
    d = torch.randn(rows, hidden, generator=gen, device=device).to(dt)
    w = (torch.randn(hidden, generator=gen, device=device) * 0.1).to(dt)
    for delta in (d, None):
        xr, hr = K.ref_add_rmsnorm(x, delta, w, 1e-6)
        xo, ho = K.add_rmsnorm(x, delta, w, 1e-6)
        e1, e2 = rel(xo, xr), rel(ho, hr)
        print(f"add_rmsnorm (delta={'yes' if delta is not None else 'no'}): {e1:.2e} {e2:.2e}")
        assert e1 < tol and e2 < tol
    core = torch.randn(rows * 4, 64, generator=gen, device=device).to(dt)
    z = torch.randn(rows * 4, 64 + 8, generator=gen, device=device).to(dt)[:, :64]  # strided rows
    gw = (1 + 0.1 * torch.randn(64, generator=gen, device=device)).to(dt)
    e = rel(K.gated_rmsnorm(core, z, gw, 1e-6), K.ref_gated_rmsnorm(core, z, gw, 1e-6))
    print(f"gated_rmsnorm: {e:.2e}")
    assert e < tol
    gu = torch.randn(rows, 2 * 1500, generator=gen, device=device).to(dt)
    e = rel(K.silu_mul(gu), K.ref_silu_mul(gu))
    print(f"silu_mul: {e:.2e}")
    assert e < tol


def conv_and_qk(device="cpu", tol=None):
    """conv_update and qk_norm_rope against their references (strided inputs, scattered slots)."""
    gen = torch.Generator(device=device).manual_seed(13)
    dt = act_dtype(device) if tol is None else torch.float32
    tol = tol or 1e-2
    b, c = 3, 2100
    proj = torch.randn(b, c + 40, generator=gen, device=device).to(dt)
    mixed = proj[:, :c]
    state = torch.randn(5, c, 3, generator=gen, device=device).to(dt)
    w = (torch.randn(c, 4, generator=gen, device=device) * 0.5).to(dt)
    slots = torch.tensor([4, 0, 2], device=device)
    ref_state = state.clone()
    ref = K.ref_conv_update(mixed, ref_state, w, slots)
    out = K.conv_update(mixed, state, w, slots)
    e1, e2 = rel(out, ref), rel(state, ref_state)
    print(f"conv_update: out {e1:.2e}, state {e2:.2e}")
    assert e1 < tol and e2 < tol
    for t in (1, 2, 3, 5, 40, 77):  # the chunk conv (T < 3 takes the reference path)
        x = torch.randn(t, c + 40, generator=gen, device=device).to(dt)[:, :c]
        st = torch.randn(5, c, 3, generator=gen, device=device).to(dt)
        ref_st = st.clone()
        ref = K.ref_conv_prefill(x, ref_st, w, 3)
        out = K.conv_prefill(x, st, w, 3)
        e1, e2 = rel(out, ref), rel(st, ref_st)
        print(f"conv_prefill T={t}: out {e1:.2e}, state {e2:.2e}")
        assert e1 < tol and e2 < tol
        assert torch.equal(st[[0, 1, 2, 4]], ref_st[[0, 1, 2, 4]])
    n, h, kvh, d, rot = 7, 4, 2, 64, 16
    p = torch.randn(n, h * 2 * d + 2 * kvh * d, generator=gen, device=device).to(dt)
    q = p[:, : h * 2 * d].view(n, h, 2 * d)[..., :d]
    k = p[:, h * 2 * d : h * 2 * d + kvh * d].view(n, kvh, d)
    qw = (torch.randn(d, generator=gen, device=device) * 0.1).to(dt)
    kw = (torch.randn(d, generator=gen, device=device) * 0.1).to(dt)
    ang = torch.rand(n, rot // 2, generator=gen, device=device) * 6
    cos = torch.cat([ang, ang], -1).cos().to(dt)
    sin = torch.cat([ang, ang], -1).sin().to(dt)
    rq, rk = K.ref_qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6)
    oq, ok = K.qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6)
    e1, e2 = rel(oq, rq), rel(ok, rk)
    print(f"qk_norm_rope: q {e1:.2e}, k {e2:.2e}")
    assert e1 < tol and e2 < tol
