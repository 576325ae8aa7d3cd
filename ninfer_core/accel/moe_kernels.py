"""MoE expert kernels of the GPU path (`ninfer_core.nn.moe`), each with the torch reference it is tested
against.

Decode (a few tokens): the router's logits by one matmul, then four Triton launches, no host
synchronisation (CUDA-Graph safe), each chosen expert's rows read straight from the fused expert
tensors by the expert id the router left on the device (`moe_decode`):

- `_route_topk_kernel` (`route_topk`): per token, the fp32 softmax over the experts, the top k
  (largest first, lowest id on a tie) and their normalisation, in place of ~5 torch launches.
- `_moe_gate_up_act_kernel`: one program per (token row, k-slot, block of intermediate columns);
  the k-slot past the routed ones is the shared expert. It computes the gate and the up rows of
  the block (fp32 accumulation, each rounded to the dtype like a bf16 matmul output) and writes
  silu(gate) * up with the rounding of `kernels.silu_mul` (silu rounded, then the product).
- `_moe_down_kernel`: one program per (token row, k-slot, block of hidden rows): the down GEMV
  (fp32, rounded to the dtype as a bf16 matmul output), each program one weight tile, so many
  loads are in flight at batch 1.
- `_moe_combine_kernel`: per token, the routed rows times their routing weights summed in fp32
  and rounded, plus the shared expert's row times sigmoid(shared gate . x) (bf16 roundings of the
  module: routed + sigmoid(gate) * shared).

Prefill (longer chunks, `grouped_experts`): the token-expert pairs are sorted by expert on the
device, the per-expert row ends computed on the device (searchsorted, no bincount/`.tolist()`), and
gate/up and down run as two grouped GEMMs (`torch._grouped_mm`, bf16 on sm90) over the sorted rows;
`_combine_rows_kernel` then sums each token's k result rows (found through the inverse
permutation) times their routing weights in fp32. Where `_grouped_mm` is missing or refuses the
input, `grouped_experts` returns None and the caller runs the expert loop
(`moe.Experts.forward_loop`, the reference).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ninfer_core.accel import moe_gemv as MG
from ninfer_core.accel.kernels import HAVE_TRITON, silu_mul, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------
# torch references
# ------------------------------------------------------------------------------------------------
def ref_moe_decode(x, top_w, top_i, gate_up, down, shared=None):
    """x [N, H]; top_w [N, k] (x's dtype), top_i [N, k] expert ids; gate_up [E, 2I, H] rows
    [gate | up]; down [E, H, I]. shared: None or (w_gate [Is, H], w_up [Is, H], w_down [H, Is],
    w_shared_gate [1, H]). Returns the MoE block output [N, H] (routed + gated shared expert) with
    the roundings of gathered-expert bmm GEMVs."""
    n, hidden = x.shape
    k = top_i.shape[1]
    idx = top_i.reshape(-1)
    xr = x.repeat_interleave(k, dim=0)  # [N*k, H]
    gu = torch.bmm(gate_up.index_select(0, idx), xr[:, :, None])[..., 0]  # [N*k, 2I]
    gate, up = gu.chunk(2, dim=-1)
    act = F.silu(gate) * up
    y = torch.bmm(down.index_select(0, idx), act[:, :, None])[..., 0]  # [N*k, H]
    out = (y.float() * top_w.reshape(-1, 1).float()).view(n, k, hidden).sum(1).to(x.dtype)
    if shared is not None:
        wg, wu, wd, wsg = shared
        s = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
        out = out + torch.sigmoid(F.linear(x, wsg)) * s
    return out


def ref_route_topk(logits, k: int, normalize: bool):
    """The Router's math on its logits [N, E]: fp32 softmax, top-k, optionally normalised; returns
    (weights [N, k] in the logits' dtype, expert ids [N, k] int64)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_w, top_i = torch.topk(probs, k, dim=-1)
    if normalize:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w.to(logits.dtype), top_i


def sort_pairs(top_i: torch.Tensor, num_experts: int):
    """Token-expert pairs sorted by expert, on the device: (order [N*k] pair index of each sorted
    row, offs [E] int32 cumulative row ends per expert: the grouped GEMM's offsets)."""
    flat = top_i.reshape(-1)
    ids, order = torch.sort(flat, stable=True)
    experts = torch.arange(num_experts, device=flat.device, dtype=ids.dtype)
    offs = torch.searchsorted(ids, experts, right=True, out_int32=True)
    return order, offs


def loop_grouped_mm(a, b, offs):
    """A loop stand-in for torch._grouped_mm's 2-D x 3-D form: rows offs[g-1]..offs[g] of a times
    b[g] ([K, N]); the CPU tests run the grouped bookkeeping with it."""
    out = torch.empty(a.shape[0], b.shape[-1], dtype=a.dtype, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ b[g]
        start = end
    return out


def grouped_experts_with(gmm, x, top_w, top_i, gate_up, down):
    """The routed experts for a chunk through a grouped GEMM `gmm(a [M, K], b [E, K, N], offs)`.
    x [N, H]; returns [N, H] in x's dtype."""
    n, k = top_i.shape
    order, offs = sort_pairs(top_i, gate_up.shape[0])
    xs = x.index_select(0, order // k)  # [N*k, H] rows grouped by expert
    gu = gmm(xs, gate_up.transpose(1, 2), offs)  # [N*k, 2I]
    act = silu_mul(gu) if gu.stride(-1) == 1 else silu_mul(gu.contiguous())
    y = gmm(act, down.transpose(1, 2), offs)  # [N*k, H]
    pos = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
    return combine_rows(y, pos.view(n, k), top_w)


def ref_combine_rows(y, pos, top_w):
    """out[t] = sum_j y[pos[t, j]] * top_w[t, j] in fp32, rounded to y's dtype. y [M, H] (rows of
    the token-expert pairs in any order), pos [N, k] the row of each pair, top_w [N, k]."""
    return (y[pos.reshape(-1)].view(*pos.shape, -1).float() * top_w[..., None].float()).sum(1).to(y.dtype)


def combine_rows(y, pos, top_w):
    """ref_combine_rows in one Triton launch (reads each row of y once, no fp32 temporaries)."""
    if not use_triton(y) or y.stride(1) != 1:
        return ref_combine_rows(y, pos, top_w)
    n, k = pos.shape
    hidden = y.shape[1]
    pos, top_w = pos.contiguous(), top_w.contiguous()
    out = torch.empty(n, hidden, dtype=y.dtype, device=y.device)
    bh = min(1024, triton.next_power_of_2(hidden))
    _combine_rows_kernel[(n, triton.cdiv(hidden, bh))](y, pos, top_w, out, hidden, y.stride(0), out.stride(0),
                                                       KTOP=k, BH=bh, num_warps=4)
    return out


_GMM_REFUSED: set = set()  # ((device type, dtype), error) where torch._grouped_mm failed once


def grouped_experts(x, top_w, top_i, gate_up, down, gmm=None):
    """Sync-free grouped-GEMM experts on CUDA (bf16), or None where torch._grouped_mm is missing or
    refuses this input (the caller then runs the expert loop); after one refusal for a device type
    and dtype, later calls return None at once. `gmm` replaces torch._grouped_mm (tests)."""
    if gmm is None:
        gmm = getattr(torch, "_grouped_mm", None)
        if gmm is None or not x.is_cuda or x.dtype != torch.bfloat16:
            return None
    key = (x.device.type, x.dtype)
    if any(r[0] == key for r in _GMM_REFUSED):
        return None
    try:
        return grouped_experts_with(gmm, x, top_w, top_i, gate_up, down)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, NotImplementedError, TypeError) as e:
        msg = str(e).splitlines()[0][:200] if str(e) else ""
        _GMM_REFUSED.add((key, f"{type(e).__name__}: {msg}"))
        log.warning("torch._grouped_mm refused the MoE experts (%s: %s); using the expert loop",
                    type(e).__name__, msg)
        return None


# ------------------------------------------------------------------------------------------------
# Triton kernels (decode)
# ------------------------------------------------------------------------------------------------
if HAVE_TRITON:

    @triton.jit
    def _combine_rows_kernel(Y, POS, TOPW, O, H, s_y, s_o, KTOP: tl.constexpr, BH: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BH + tl.arange(0, BH)
        mask = offs < H
        acc = tl.zeros([BH], tl.float32)
        for j in tl.static_range(KTOP):
            r = tl.load(POS + tok * KTOP + j).to(tl.int64)
            w = tl.load(TOPW + tok * KTOP + j).to(tl.float32)
            acc += tl.load(Y + r * s_y + offs, mask=mask, other=0.0).to(tl.float32) * w
        tl.store(O + tok * s_o + offs, acc.to(O.dtype.element_ty), mask=mask)

    @triton.jit
    def _route_topk_kernel(L, TW, TI, E, s_l, K: tl.constexpr, NORM: tl.constexpr, BE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BE)
        mask = offs < E
        lg = tl.load(L + row * s_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
        ex = tl.exp(lg - tl.max(lg, 0))
        ex = tl.where(mask, ex, 0.0)
        probs = tl.where(mask, ex / tl.sum(ex, 0), -1.0)  # -1: never chosen
        total = 1.0
        if NORM:  # first pass: the sum of the k largest
            p = probs
            total = 0.0
            for j in tl.static_range(K):
                best = tl.max(p, 0)
                idx = tl.min(tl.where(p == best, offs, BE), 0)
                total += best
                p = tl.where(offs == idx, -1.0, p)
        p = probs
        for j in tl.static_range(K):  # largest first, the lowest id on a tie
            best = tl.max(p, 0)
            idx = tl.min(tl.where(p == best, offs, BE), 0)
            tl.store(TW + row * K + j, (best / total).to(TW.dtype.element_ty))
            tl.store(TI + row * K + j, idx.to(tl.int64))
            p = tl.where(offs == idx, -1.0, p)

    @triton.jit
    def _moe_gate_up_act_kernel(
        X, TOPI, WGU, SG, SU, ACT, H, I,
        s_x, s_we, s_wn, s_sg, s_su, s_a,
        KTOP: tl.constexpr, SLOTS: tl.constexpr, HAS_SHARED: tl.constexpr,
        BN: tl.constexpr, BK: tl.constexpr,
    ):
        p = tl.program_id(0).to(tl.int64)  # token * SLOTS + slot
        tok = p // SLOTS
        j = p % SLOTS
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        nmask = offs_n < I
        if j < KTOP:
            e = tl.load(TOPI + tok * KTOP + j).to(tl.int64)
            g_ptr = WGU + e * s_we + offs_n[:, None] * s_wn
            u_ptr = WGU + e * s_we + (offs_n[:, None] + I) * s_wn
        else:
            g_ptr = SG + offs_n[:, None] * s_sg
            u_ptr = SU + offs_n[:, None] * s_su
        acc_g = tl.zeros([BN], tl.float32)
        acc_u = tl.zeros([BN], tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + offs_k
            kmask = kk < H
            xv = tl.load(X + tok * s_x + kk, mask=kmask, other=0.0).to(tl.float32)
            m2 = nmask[:, None] & kmask[None, :]
            wg = tl.load(g_ptr + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            wu = tl.load(u_ptr + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            acc_g += tl.sum(wg * xv[None, :], 1)
            acc_u += tl.sum(wu * xv[None, :], 1)
        dt = ACT.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        s = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
        tl.store(ACT + p * s_a + offs_n, (s * u).to(dt), mask=nmask)

    @triton.jit
    def _moe_down_kernel(
        ACT, TOPI, WD, SD, Y, H, I,
        s_a, s_we, s_wh, s_sd, s_y,
        KTOP: tl.constexpr, SLOTS: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
    ):
        p = tl.program_id(0).to(tl.int64)  # token * SLOTS + slot
        tok = p // SLOTS
        j = p % SLOTS
        offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
        offs_k = tl.arange(0, BK)
        hmask = offs_h < H
        if j < KTOP:
            e = tl.load(TOPI + tok * KTOP + j).to(tl.int64)
            w_ptr = WD + e * s_we + offs_h[:, None] * s_wh
        else:
            w_ptr = SD + offs_h[:, None] * s_sd
        acc = tl.zeros([BH], tl.float32)
        for k0 in range(0, I, BK):
            kk = k0 + offs_k
            kmask = kk < I
            a = tl.load(ACT + p * s_a + kk, mask=kmask, other=0.0).to(tl.float32)
            wd = tl.load(w_ptr + kk[None, :], mask=hmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(wd * a[None, :], 1)
        tl.store(Y + p * s_y + offs_h, acc.to(Y.dtype.element_ty), mask=hmask)

    @triton.jit
    def _moe_combine_kernel(
        X, Y, TOPW, SGATE, O, H, s_x, s_y, s_o,
        KTOP: tl.constexpr, SLOTS: tl.constexpr, HAS_SHARED: tl.constexpr,
        BH: tl.constexpr, BX: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
        hmask = offs_h < H
        dt = O.dtype.element_ty
        out = tl.zeros([BH], tl.float32)
        for j in tl.static_range(KTOP):
            w = tl.load(TOPW + tok * KTOP + j).to(tl.float32)
            out += tl.load(Y + (tok * SLOTS + j) * s_y + offs_h, mask=hmask, other=0.0).to(tl.float32) * w
        res = out.to(dt).to(tl.float32)
        if HAS_SHARED:
            ys = tl.load(Y + (tok * SLOTS + KTOP) * s_y + offs_h, mask=hmask, other=0.0).to(tl.float32)
            offs_x = tl.arange(0, BX)
            gacc = tl.zeros([BX], tl.float32)
            for k0 in range(0, H, BX):
                kk = k0 + offs_x
                kmask = kk < H
                xv = tl.load(X + tok * s_x + kk, mask=kmask, other=0.0).to(tl.float32)
                gw = tl.load(SGATE + kk, mask=kmask, other=0.0).to(tl.float32)
                gacc += xv * gw
            glog = tl.sum(gacc, 0).to(dt).to(tl.float32)
            sig = tl.sigmoid(glog).to(dt).to(tl.float32)
            res = res + (sig * ys).to(dt).to(tl.float32)
        tl.store(O + tok * s_o + offs_h, res.to(dt), mask=hmask)


def route_topk(logits, k: int, normalize: bool):
    """ref_route_topk in one Triton launch (one program per token row)."""
    if not use_triton(logits) or logits.dim() != 2 or logits.stride(1) != 1:
        return ref_route_topk(logits, k, normalize)
    n, e = logits.shape
    assert k <= e
    top_w = torch.empty(n, k, dtype=logits.dtype, device=logits.device)
    top_i = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    _route_topk_kernel[(n,)](logits, top_w, top_i, e, logits.stride(0), K=k, NORM=bool(normalize),
                             BE=triton.next_power_of_2(e), num_warps=4 if e >= 512 else 2)
    return top_w, top_i


# decode tile sizes (not tuned on a device yet): at batch 1 of the 35B-A3B shape (I = 512,
# H = 2048, 8 + 1 experts) gate/up runs 9 x 64 programs of 8 x 512-column tiles (two weight
# tiles in flight per program), down 9 x 128 programs of one 16 x 512 tile each
GATE_UP_BN, GATE_UP_BK = 8, 512
DOWN_BH, DOWN_BK = 16, 512
COMBINE_BH = 1024


def moe_decode(x, top_w, top_i, gate_up, down, shared=None, grouped: bool = False):
    """The MoE block for a few tokens (see ref_moe_decode for the arguments): three Triton
    launches when triton runs on x's device, otherwise the reference. `grouped`: gate/up and down
    through ninfer_core.accel.moe_gemv (each expert the round chose read once for all its tokens)
    for rounds of up to its MAX_TOKENS tokens, the same combine after."""
    if not use_triton(x) or x.dim() != 2:
        return ref_moe_decode(x, top_w, top_i, gate_up, down, shared)
    n, hidden = x.shape
    k = top_i.shape[1]
    inter = down.shape[2]
    assert gate_up.shape[1] == 2 * inter and gate_up.shape[2] == hidden
    assert x.stride(1) == 1 and gate_up.stride(2) == 1 and down.stride(2) == 1
    top_i = top_i.contiguous()
    top_w = top_w.contiguous()
    if shared is not None and shared[0].shape != (inter, hidden):
        # a shared expert of another width than the routed ones: it runs in torch, the same math
        routed = moe_decode(x, top_w, top_i, gate_up, down, None, grouped)
        wg, wu, wd, wsg = shared
        s = F.linear(silu_mul(torch.cat([F.linear(x, wg), F.linear(x, wu)], dim=-1)), wd)
        return routed + torch.sigmoid(F.linear(x, wsg)) * s
    has_shared = shared is not None
    if has_shared:
        wg, wu, wd, wsg = shared
        assert wu.shape == (inter, hidden) and wd.shape == (hidden, inter) and wsg.numel() == hidden
        assert wg.stride(1) == 1 and wu.stride(1) == 1 and wd.stride(1) == 1 and wsg.is_contiguous()
    else:
        wg = wu = wd = gate_up  # unused pointers (of the weights' type, as the branches need)
        wsg = x
    slots = k + (1 if has_shared else 0)
    if grouped and n <= MG.MAX_TOKENS:
        act = MG.grouped_gate_up_act(x, top_i, gate_up, (wg, wu) if has_shared else None)
        y = MG.grouped_down(act, top_i, down, wd if has_shared else None)
        return _combine(x, y, top_w, wsg, n, hidden, k, slots, has_shared)
    act = torch.empty(n * slots, inter, dtype=x.dtype, device=x.device)
    _moe_gate_up_act_kernel[(n * slots, triton.cdiv(inter, GATE_UP_BN))](
        x, top_i, gate_up, wg, wu, act, hidden, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), wg.stride(0), wu.stride(0), act.stride(0),
        KTOP=k, SLOTS=slots, HAS_SHARED=has_shared, BN=GATE_UP_BN,
        BK=min(GATE_UP_BK, triton.next_power_of_2(hidden)), num_warps=4,
    )
    y = torch.empty(n * slots, hidden, dtype=x.dtype, device=x.device)
    _moe_down_kernel[(n * slots, triton.cdiv(hidden, DOWN_BH))](
        act, top_i, down, wd, y, hidden, inter,
        act.stride(0), down.stride(0), down.stride(1), wd.stride(0), y.stride(0),
        KTOP=k, SLOTS=slots, BH=DOWN_BH, BK=min(DOWN_BK, triton.next_power_of_2(inter)), num_warps=4,
    )
    return _combine(x, y, top_w, wsg, n, hidden, k, slots, has_shared)


def _combine(x, y, top_w, wsg, n, hidden, k, slots, has_shared):
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    bh = min(COMBINE_BH, triton.next_power_of_2(hidden))
    _moe_combine_kernel[(n, triton.cdiv(hidden, bh))](
        x, y, top_w, wsg, out, hidden, x.stride(0), y.stride(0), out.stride(0),
        KTOP=k, SLOTS=slots, HAS_SHARED=has_shared, BH=bh, BX=min(1024, triton.next_power_of_2(hidden)),
        num_warps=4,
    )
    return out
