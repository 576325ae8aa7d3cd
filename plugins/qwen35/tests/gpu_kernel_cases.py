"""Kernel-vs-reference cases shared by the CPU interpreter tests and tests/gpu (device = cuda).

Each case draws fresh random inputs, poisons the outputs the kernel writes, and checks
||out - ref|| / ||ref|| against a bf16 tolerance; lanes have different lengths and pages are
scattered through the pool.
"""

from __future__ import annotations

import torch

from ninfer_core.accel import kernels as K


def act_dtype(device) -> torch.dtype:
    """bf16 on CUDA; fp16 under the CPU interpreter (its bf16 emulation is broken; the kernels
    are dtype-generic, so fp16 exercises the same code)."""
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float16


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all(), "non-finite output (unwritten element?)"
    return float((a - b).norm() / b.norm())


def ulp_close(a, b, ulps: int = 1) -> bool:
    """Elementwise equal up to `ulps` units in the last place of a's dtype."""
    eps = torch.finfo(a.dtype).eps
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= ulps * eps * torch.maximum(a.abs(), b.abs()) + 1e-30).all())


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
    # the default split count depends on the layer only: a lane alone, or through a table cut to its
    # own pages, gets the bits it gets in the batch (the engine's batched greedy = alone)
    out = K.paged_decode_attention(q, kc, vc, table, seq_lens, scale)
    for i, n in enumerate(lens):
        alone = K.paged_decode_attention(q[i:i + 1], kc, vc, table[i:i + 1, : -(-n // page)].contiguous(),
                                         seq_lens[i:i + 1], scale)
        assert torch.equal(alone, out[i:i + 1]), f"lane {i} alone differs from the batch"
    print("decode attention: each lane alone equals the batch")


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
    from ninfer_core.nn import gdn as ref_gdn

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


def _moe_weights(device, e, hidden, inter, shared_inter, dt, gen):
    """Random fused expert tensors and shared-expert weights at GEMV-friendly scales."""
    def w(*shape, fan_in):
        return (torch.randn(*shape, generator=gen, device=device) / fan_in**0.5).to(dt)

    gate_up = w(e, 2 * inter, hidden, fan_in=hidden)
    down = w(e, hidden, inter, fan_in=inter)
    shared = (w(shared_inter, hidden, fan_in=hidden), w(shared_inter, hidden, fan_in=hidden),
              w(hidden, shared_inter, fan_in=shared_inter), w(1, hidden, fan_in=hidden))
    return gate_up, down, shared


def _route(x, router, k):
    """The Router's math: fp32 softmax, top-k, normalised, weights in x's dtype."""
    probs = torch.softmax(torch.nn.functional.linear(x, router), dim=-1, dtype=torch.float32)
    top_w, top_i = torch.topk(probs, k, dim=-1)
    return (top_w / top_w.sum(-1, keepdim=True)).to(x.dtype), top_i


def moe_decode(device="cpu", e=16, hidden=320, inter=96, k=4, ns=(1, 3, 8), tol=1e-2):
    """moe_kernels.moe_decode (gate/up+SiLU*up, down+combine+gated shared expert) against the
    gathered-expert reference, with and without the shared expert, with repeated experts across
    rows, and with a shared expert of another width (torch path)."""
    from ninfer_core.accel import moe_kernels as MK

    gen = torch.Generator(device=device).manual_seed(21)
    dt = act_dtype(device)
    gate_up, down, shared = _moe_weights(device, e, hidden, inter, inter, dt, gen)
    router = torch.randn(e, hidden, generator=gen, device=device).to(dt)
    for n in ns:
        x = torch.randn(n, hidden, generator=gen, device=device).to(dt)
        top_w, top_i = _route(x, router, k)
        if n > 1:
            top_i[1] = top_i[0]  # two rows that picked the same experts read them twice
        for sh in (shared, None):
            ref = MK.ref_moe_decode(x, top_w, top_i, gate_up, down, sh)
            out = MK.moe_decode(x, top_w, top_i, gate_up, down, sh)
            err = rel(out, ref)
            print(f"moe_decode n={n} shared={'yes' if sh else 'no'}: {err:.2e}")
            assert err < tol
    _, _, wide = _moe_weights(device, 1, hidden, inter, 2 * inter, dt, gen)
    x = torch.randn(2, hidden, generator=gen, device=device).to(dt)
    top_w, top_i = _route(x, router, k)
    err = rel(MK.moe_decode(x, top_w, top_i, gate_up, down, wide),
              MK.ref_moe_decode(x, top_w, top_i, gate_up, down, wide))
    print(f"moe_decode, shared expert of another width: {err:.2e}")
    assert err < tol


def moe_grouped(device="cpu", e=16, hidden=320, inter=96, k=4, n=70, tol=1e-2, gmm=None):
    """The grouped-GEMM expert path (sorted pairs, device offsets) against the expert loop, with
    experts that got no tokens; `gmm` None = the loop stand-in for torch._grouped_mm."""
    from ninfer_core.accel import moe_kernels as MK

    gen = torch.Generator(device=device).manual_seed(23)
    dt = act_dtype(device) if gmm is None else torch.bfloat16
    gate_up, down, _ = _moe_weights(device, e, hidden, inter, inter, dt, gen)
    skip = e // 4  # the first quarter of the experts is never chosen: empty groups
    router = torch.randn(e - skip, hidden, generator=gen, device=device).to(dt)
    x = torch.randn(n, hidden, generator=gen, device=device).to(dt)
    top_w, top_i = _route(x, router, k)
    top_i = top_i + skip
    order, offs = MK.sort_pairs(top_i, e)
    counts = torch.bincount(top_i.reshape(-1), minlength=e)
    assert offs.dtype == torch.int32 and torch.equal(offs.long(), counts.cumsum(0))
    assert torch.equal(top_i.reshape(-1)[order], torch.sort(top_i.reshape(-1)).values)
    assert int(counts[:skip].sum()) == 0 and int((counts > 0).sum()) > 1
    ref = _expert_loop(x, top_w, top_i, gate_up, down)
    out = MK.grouped_experts_with(gmm or MK.loop_grouped_mm, x, top_w, top_i, gate_up, down)
    err = rel(out, ref)
    print(f"grouped experts ({'loop stand-in' if gmm is None else 'grouped_mm'}) n={n}: {err:.2e}")
    assert err < tol
    y = torch.randn(n * k + 5, hidden + 8, generator=gen, device=device).to(dt)[:, :hidden]  # strided rows
    pos = torch.randperm(n * k + 5, generator=torch.Generator().manual_seed(n))[: n * k].view(n, k).to(device)
    err = rel(MK.combine_rows(y, pos, top_w), MK.ref_combine_rows(y, pos, top_w))
    print(f"combine_rows n={n}: {err:.2e}")
    assert err < tol


def _expert_loop(x, top_w, top_i, gate_up, down):
    """moe.Experts.forward_loop on these tensors."""
    from types import SimpleNamespace

    from ninfer_core.nn.moe import Experts

    ex = SimpleNamespace(num_experts=gate_up.shape[0], gate_up_proj=gate_up, down_proj=down)
    return Experts.forward_loop(ex, x, top_w, top_i)


def attn_decode_fused(device="cpu", heads=8, kvh=2, d=64, rot=16, lens=(1, 70, 200, 64), page=64, tol=2e-2):
    """K/V rows written by the q/k norm + RoPE kernel and the output gate applied in the combine,
    against the chain (qk_norm_rope, index_put, paged decode, sigmoid * o) and the references."""
    gen = torch.Generator(device=device).manual_seed(33)
    dt = act_dtype(device)
    n = len(lens)
    width = -(-max(lens) // page) + 1
    num_pages = n * width + 3
    kc, vc = _pool(num_pages, page, kvh, d, device, gen)
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(34)).tolist()
    table = torch.tensor([perm[i * width:(i + 1) * width] for i in range(n)], dtype=torch.int32).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    pos = seq_lens.long() - 1
    wpage = table.long().gather(1, (pos // page)[:, None])[:, 0].contiguous()
    wrow = (pos % page).contiguous()
    p = torch.randn(n, heads * 2 * d + 2 * kvh * d + 8, generator=gen, device=device).to(dt)
    qg = p[:, : heads * 2 * d].view(n, heads, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]
    k = p[:, heads * 2 * d: heads * 2 * d + kvh * d].view(n, kvh, d)
    v = p[:, heads * 2 * d + kvh * d: heads * 2 * d + 2 * kvh * d].view(n, kvh, d)
    qw = (torch.randn(d, generator=gen, device=device) * 0.1).to(dt)
    kw = (torch.randn(d, generator=gen, device=device) * 0.1).to(dt)
    ang = torch.rand(n, rot // 2, generator=gen, device=device) * 6
    cos = torch.cat([ang, ang], -1).cos().to(dt)
    sin = torch.cat([ang, ang], -1).sin().to(dt)
    scale = d**-0.5
    # poison the rows to be written so a missed write shows
    kc[wpage, wrow] = float("nan")
    vc[wpage, wrow] = float("nan")
    caches = {name: (kc.clone(), vc.clone()) for name in ("fused", "chain", "ref")}
    fk, fv = caches["fused"]
    qf = K.qk_norm_rope_kv(q, k, v, qw, kw, cos, sin, 1e-6, fk, fv, wpage, wrow)
    out = K.paged_decode_attention_gated(qf, fk, fv, table, seq_lens, scale, gate)
    ck, cv = caches["chain"]
    qc, kk = K.qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6)
    ck[wpage, wrow] = kk
    cv[wpage, wrow] = v
    chain = K.paged_decode_attention(qc, ck, cv, table, seq_lens, scale).reshape(n, -1) * torch.sigmoid(
        gate.reshape(n, -1))
    rk, rv = caches["ref"]
    qr = K.ref_qk_norm_rope_kv(q, k, v, qw, kw, cos, sin, 1e-6, rk, rv, wpage, wrow)
    ref = K.ref_paged_decode_attention_gated(qr, rk, rv, table, seq_lens, scale, gate)
    assert torch.isfinite(fk).all() and torch.isfinite(fv).all()
    assert torch.equal(fv, cv), "v rows differ from the chain's"
    # same math as qk_norm_rope: equal up to one rounding flip (exact under the interpreter)
    assert ulp_close(fk, ck) and ulp_close(qf, qc), "q / k rows differ from the chain's"
    e_chain, e_ref = rel(out, chain), rel(out, ref)
    e_cache = max(rel(fk, rk), rel(fv, rv))
    print(f"attention decode fused: vs chain {e_chain:.2e}, vs reference {e_ref:.2e}, cache vs reference {e_cache:.2e}")
    assert e_chain < 2e-3 and e_ref < tol and e_cache < tol
    for pps in (1, 2):
        e = rel(K.paged_decode_attention_gated(qf, fk, fv, table, seq_lens, scale, gate, pages_per_split=pps), ref)
        print(f"attention decode fused pps={pps}: vs reference {e:.2e}")
        assert e < tol


def moe_route(device="cpu", e=16, k=4, ns=(1, 3, 8), tol=1e-2):
    """route_topk (softmax, top-k, normalise in one launch) against the Router's math: the same
    chosen probabilities in the same order (ids equal up to ties between equal logits), distinct
    ids per row, weights within the dtype's rounding."""
    from ninfer_core.accel import moe_kernels as MK

    gen = torch.Generator(device=device).manual_seed(25)
    dt = act_dtype(device)
    for n in ns:
        logits = (torch.randn(n, e + 3, generator=gen, device=device) * 3).to(dt)[:, :e]  # strided rows
        for norm in (True, False):
            rw, ri = MK.ref_route_topk(logits, k, norm)
            ow, oi = MK.route_topk(logits, k, norm)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            assert oi.dtype == ri.dtype and torch.equal(probs.gather(1, oi), probs.gather(1, ri)), (oi, ri)
            assert all(len(set(r)) == k for r in oi.tolist())
            same = int((oi == ri).all(1).sum())
            err = rel(ow, rw)
            print(f"route_topk n={n} e={e} k={k} normalize={norm}: {same}/{n} rows same ids, weights {err:.2e}")
            assert err < tol


def runner_interpret_moe():
    """The GPU runner on a tiny MoE artifact with its Triton kernels (interpreted, fp32) against
    the reference runner: short chunks and decode rounds take the MoE decode kernels, longer
    chunks the expert loop (the CPU path)."""
    import tempfile

    from ninfer_qwen35.family import Qwen35Family
    from ninfer_qwen35.gpu.runner import MOE_GATHER_MAX_TOKENS, GpuQwen35Runner
    from ninfer_qwen35.testing import build_tiny_artifact

    from ninfer_core.artifact import Artifact
    from ninfer_core.engine.model_api import SeqView

    with tempfile.TemporaryDirectory() as d:
        art = Artifact.open(build_tiny_artifact(f"{d}/t.ninfer", kind="moe", seed=6, num_layers=4))
        ref = Qwen35Family().load(art)
        fast = GpuQwen35Runner.from_runner(Qwen35Family().load(art))
        assert fast.cfg.is_moe
        outs = []
        for r in (ref, fast):
            r.allocate_cache(16, 3)
            a = SeqView(slot=0, pages=[5, 2, 9], num_cached=0)
            b = SeqView(slot=2, pages=[7, 1], num_cached=0)
            g = torch.Generator().manual_seed(8)
            ta = torch.randint(0, 500, (100,), generator=g).tolist()
            tb = torch.randint(0, 500, (40,), generator=g).tolist()
            rows = [r.prefill(a, ta[:60], all_logits=True)]
            a.num_cached = 60
            rows.append(r.prefill(a, ta[60 : 60 + MOE_GATHER_MAX_TOKENS], all_logits=True))
            a.num_cached = 60 + MOE_GATHER_MAX_TOKENS
            rows.append(r.prefill(b, tb[:3], all_logits=True))
            b.num_cached = 3
            for i in range(3):
                rows.append(r.decode([a, b], [ta[80 + i], tb[10 + i]]))
                a.num_cached += 1
                b.num_cached += 1
            outs.append(torch.cat(rows))
        err = rel(outs[1], outs[0])
        print(f"MoE runner with interpreted kernels vs reference: {err:.2e}")
        assert err < 1e-4, err


def decode_attention_key_start(device="cpu", heads=8, kvh=2, d=64, lens=(2, 70, 200, 65), page=64, tol=2e-2):
    """The draft head's attention: keys from position 1 (its row 0 holds nothing)."""
    gen = torch.Generator(device=device).manual_seed(11)
    width = -(-max(lens) // page) + 1
    num_pages = len(lens) * width + 3
    kc, vc = _pool(num_pages, page, kvh, d, device, gen)
    kc[:, 0] = 1e4  # a poisoned row 0: any weight on it shows
    table = torch.arange(len(lens) * width, dtype=torch.int32, device=device).view(len(lens), width)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), heads, d, generator=gen, device=device).to(act_dtype(device))
    ref = K.ref_paged_decode_attention(q, kc, vc, table, seq_lens, d**-0.5, key_start=1)
    for pps in (None, 1):
        out = K.paged_decode_attention(q, kc, vc, table, seq_lens, d**-0.5, pages_per_split=pps, key_start=1)
        err = rel(out, ref)
        print(f"decode attention key_start=1 pps={pps}: rel err {err:.2e}")
        assert err < tol, err


def verify_kernels(device="cpu", hk=2, hv=4, dk=32, dv=64, lanes=3, t=5, tol=1e-4):
    """conv_verify / conv_commit and gdn_verify / gdn_commit (both commit modes) against their
    references, and against the decode kernels run token by token (the commit must leave exactly
    the state decoding the kept rows would)."""
    from ninfer_qwen35.gpu import verify_kernels as VK

    gen = torch.Generator(device=device).manual_seed(12)
    dt = act_dtype(device)
    conv = 2 * hk * dk + hv * dv
    slots_n = 2 * lanes
    slots = torch.tensor([(5 * i + 4) % slots_n for i in range(lanes)], dtype=torch.int64, device=device)
    x = torch.randn(lanes * t, conv, generator=gen, device=device).to(dt)
    w = (torch.randn(conv, 4, generator=gen, device=device) * 0.5).to(dt)
    conv_state = torch.randn(slots_n, conv, 3, generator=gen, device=device).to(dt)
    ref = VK.ref_conv_verify(x.float(), conv_state.float(), w.float(), slots, t)
    out = VK.conv_verify(x, conv_state, w, slots, t)
    e = rel(out, ref)
    print(f"conv verify: rel err {e:.2e}")
    assert e < 2e-2
    kept = torch.tensor([[1, 5, 3][i % 3] if t >= 5 else 1 + i % t for i in range(lanes)], dtype=torch.int64,
                        device=device)
    want = conv_state.clone()
    VK.ref_conv_commit(x, want, slots, kept, t)
    got = conv_state.clone()
    VK.conv_commit(x, got, slots, kept, t)
    assert torch.equal(got, want), "conv commit differs"
    # the recurrence: verify outputs, then both commits against token-by-token decode steps
    mixed = torch.randn(lanes * t, conv, generator=gen, device=device)
    a_raw = torch.randn(lanes * t, hv, generator=gen, device=device)
    b_raw = torch.randn(lanes * t, hv, generator=gen, device=device)
    A_log = torch.rand(hv, generator=gen, device=device) * 2
    dt_bias = torch.randn(hv, generator=gen, device=device)
    state = torch.randn(slots_n, hv, dk, dv, generator=gen, device=device)
    before = state.clone()
    ref_out = VK.ref_gdn_verify(mixed, a_raw, b_raw, A_log, dt_bias, state.clone(), slots, t, hk, dk, dv, dk**-0.5)
    pos = torch.full((lanes, t, hv, dk, dv), float("nan"), device=device)
    out = VK.gdn_verify(mixed, a_raw, b_raw, A_log, dt_bias, state, slots, t, hk, dk, dv, dk**-0.5, positions=pos)
    assert torch.equal(state, before), "verify wrote the state"
    e = rel(out, ref_out)
    print(f"gdn verify: rel err {e:.2e}")
    assert e < tol
    steps = before.clone()
    rows = torch.arange(lanes, device=device) * t
    for j in range(t):
        live = (kept > j).nonzero().flatten()
        if live.numel():
            K.ref_gdn_decode(mixed[rows[live] + j], a_raw[rows[live] + j], b_raw[rows[live] + j], A_log, dt_bias,
                             steps, slots[live], hk, dk, dv, dk**-0.5)
    recompute = before.clone()
    VK.gdn_commit(mixed, a_raw, b_raw, A_log, dt_bias, recompute, slots, kept, t, hk, dk, dv, dk**-0.5)
    copied = before.clone()
    VK.positions_commit(copied, pos, slots, kept)
    e1, e2 = rel(recompute, steps), rel(copied, steps)
    print(f"gdn commit: recompute rel err {e1:.2e}, positions rel err {e2:.2e}")
    assert e1 < tol and e2 < tol


def runner_interpret_verify():
    """The GPU runner's verify forward and commit with interpreted kernels (and its MTP head)
    against the reference runner, on a mixed batch of three lanes of 3, 1 and 5 tokens."""
    import tempfile

    from ninfer_qwen35.family import Qwen35Family
    from ninfer_qwen35.gpu.runner import GpuQwen35Runner
    from ninfer_qwen35.testing import build_tiny_artifact

    from ninfer_core.artifact import Artifact
    from ninfer_core.engine.model_api import DraftStep, ForwardBatch, LaneSegment, SeqView

    with tempfile.TemporaryDirectory() as d:
        art = Artifact.open(build_tiny_artifact(f"{d}/t.ninfer", kind="dense", seed=5, num_layers=4))
        outs = []
        for fast in (False, True):
            r = Qwen35Family().load(art)
            if fast:
                r = GpuQwen35Runner.from_runner(r)
            r.enable_draft_head("mtp")
            r.allocate_cache(16, 4)
            g = torch.Generator().manual_seed(3)
            lanes = [SeqView(0, [5, 2], 0), SeqView(2, [7, 1], 0), SeqView(3, [3, 9], 0)]
            rows = []
            for v, n in zip(lanes, (70, 20, 64)):
                rows.append(r.prefill(v, torch.randint(0, 500, (n,), generator=g).tolist(), all_logits=True))
                v.num_cached = n
            toks = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (3, 1, 5)]
            segs = [LaneSegment(v.slot, {gr: v.pages for gr in r.cache_spec().group_names}, v.num_cached, t,
                                "verify", "all") for v, t in zip(lanes, toks)]
            rows += [o.logits for o in r.forward(ForwardBatch(segs))]
            r.commit([(0, 2), (2, 1), (3, 5)])
            for v, k in zip(lanes, (2, 1, 5)):
                v.num_cached += k
            rows.append(r.decode(lanes, [11, 12, 13]))
            for v in lanes:
                v.num_cached += 1
            h = r.draft.step([DraftStep(v.slot, v.num_cached, 7, v.pages) for v in lanes])
            rows.append(r.logits(h))
            outs.append(torch.cat(rows))
        err = rel(outs[1], outs[0])
        print(f"runner verify/commit with interpreted kernels vs reference: {err:.2e}")
        assert err < 1e-4, err
