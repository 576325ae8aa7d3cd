"""Cases of the Gemma 4 attention kernel checks (run by test_gemma4_kernels.py, in a subprocess
with TRITON_INTERPRET=1 on the CPU, or directly on CUDA by tests/gpu)."""

from __future__ import annotations

import random

import torch
from ninfer_gemma4.gpu.attention import paged_attention, ref_paged_attention, use_triton


def dense_attention(q_rows, keys, vals, qpos, window, scale):
    """Plain attention over a contiguous key run (an independent check of the paged reference)."""
    n, h, d = q_rows.shape
    kvh = keys.shape[1]
    g = h // kvh
    kpos = torch.arange(keys.shape[0])
    mask = kpos[None, :] <= qpos[:, None]
    if window > 0:
        mask &= kpos[None, :] > qpos[:, None] - window
    out = torch.empty(n, h, d, dtype=torch.float64)
    for hh in range(h):
        s = (q_rows[:, hh].double() @ keys[:, hh // g].double().T) * scale
        s = s.masked_fill(~mask, float("-inf"))
        out[:, hh] = torch.softmax(s, dim=-1) @ vals[:, hh // g].double()
    return out


def build(starts, qlens, h, kvh, d, window, page, dtype=torch.float32, device="cpu", seed=0):
    """Random caches and queries; each lane's pages are scattered over the pool, and with a window
    the pages wholly behind every query's window point at a page full of NaN (never to be read)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    ends = [s + n for s, n in zip(starts, qlens)]
    need = [-(-e // page) for e in ends]
    num_pages = sum(need) + 1
    k_cache = torch.randn(num_pages, page, kvh, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, page, kvh, d, generator=gen).to(dtype)
    poison = num_pages - 1
    k_cache[poison] = float("nan")
    v_cache[poison] = float("nan")
    ids = list(range(num_pages - 1))
    rng.shuffle(ids)
    tables, dense_k, dense_v = [], [], []
    for b, (s, n) in enumerate(zip(starts, qlens)):
        table = [ids.pop() for _ in range(need[b])]
        dense_k.append(k_cache[table].reshape(-1, kvh, d)[: ends[b]].clone())
        dense_v.append(v_cache[table].reshape(-1, kvh, d)[: ends[b]].clone())
        if window > 0:
            lo = max(0, s - window + 1)
            table = [poison if (i + 1) * page <= lo else p for i, p in enumerate(table)]
        tables.append(table)
    q = torch.randn(sum(qlens), h, d, generator=gen).to(dtype)
    return (q.to(device), k_cache.to(device), v_cache.to(device), tables, dense_k, dense_v)


SHAPES = [  # (starts, qlens, H, KVH, D, window, page)
    ([0, 37, 150], [40, 7, 1], 4, 2, 32, 48, 16),  # a sliding prefill crossing the window, chunks of 7, decode
    ([0, 37, 150], [40, 7, 1], 4, 1, 64, 0, 16),  # global (no window), G = 4
    ([5, 63, 64, 200], [1, 1, 1, 1], 8, 2, 48, 32, 16),  # a decode batch at page edges, D not a power of 2
    ([100], [33], 2, 2, 32, 20, 16),  # window narrower than the chunk
]


def check(dtype=torch.float32, device="cpu", tol=1e-4, shapes=SHAPES):
    worst = 0.0
    for i, (starts, qlens, h, kvh, d, window, page) in enumerate(shapes):
        q, kc, vc, tables, dk, dv = build(starts, qlens, h, kvh, d, window, page, dtype, device, seed=i)
        scale = 1.0 if i % 2 == 0 else d ** -0.5
        ref = ref_paged_attention(q.cpu().float(), kc.cpu().float(), vc.cpu().float(), tables, starts, qlens,
                                  window, scale)
        off = 0
        for b, (s, n) in enumerate(zip(starts, qlens)):
            want = dense_attention(q[off: off + n].cpu().float(), dk[b].float(), dv[b].float(),
                                   torch.arange(s, s + n), window, scale)
            # fp32 against fp64: long rows of wide heads (the real geometry) round at ~1e-5 of the scale
            bound = 1e-5 * max(1.0, float(want.abs().max())) * (1 if n * d < 4096 else 10)
            assert torch.allclose(ref[off: off + n].double(), want, atol=bound), f"reference wrong in shape {i}"
            off += n
        assert use_triton(q), "the kernel would not run"
        got = paged_attention(q, kc, vc, tables, starts, qlens, window, scale).float().cpu()
        assert torch.isfinite(got).all(), f"shape {i}: non-finite output (a page behind the window was read?)"
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, err)
        assert err <= tol, f"shape {i}: max relative error {err:.2e} > {tol}"
    print(f"gemma4 paged attention: worst max relative error {worst:.2e} over {len(shapes)} shapes ({dtype})")


def check_ring(dtype=torch.float32, device="cpu", tol=1e-4):
    """Sliding attention through a ring table (`wrap`): each lane's positions live in ring page
    (p // page) % R of its own R pages, R * page >= qlen + window - 1; the kernel and the reference
    against plain attention over the dense keys."""
    cases = [([0, 90, 301], [40, 7, 1], 4, 2, 32, 24, 16), ([500, 77], [1, 16], 8, 2, 48, 20, 16)]
    worst = 0.0
    for i, (starts, qlens, h, kvh, d, window, page) in enumerate(cases):
        gen = torch.Generator().manual_seed(10 + i)
        rings = [-(-(n + window - 1) // page) for n in qlens]
        r = max(rings)
        # rows the ring does not hold yet are garbage of a large size (a real ring holds stale rows
        # there): masked, they add nothing; read through a wrong mapping, they swamp the result
        kc = 1e3 * torch.randn(len(starts) * r, page, kvh, d, generator=gen)
        vc = 1e3 * torch.randn(len(starts) * r, page, kvh, d, generator=gen)
        tables, dense = [], []
        for b, (st, n) in enumerate(zip(starts, qlens)):
            end = st + n
            dk, dv = torch.randn(end, kvh, d, generator=gen), torch.randn(end, kvh, d, generator=gen)
            for p in range(max(0, end - r * page), end):  # what the ring holds after the forward's writes
                kc[b * r + (p // page) % r, p % page] = dk[p]
                vc[b * r + (p // page) % r, p % page] = dv[p]
            tables.append(list(range(b * r, b * r + r)))
            dense.append((dk, dv))
        q = torch.randn(sum(qlens), h, d, generator=gen)
        ref = ref_paged_attention(q, kc, vc, tables, starts, qlens, window, 1.0, wrap=r)
        off = 0
        for b, (st, n) in enumerate(zip(starts, qlens)):
            want = dense_attention(q[off: off + n], dense[b][0], dense[b][1], torch.arange(st, st + n), window, 1.0)
            assert torch.allclose(ref[off: off + n].double(), want, atol=1e-5), f"ring reference wrong in case {i}"
            off += n
        got = paged_attention(q.to(device, dtype), kc.to(device, dtype), vc.to(device, dtype), tables, starts, qlens,
                              window, 1.0, wrap=r).float().cpu()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, err)
        assert err <= tol, f"ring case {i}: max relative error {err:.2e} > {tol}"
    print(f"gemma4 ring attention: worst max relative error {worst:.2e} over {len(cases)} cases ({dtype})")


def check_experts(dtype=torch.float32, device="cpu", tol=1e-4):
    """The expert GEMV against its reference, and the decode experts against the expert loop."""
    from ninfer_gemma4.gpu.moe import expert_gemv, experts_decode, ref_expert_gemv
    from ninfer_gemma4.layers import Experts

    gen = torch.Generator().manual_seed(4)
    e, hid, inter, k, t = 8, 48, 40, 2, 5
    x = torch.randn(t, hid, generator=gen)
    gate_up = torch.randn(e, 2 * inter, hid, generator=gen) * hid ** -0.5
    down = torch.randn(e, hid, inter, generator=gen) * inter ** -0.5
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=gen), -1)
    dev = lambda z: z.to(device, dtype if z.is_floating_point() else z.dtype)
    got = expert_gemv(dev(x), dev(gate_up), dev(idx.reshape(-1)), k).float().cpu()
    want = ref_expert_gemv(x, gate_up, idx.reshape(-1), k)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= tol, f"expert GEMV: {err:.2e}"
    loop = Experts.__new__(Experts)
    torch.nn.Module.__init__(loop)
    loop.gate_up_proj, loop.down_proj, loop.activation = gate_up, down, "gelu_pytorch_tanh"
    want = loop.forward_loop(x, w, idx)
    got = experts_decode(dev(x), dev(w), dev(idx), dev(gate_up), dev(down), "gelu_pytorch_tanh").float().cpu()
    err2 = ((got - want).abs().max() / want.abs().max()).item()
    assert err2 <= tol, f"decode experts against the loop: {err2:.2e}"
    print(f"gemma4 expert GEMV: max relative error {err:.2e}; decode experts vs loop {err2:.2e} ({dtype})")


def check_norm(dtype=torch.float32, device="cpu", tol=1e-5):
    """The one-launch RMSNorm against its torch reference: scaled and unscaled, rows of any rank,
    widths not a power of two."""
    from ninfer_gemma4.gpu.norm import ref_rms_norm, rms_norm

    gen = torch.Generator().manual_seed(8)
    worst = 0.0
    for shape, scaled in (((3, 96), True), ((5, 4, 48), True), ((2, 3, 40), False), ((1, 5376), True)):
        x = (3 * torch.randn(*shape, generator=gen)).to(device, dtype)
        w = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(device, dtype) if scaled else None
        got, want = rms_norm(x, w, 1e-6).float().cpu(), ref_rms_norm(x, w, 1e-6).float().cpu()
        err = float((got - want).abs().max() / want.abs().max())
        worst = max(worst, err)
        assert err <= tol, f"rms norm {shape}: {err:.2e}"
    print(f"gemma4 rms norm: worst max relative error {worst:.2e} ({dtype})")


def check_fused(dtype=torch.float32, device="cpu", tol=1e-5):
    """The fused norm+RoPE (returned, and scattered into a paged cache at write rows) and the fused
    residual add against their torch forms: scaled and unscaled norms, head widths of both layer
    types' shapes cut small, a strided view of a projection output as input."""
    from ninfer_gemma4.gpu.fused import add_rms_norm, norm_rope, ref_add_rms_norm, ref_norm_rope
    from ninfer_gemma4.layers import rope_tables

    gen = torch.Generator().manual_seed(9)
    worst = 0.0

    def rel(a, b):
        return float((a.float().cpu() - b.float().cpu()).abs().max() / b.float().cpu().abs().max())

    for n, h, d in ((5, 3, 32), (1, 2, 64), (4, 1, 48)):
        proj = (2 * torch.randn(n, h * d + 16, generator=gen)).to(device, dtype)
        x = proj[:, 8: 8 + h * d].view(n, h, d)  # a strided view, as q_proj(x).view(...) of a wider output
        w = (1 + 0.2 * torch.randn(d, generator=gen)).to(device, dtype)
        freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        freq[d // 4:] = 0  # the proportional kind: part of the pairs unrotated
        cos, sin = rope_tables(freq.to(device), torch.arange(7, 7 + n, device=device), dtype)
        for weight, rope in ((w, True), (None, False), (w, False)):
            c, s_ = (cos, sin) if rope else (None, None)
            err = rel(norm_rope(x, weight, 1e-6, c, s_), ref_norm_rope(x, weight, 1e-6, c, s_))
            worst = max(worst, err)
            assert err <= tol, f"norm_rope {n, h, d} weight={weight is not None} rope={rope}: {err:.2e}"
            cache = torch.full((4, 8, h, d), float("nan"), dtype=dtype, device=device)
            want = cache.clone()
            page = torch.tensor([3, 0, 2, 1, 3][:n], device=device)
            row = torch.tensor([7, 0, 5, 2, 1][:n], device=device)
            norm_rope(x, weight, 1e-6, c, s_, out=cache, page=page, row=row)
            want[page, row] = ref_norm_rope(x, weight, 1e-6, c, s_).to(dtype)
            hit = ~torch.isnan(want)
            assert torch.equal(torch.isnan(cache), torch.isnan(want)), "norm_rope wrote outside its rows"
            err = rel(cache[hit], want[hit])
            worst = max(worst, err)
            assert err <= tol, f"norm_rope scatter {n, h, d}: {err:.2e}"
    for rows, d in ((3, 96), (1, 5376 // 8)):
        base = torch.randn(rows, d, generator=gen).to(device, dtype)
        y = (3 * torch.randn(rows, d, generator=gen)).to(device, dtype)
        w = (1 + 0.2 * torch.randn(d, generator=gen)).to(device, dtype)
        scale = torch.tensor([0.7], dtype=dtype, device=device)
        for sc in (None, scale):
            err = rel(add_rms_norm(base, y, w, 1e-6, sc), ref_add_rms_norm(base, y, w, 1e-6, sc))
            worst = max(worst, err)
            assert err <= tol, f"add_rms_norm {rows, d} scale={sc is not None}: {err:.2e}"
    print(f"gemma4 fused norm/rope/residual kernels: worst max relative error {worst:.2e} ({dtype})")


def fused_runner_interpret():
    """The runner with the fused small kernels (norm+RoPE+cache write, residual adds, RMSNorm) on
    against the same runner's torch forms, the paged attention on its torch path in both (its
    kernel has its own checks): a batch of 3 prefills, one crossing the window, then decode steps;
    both test shapes (PLE and shared KV in e2b, the MoE block in 26b-a4b)."""
    import tempfile

    from ninfer_gemma4 import attention, layers
    from ninfer_gemma4.family import Gemma4Family
    from ninfer_gemma4.testing import build_tiny_artifact

    from ninfer_core.artifact import Artifact
    from ninfer_core.engine.model_api import DECODE, LOGITS_ALL, ForwardBatch, LaneSegment, RunnerOptions

    attention.use_triton = lambda t: False
    kernels = layers._use_kernels
    ids = [int(x) for x in torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(4))]
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for seed, kind in enumerate(("e2b", "26b-a4b")):
            runner = Gemma4Family().load(Artifact.open(build_tiny_artifact(f"{tmp}/{kind}.ninfer", kind=kind,
                                                                           seed=seed + 3, window=20)))
            groups = runner.cache_spec().group_names

            def run(use, runner=runner, groups=groups):
                layers._use_kernels = use
                runner.free_cache()
                runner.configure(RunnerOptions(max_segment_tokens=32))
                runner.allocate_cache(12, 3, page_size=16)
                tab = {i: {g: list(range(i * 4, i * 4 + 4)) for g in groups} for i in range(3)}
                prompts = [ids[:27], ids[3:9], ids[12:17]]
                outs = [o.logits for o in runner.forward(ForwardBatch(
                    [LaneSegment(i, tab[i], 0, p, logits=LOGITS_ALL) for i, p in enumerate(prompts)]))]
                for step in range(2):
                    outs += [o.logits for o in runner.forward(ForwardBatch(
                        [LaneSegment(i, tab[i], len(prompts[i]) + step, [ids[30 + step]], DECODE) for i in range(3)]))]
                return outs

            try:
                want = run(lambda t: False)
                got = run(lambda t: True)
            finally:
                layers._use_kernels = kernels
            for a, b in zip(got, want):
                err = float((a - b).abs().max() / b.abs().max())
                worst = max(worst, err)
                assert err <= 1e-4, f"{kind}: runner with the fused kernels differs by {err:.2e}"
    print(f"gemma4 runner with the fused kernels: worst max relative logits error {worst:.2e}")


DECODE_SHAPES = [  # (positions, H, KVH, D, window, page): one query per lane
    ([0, 37, 150, 63, 64], 4, 2, 32, 48, 16),  # sliding: the first key, page edges, past the window
    ([0, 37, 150, 1000], 8, 1, 64, 0, 16),  # global, G = 8, a long lane beside short ones
    ([5, 63, 64, 200], 8, 2, 48, 32, 16),  # D not a power of 2
    ([300], 4, 2, 32, 20, 32),  # window narrower than a key block of the page
]


def check_decode(dtype=torch.float32, device="cpu", tol=1e-4, shapes=DECODE_SHAPES, split_counts=(None, 1, 3)):
    """The split decode (`decode_attention`) against the reference and plain attention, with pages
    behind the window poisoned (NaN), at the default part count and forced ones; each lane alone
    gives the same bits as in the batch (the part count does not depend on the batch); a ring
    table (`wrap`) the same way."""
    from ninfer_gemma4.gpu.attention import decode_attention

    worst = 0.0
    for i, (pos, h, kvh, d, window, page) in enumerate(shapes):
        ones = [1] * len(pos)
        q, kc, vc, tables, dk, dv = build(pos, ones, h, kvh, d, window, page, dtype, device, seed=30 + i)
        ref = ref_paged_attention(q.cpu().float(), kc.cpu().float(), vc.cpu().float(), tables, pos, ones, window,
                                  1.0)
        for b, p in enumerate(pos):
            want = dense_attention(q[b: b + 1].cpu().float(), dk[b].float(), dv[b].float(), torch.tensor([p]),
                                   window, 1.0)
            # fp32 against fp64 over up to a window of wide-head keys (the real geometry): ~1e-5 of the scale
            bound = 1e-5 * max(1.0, float(want.abs().max())) * (1 if d < 256 else 10)
            assert torch.allclose(ref[b: b + 1].double(), want, atol=bound), f"reference wrong in decode shape {i}"
        width = max(len(t) for t in tables)
        tab = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
        positions = torch.tensor(pos, dtype=torch.int64, device=device)
        for splits in split_counts:
            got = decode_attention(q, kc, vc, tab, positions, window, 1.0, splits=splits)
            assert torch.isfinite(got.float()).all(), f"decode shape {i}: non-finite (a page behind the window read?)"
            err = ((got.float().cpu() - ref).abs().max() / ref.abs().max()).item()
            worst = max(worst, err)
            assert err <= tol, f"decode shape {i}, splits {splits}: max relative error {err:.2e} > {tol}"
            if splits is None:
                for b in range(len(pos)):
                    alone = decode_attention(q[b: b + 1], kc, vc, tab[b: b + 1], positions[b: b + 1], window, 1.0)
                    assert torch.equal(alone, got[b: b + 1]), f"decode shape {i}: lane {b} alone differs from batched"
    # a ring: lane b's position p lives in ring page (p // page) % R of its own R pages
    gen = torch.Generator().manual_seed(77)
    pos, h, kvh, d, window, page = [500, 77, 20], 4, 2, 32, 24, 16
    r = -(-(1 + window - 1) // page) + 1
    kc = 1e3 * torch.randn(len(pos) * r, page, kvh, d, generator=gen)
    vc = 1e3 * torch.randn(len(pos) * r, page, kvh, d, generator=gen)
    rows = []
    for b, p in enumerate(pos):
        dk, dv = torch.randn(p + 1, kvh, d, generator=gen), torch.randn(p + 1, kvh, d, generator=gen)
        for j in range(max(0, p + 1 - r * page), p + 1):
            kc[b * r + (j // page) % r, j % page] = dk[j]
            vc[b * r + (j // page) % r, j % page] = dv[j]
        rows.append((dk, dv))
    q = torch.randn(len(pos), h, d, generator=gen)
    tables = [list(range(b * r, b * r + r)) for b in range(len(pos))]
    tab = torch.tensor(tables, dtype=torch.int32, device=device)
    got = decode_attention(q.to(device, dtype), kc.to(device, dtype), vc.to(device, dtype), tab,
                           torch.tensor(pos, device=device), window, 1.0, wrap=r).float().cpu()
    for b, p in enumerate(pos):
        want = dense_attention(q[b: b + 1], rows[b][0], rows[b][1], torch.tensor([p]), window, 1.0).float()
        err = ((got[b: b + 1] - want).abs().max() / want.abs().max()).item()
        worst = max(worst, err)
        assert err <= tol, f"ring decode lane {b}: max relative error {err:.2e} > {tol}"
    print(f"gemma4 split decode attention: worst max relative error {worst:.2e} over {len(shapes)} shapes "
          f"and a ring ({dtype})")


def interpreted():
    check()
    check_decode()
    check_norm()
    check_fused()
    check_ring()
    check_experts()


def runner_interpret():
    """The Gemma 4 runner with the interpreted kernel against its torch path, on both test shapes
    (sliding + global, shared KV, K=V): a batch of 3 prefills (one crossing the window), chunks of 7
    across it, then batched decode steps past it."""
    import tempfile

    from ninfer_gemma4 import attention, layers
    from ninfer_gemma4.family import Gemma4Family

    layers._use_kernels = lambda x: False  # the norm kernel has its own check (check_norm); interpreted it is slow
    from ninfer_gemma4.testing import build_tiny_artifact

    from ninfer_core.artifact import Artifact
    from ninfer_core.engine.model_api import DECODE, LOGITS_ALL, ForwardBatch, LaneSegment, RunnerOptions

    ids = [int(x) for x in torch.randint(3, 512, (60,), generator=torch.Generator().manual_seed(3))]
    kernel = attention.use_triton
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for seed, kind in enumerate(("e2b", "26b-a4b")):
            runner = Gemma4Family().load(Artifact.open(build_tiny_artifact(f"{tmp}/{kind}.ninfer", kind=kind,
                                                                           seed=seed + 1, window=20)))
            groups = runner.cache_spec().group_names

            def run(use, runner=runner, groups=groups):
                attention.use_triton = use
                runner.free_cache()
                # forwards of at most 16 new tokens: a ring of 3 pages that wraps, the 45-token prompt split
                runner.configure(RunnerOptions(max_segment_tokens=16))
                runner.allocate_cache(24, 3, page_size=16)
                tab = {i: {g: list(range(i * 8, i * 8 + 8)) for g in groups} for i in range(3)}
                prompts = [ids[:45], ids[5:12], ids[20:27]]
                outs = [o.logits for o in runner.forward(ForwardBatch(
                    [LaneSegment(i, tab[i], 0, p, logits=LOGITS_ALL) for i, p in enumerate(prompts)]))]
                lens = [len(p) for p in prompts]
                for s in range(0, 14, 7):  # lanes 1 and 2 continue in chunks of 7 past the window
                    outs += [o.logits for o in runner.forward(ForwardBatch(
                        [LaneSegment(i, tab[i], lens[i] + s, ids[30 + s: 37 + s], logits=LOGITS_ALL) for i in (1, 2)]))]
                lens = [lens[0], lens[1] + 14, lens[2] + 14]
                for step in range(3):
                    outs += [o.logits for o in runner.forward(ForwardBatch(
                        [LaneSegment(i, tab[i], lens[i] + step, [ids[50 + step]], DECODE) for i in range(3)]))]
                return outs

            try:
                want = run(lambda t: False)
                got = run(kernel)
            finally:
                attention.use_triton = kernel
            for a, b in zip(got, want):
                err = float((a - b).abs().max() / b.abs().max())
                worst = max(worst, err)
                assert err <= 1e-4, f"{kind}: runner with the kernel differs by {err:.2e}"
    print(f"gemma4 runner with interpreted kernels: worst max relative logits error {worst:.2e}")


def graph_body_interpret():
    """The CUDA-Graph decode body (device buffers for tokens, positions, write rows, tables, tiles)
    run eagerly under the interpreter equals the eager decode, for 1 and 3 lanes past the window,
    the ring wrapping (both test shapes, MoE included)."""
    import tempfile

    from ninfer_gemma4 import layers
    from ninfer_gemma4.family import Gemma4Family
    from ninfer_gemma4.gpu.graphs import DecodeGraphs

    layers._use_kernels = lambda x: False  # as in runner_interpret
    from ninfer_gemma4.testing import build_tiny_artifact

    from ninfer_core.artifact import Artifact
    from ninfer_core.engine.model_api import DECODE, ForwardBatch, LaneSegment, RunnerOptions

    ids = [int(x) for x in torch.randint(3, 512, (60,), generator=torch.Generator().manual_seed(5))]
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for seed, kind in enumerate(("e2b", "26b-a4b")):
            runner = Gemma4Family().load(Artifact.open(build_tiny_artifact(f"{tmp}/{kind}.ninfer", kind=kind,
                                                                           seed=seed + 1, window=20)))
            runner.configure(RunnerOptions(max_segment_tokens=16, cuda_graph=False))
            runner.allocate_cache(24, 3, page_size=16)
            groups = runner.cache_spec().group_names
            tab = {i: {g: list(range(i * 8, i * 8 + 8)) for g in groups} for i in range(3)}
            lens = [41, 23, 30]
            runner.forward(ForwardBatch([LaneSegment(i, tab[i], 0, ids[i: i + n]) for i, n in enumerate(lens)]))
            graphs = DecodeGraphs(runner)
            for width in (1, 3):
                for step in range(2):
                    segs = [LaneSegment(i, tab[i], lens[i] + step, [ids[40 + i + step]], DECODE) for i in range(width)]
                    logits, _ = graphs.eager(segs)
                    got = logits[:width].clone()
                    want = torch.stack([o.logits for o in runner.forward(ForwardBatch(segs))])
                    err = float((got - want).abs().max() / want.abs().max())
                    worst = max(worst, err)
                    assert err <= 1e-4, f"{kind}: graph body differs by {err:.2e} at width {width}"
                lens = [n + 2 if i < width else n for i, n in enumerate(lens)]
    print(f"gemma4 graph decode body under the interpreter: worst max relative logits error {worst:.2e}")


def check_step_kernels(dtype=torch.float32, device="cpu", tol=1e-5):
    """The fused forward's kernels (gpu/step_kernels.py) against their torch forms: q|k|v norm+RoPE
    with the cache scatter (K=V and not), the residual with up to three norms (the router's input
    among them), the MoE tail (pair rows, permuted rows, summed rows), GeGLU, the router's top-k,
    the expert gate|up GEMV with GeGLU, the embedding with the first norm, RoPE tables, soft-cap."""
    from ninfer_gemma4.gpu import step_kernels as K
    from ninfer_gemma4.layers import rope_tables

    gen = torch.Generator().manual_seed(11)
    worst = 0.0

    def r(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=gen)).to(device, dtype)

    def rel(a, b, what):
        nonlocal worst
        a, b = a.float().cpu(), b.float().cpu()
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        worst = max(worst, err)
        assert err <= tol, f"{what}: max relative error {err:.2e}"

    for keqv, hq, hk, d in ((False, 4, 2, 32), (True, 2, 1, 64), (False, 3, 0, 48)):
        t = 5
        width = (hq + hk * (1 if keqv else 2)) * d
        qkv = r(t, width + 8, s=2)[:, :width]  # a strided view of a wider output
        qw, kw = 1 + r(d, s=0.2), 1 + r(d, s=0.2)
        freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        freq[d // 4:] = 0
        cos, sin = rope_tables(freq.to(device), torch.arange(3, 3 + t, device=device), dtype)
        want_q, want_k, want_v = K.ref_qkv_norm_rope(qkv, hq, hk, d, qw, kw, 1e-6, cos, sin, keqv)
        kc = torch.full((4, 8, max(hk, 1), d), float("nan"), dtype=dtype, device=device)
        vc = kc.clone()
        page = torch.tensor([3, 0, 2, 1, 3], device=device)
        row = torch.tensor([7, 0, 5, 2, 1], device=device)
        q = K.qkv_norm_rope(qkv, hq, hk, d, qw, kw, 1e-6, cos, sin, keqv, kc if hk else None, vc if hk else None,
                            page, row)
        rel(q, want_q, f"qkv_norm_rope q keqv={keqv}")
        if hk:
            wk, wv = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
            wk[page, row], wv[page, row] = want_k, want_v
            assert torch.equal(torch.isnan(kc), torch.isnan(wk)) and torch.equal(torch.isnan(vc), torch.isnan(wv))
            rel(kc[~torch.isnan(wk)], wk[~torch.isnan(wk)], "qkv_norm_rope k")
            rel(vc[~torch.isnan(wv)], wv[~torch.isnan(wv)], "qkv_norm_rope v")

    d = 96
    base, y = r(3, d), r(3, d, s=3)
    ws = [1 + r(d, s=0.2) for _ in range(4)]
    sc = torch.tensor([0.7], dtype=dtype, device=device)
    for scalar, norms, lm in ((None, (), None), (sc, (ws[1],), None), (None, (ws[1], ws[2], ws[3]), (ws[0], 0.3))):
        got = K.add_norms(base, y, ws[0], 1e-6, scalar, norms, lm)
        want = K.ref_add_norms(base, y, ws[0], 1e-6, scalar, norms, None if lm is None else lm[0] * lm[1])
        assert len(got) == len(want)
        for g_, w_ in zip(got, want):
            rel(g_, w_, f"add_norms {len(norms)} norms")

    t, k = 4, 3
    rows, mlp, x1 = r(t * k, d, s=2), r(t, d, s=2), r(t, d)
    pw = torch.softmax(torch.randn(t, k, generator=gen), -1).to(device)
    perm = torch.randperm(t * k, generator=gen).to(device)
    for weights, pm, rr in ((pw, None, rows), (pw, perm, rows), (None, None, rows[:t])):
        for scalar, wn in ((None, None), (sc, ws[3])):
            got = K.moe_tail(rr, weights, mlp, x1, ws[0], ws[1], ws[2], 1e-6, scalar, wn, pm)
            want = K.ref_moe_tail(rr, weights, mlp, x1, ws[0], ws[1], ws[2], 1e-6, scalar, wn, pm)
            for g_, w_ in zip(got, want):
                rel(g_, w_, f"moe_tail perm={pm is not None} weights={weights is not None}")

    gu = r(3, 2 * 40, s=2)
    rel(K.gelu_mul(gu), K.ref_gelu_mul(gu), "gelu_mul")

    logits = r(5, 24, s=3)
    pes = 1 + r(24, s=0.3)
    gw, gi = K.route(logits, 4, pes)
    ww, wi = K.ref_route(logits, 4, pes)
    assert torch.equal(gi.cpu(), wi.cpu()), "route: another top-k"
    rel(gw, ww, "route weights")

    e, hid, inter = 8, 48, 40
    x = r(5, hid)
    gate_up = r(e, 2 * inter, hid, s=hid ** -0.5)
    idx = torch.stack([torch.randperm(e, generator=gen)[:2] for _ in range(5)]).to(device)
    idx[1] = idx[0]  # two tokens sharing both experts: read once, stored for both
    rel(K.expert_gate_up_gelu(x, idx, gate_up), K.ref_expert_gate_up_gelu(x, idx, gate_up), "expert gate_up gelu")

    table, wn = r(50, d), 1 + r(d, s=0.2)
    ids = torch.tensor([3, 49, 0, 3], device=device)
    scale = torch.tensor(d ** 0.5, dtype=dtype, device=device)
    for g_, w_ in zip(K.embed_norm(ids, table, scale, wn, 1e-6), K.ref_embed_norm(ids, table, scale, wn, 1e-6)):
        rel(g_, w_, "embed_norm")

    freq = (1.0 / (10000 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))).to(device)
    pos = torch.tensor([0, 5, 1023, 70000], device=device)
    for g_, w_ in zip(K.rope_cos_sin(freq, pos, dtype), K.ref_rope_cos_sin(freq, pos, dtype)):
        rel(g_, w_, "rope tables")

    lg = (30 * torch.randn(3, 77, generator=gen)).to(device)
    rel(K.softcap(lg.clone(), 30.0), K.ref_softcap(lg, 30.0), "softcap")
    print(f"gemma4 fused-step kernels: worst max relative error {worst:.2e} ({dtype})")


def step_runner_interpret():
    """The runner with the fused forward (gpu/step.py: fused q|k|v and gate|up weights, every step
    kernel, core's decode GEMV for <= 8 rows, the grouped expert GEMVs for <= 16) against the same
    runner's torch path, both test shapes: a batch of 3 prefills (one past the window; experts by
    the loop), chunks of 7 for two lanes (14 rows: the grouped expert GEMVs, F.linear), decode
    steps of 3 lanes (the GEMV). Paged attention on its torch path (its kernel has its own checks)."""
    import tempfile

    from ninfer_gemma4 import attention, layers
    from ninfer_gemma4.family import Gemma4Family
    from ninfer_gemma4.gpu import step
    from ninfer_gemma4.gpu import step_kernels as K
    from ninfer_gemma4.testing import build_tiny_artifact

    from ninfer_core.artifact import Artifact
    from ninfer_core.engine.model_api import DECODE, LOGITS_ALL, ForwardBatch, LaneSegment, RunnerOptions

    attention.use_triton = lambda t: False
    kernels = layers._use_kernels
    ids = [int(x) for x in torch.randint(3, 512, (50,), generator=torch.Generator().manual_seed(6))]
    calls = {"forward": 0, "experts": 0}

    def counted(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapper

    step.forward = counted("forward", step.forward)
    K.expert_gate_up_gelu = counted("experts", K.expert_gate_up_gelu)
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for seed, kind in enumerate(("e2b", "26b-a4b")):
            runner = Gemma4Family().load(Artifact.open(build_tiny_artifact(f"{tmp}/{kind}.ninfer", kind=kind,
                                                                           seed=seed + 5, window=20)))
            state = {n: p.clone() for n, p in runner.model.state_dict().items()}
            assert step.prepare(runner.model), "the fused forward declined the test model"
            for n, p in runner.model.state_dict().items():  # the views hold the same weights
                assert torch.equal(p, state[n]), n
            groups = runner.cache_spec().group_names

            def run(use, runner=runner, groups=groups):
                layers._use_kernels = use
                runner.free_cache()
                runner.configure(RunnerOptions(max_segment_tokens=32))
                runner.allocate_cache(12, 3, page_size=16)
                tab = {i: {g: list(range(i * 4, i * 4 + 4)) for g in groups} for i in range(3)}
                prompts = [ids[:27], ids[3:9], ids[12:17]]
                lens = [len(p) for p in prompts]
                outs = [o.logits for o in runner.forward(ForwardBatch(
                    [LaneSegment(i, tab[i], 0, p, logits=LOGITS_ALL) for i, p in enumerate(prompts)]))]
                outs += [o.logits for o in runner.forward(ForwardBatch(
                    [LaneSegment(i, tab[i], lens[i], ids[30 + i: 37 + i], logits=LOGITS_ALL) for i in (1, 2)]))]
                lens = [lens[0], lens[1] + 7, lens[2] + 7]
                for s in range(2):
                    outs += [o.logits for o in runner.forward(ForwardBatch(
                        [LaneSegment(i, tab[i], lens[i] + s, [ids[40 + s]], DECODE) for i in range(3)]))]
                return outs

            try:
                want = run(lambda t: False)
                got = run(lambda t: True)
            finally:
                layers._use_kernels = kernels
            for a, b in zip(got, want):
                err = float((a - b).abs().max() / b.abs().max())
                worst = max(worst, err)
                assert err <= 1e-4, f"{kind}: runner with the fused forward differs by {err:.2e}"
    # 4 forwards per shape took the fused path; the MoE layers' grouped GEMVs ran for the 14-row
    # chunk and the two decode steps
    assert calls["forward"] == 8 and calls["experts"] > 0, calls
    print(f"gemma4 runner with the fused forward: worst max relative logits error {worst:.2e} ({calls})")


def launch_counts():
    """Launches of one decode step (the CUDA-Graph body) counted under the interpreter at the real
    layer pattern cut to one period: the fused forward at most 14 per MoE layer and 10 per dense
    layer (+6 for the embedding, RoPE tables and head; the split decode attention is two of them:
    parts, then their combine), at most 0.4 / 0.55 of the module-by-module path (MoE / dense;
    measured 89 vs 236 launches for the MoE)."""
    from ninfer_gemma4.gpu.launches import render, step_counts

    for kind, per_layer, share in (("26b-a4b", 14, 0.4), ("31b", 10, 0.55)):
        res = step_counts(kind, 6, "cpu")
        print(render(res))
        assert res["fused"] <= per_layer * res["layers"] + 6, res["fused_top"]
        assert res["fused"] <= share * res["modules"], (res["fused"], res["modules"])
    print("gemma4 decode step launch counts: ok")
