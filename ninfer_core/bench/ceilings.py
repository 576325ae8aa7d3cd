"""The device's ceilings for `ninfer bench`, measured in the same run as the figures they bound.

- copy bandwidth: bytes read + written per second by a large device-to-device copy;
- read bandwidth: bytes read per second by a stream that only loads (each program sums a run of
  the buffer into one fp32 partial, so the bytes written are negligible). A decode step reads its
  weights and writes almost nothing, so this is its true floor; on an H200 the copy figure
  understates it by about a tenth (issue 21: 4.24 TB/s copy against 4.68 TB/s read);
- the bf16 matmul rate of a large square GEMM;
- per weight shape, the rate torch's linear reads that matrix at for a few decode batch widths
  (`linear_rates`), against the read stream: which projections of a decode step are slow.

The read stream is a Triton kernel on CUDA (torch's sum reduces through a tree of launches whose
partials it writes back, which is not a pure read); on the CPU it is a torch sum, only so the
bench's logic runs there. `read_sum` is checked against torch under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import statistics
import time

from ninfer_core.accel import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _read_sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * BLOCK * ITERS
        acc = tl.zeros([BLOCK], tl.float32)
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))


READ_BLOCK, READ_ITERS = 4096, 16


def sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(torch, device, fn, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` calls, the device synchronised around each."""
    out = []
    for _ in range(max(1, repeats)):
        sync(torch, device)
        t0 = time.perf_counter()
        fn()
        sync(torch, device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def read_sum(torch, x, out=None, block: int = READ_BLOCK, iters: int = READ_ITERS):
    """Per-program fp32 partial sums of the flat tensor `x` (their sum is x's sum): one pass that
    reads every byte of x once. Triton where it runs (CUDA, or the interpreter), torch otherwise."""
    from ninfer_core.accel import use_triton

    flat = x.reshape(-1)
    programs = -(-flat.numel() // (block * iters))
    if out is None:
        out = torch.empty(programs, dtype=torch.float32, device=x.device)
    if not use_triton(x):
        pad = programs * block * iters - flat.numel()
        full = torch.nn.functional.pad(flat.float(), (0, pad)) if pad else flat.float()
        out.copy_(full.view(programs, -1).sum(1))
        return out
    _read_sum_kernel[(programs,)](flat, out, flat.numel(), BLOCK=block, ITERS=iters, num_warps=8)
    return out


def _copy_rate(torch, device, n_bytes: int) -> float:
    a = torch.randn(n_bytes // 2, device=device, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    b.copy_(a)
    return 2 * n_bytes / (timed(torch, device, lambda: [b.copy_(a) for _ in range(10)], 5) / 10)


def _read_rate(torch, device, n_bytes: int) -> float:
    a = torch.randn(n_bytes // 2, device=device, dtype=torch.bfloat16)
    partials = read_sum(torch, a)
    return n_bytes / (timed(torch, device, lambda: [read_sum(torch, a, partials) for _ in range(10)], 5) / 10)


def _matmul_rate(torch, device, n: int, dt) -> float:
    xs = [torch.randn(n, n, device=device, dtype=dt) for _ in range(3)]
    out = torch.empty(n, n, device=device, dtype=dt)
    torch.matmul(xs[0], xs[1], out=out)
    t = timed(torch, device, lambda: [torch.matmul(xs[i % 3], xs[(i + 1) % 3], out=out) for i in range(10)], 5) / 10
    return 2 * n**3 / t


def measure_ceilings(torch, device) -> dict:
    """Copy and read bandwidth (bytes per second, as GB/s) and the bf16 matmul rate of `device`."""
    cuda = device.type == "cuda"
    n_bytes = (2 << 30) if cuda else (64 << 20)
    return {"copy_bandwidth_GBps": _copy_rate(torch, device, n_bytes) / 1e9,
            "read_bandwidth_GBps": _read_rate(torch, device, n_bytes) / 1e9,
            "matmul_TFLOPs": _matmul_rate(torch, device, 8192 if cuda else 512,
                                          torch.bfloat16 if cuda else torch.float32) / 1e12}


def linear_shapes(model) -> list[tuple[int, int, int]]:
    """Distinct (out, in) shapes of the 2-D weights a decode step multiplies by, with how many
    matrices of each shape the model has (the embedding table, which a step gathers rows of, and
    conv kernels are left out; a tied lm_head is counted once)."""
    counts: dict[tuple[int, int], int] = {}
    seen = set()
    emb = getattr(getattr(model, "embed_tokens", None), "weight", None)
    lm = getattr(getattr(model, "lm_head", None), "weight", None)
    for name, p in model.named_parameters():
        if p.dim() != 2 or "conv1d" in name or p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if emb is not None and p is emb and (lm is None or lm.data_ptr() != emb.data_ptr()):
            continue
        if name.startswith("embed_tokens_per_layer."):
            continue
        key = (int(p.shape[0]), int(p.shape[1]))
        counts[key] = counts.get(key, 0) + 1
    return [(n, k, c) for (n, k), c in sorted(counts.items(), key=lambda kv: -kv[0][0] * kv[0][1] * kv[1])]


def linear_rates(torch, model, device, dtype, batches=(1, 8), read_GBps: float | None = None,
                 repeats: int = 5, budget_bytes: int = 1 << 30) -> list[dict]:
    """For each weight shape of `model`, the bytes per second torch's linear reads a matrix of that
    shape at, for each batch width: a fresh matrix per call from a rotating set larger than the
    L2 cache (`budget_bytes` in all), so the figure is the DRAM stream, as in a decode step."""
    import torch.nn.functional as F

    rows = []
    for n, k, count in linear_shapes(model):
        one = n * k * torch.finfo(dtype).bits // 8
        copies = max(2, min(16, budget_bytes // max(1, one)))
        ws = [torch.randn(n, k, device=device, dtype=dtype) for _ in range(copies)]
        row = {"out": n, "in": k, "count": count, "bytes": one}
        for b in batches:
            x = torch.randn(b, k, device=device, dtype=dtype)
            F.linear(x, ws[0])
            t = timed(torch, device, lambda x=x, ws=ws: [F.linear(x, w) for w in ws], repeats) / copies
            row[f"b{b}_GBps"] = one / t / 1e9
            if read_GBps:
                row[f"b{b}_vs_read"] = one / t / 1e9 / read_GBps
        rows.append(row)
    return rows


def render_linear_rates(rows: list[dict], batches=(1, 8)) -> str:
    lines = ["decode GEMVs (torch linear, a fresh matrix per call): GB/s read, and share of the read stream"]
    for r in rows:
        cells = []
        for b in batches:
            v = r.get(f"b{b}_GBps")
            if v is not None:
                share = r.get(f"b{b}_vs_read")
                cells.append(f"b={b} {v:,.0f} GB/s" + (f" ({share:.2f})" if share is not None else ""))
        lines.append(f"  {r['in']:>6} -> {r['out']:<7} x{r['count']:<4} {r['bytes'] / 2**20:9.1f} MiB  " + "  ".join(cells))
    return "\n".join(lines)
