"""Grouped-expert GEMVs for MoE decode (issue 21): each expert a round selected is read once, for
every token that chose it, by the expert ids the router left on the device (no host sync, CUDA-Graph
safe).

A per-(token, slot) expert GEMV reads an expert's rows once per token that picked it; at batch 8
the tokens of a round share experts, so this reads only the distinct experts: one program column
per (token, slot) pair, and the program whose pair is the first occurrence of its expert in the
round (row-major over [tokens, k]) does the work for all tokens (x^T of up to 16 tokens as the
tensor-core operand, each token's result stored only where it chose the expert); later occurrences
exit. An optional extra column is a shared expert every token uses.

- `grouped_gate_up_act(x, top_i, gate_up, shared)`: act [N * slots, I] = silu(x W_g^T) * (x W_u^T)
  per pair (row t * slots + j), rounded as the bf16 ops round (gate and up, SiLU, the product);
- `grouped_down(act, top_i, down, shared_down)`: y [N * slots, H] = act_row W_d^T per pair.

The routing-weighted sum over a token's slots (and any gate on the shared expert) is the caller's
combine. Torch references: `ref_grouped_gate_up_act`, `ref_grouped_down`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer_core.accel import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

MAX_TOKENS = 16  # tokens of one round the kernels take (x^T is padded to 16 columns)
GATE_UP_BN, GATE_UP_BK = 32, 128
DOWN_BN, DOWN_BK = 32, 128


def ref_grouped_gate_up_act(x, top_i, gate_up, shared=None):
    """x [N, H]; top_i [N, k]; gate_up [E, 2I, H] rows [gate | up]; shared None or (w_gate [I, H],
    w_up [I, H]). Returns [N * slots, I], row t * slots + j (slot k: the shared expert)."""
    n, k = top_i.shape
    ws = gate_up.index_select(0, top_i.reshape(-1)).view(n, k, *gate_up.shape[1:])
    if shared is not None:
        shared_gu = torch.cat(shared, dim=0)
        ws = torch.cat([ws, shared_gu.expand(n, 1, *shared_gu.shape)], dim=1)
    gu = torch.einsum("tjoh,th->tjo", ws.float(), x.float()).to(x.dtype)
    gate, up = gu.chunk(2, dim=-1)
    return (F.silu(gate) * up).reshape(n * ws.shape[1], -1)


def ref_grouped_down(act, top_i, down, shared_down=None):
    """act [N * slots, I]; down [E, H, I]; shared_down None or [H, I]. Returns [N * slots, H]."""
    n, k = top_i.shape
    ws = down.index_select(0, top_i.reshape(-1)).view(n, k, *down.shape[1:])
    if shared_down is not None:
        ws = torch.cat([ws, shared_down.expand(n, 1, *shared_down.shape)], dim=1)
    slots = ws.shape[1]
    y = torch.einsum("tjhi,tji->tjh", ws.float(), act.view(n, slots, -1).float()).to(act.dtype)
    return y.reshape(n * slots, -1)


def supported(x, top_i, w) -> bool:
    return (use_triton(x) and x.dim() == 2 and 1 <= x.shape[0] <= MAX_TOKENS and x.stride(1) == 1
            and w.dim() == 3 and w.stride(2) == 1 and x.dtype == w.dtype and top_i.dim() == 2
            and top_i.shape[0] == x.shape[0])


if HAVE_TRITON:

    @triton.jit
    def _pair_owner(TOPI, p, offs_m, m_mask, KTOP: tl.constexpr, SLOTS: tl.constexpr, KP: tl.constexpr,
                    QP: tl.constexpr):
        """Pair p's expert e; whether an earlier pair has it (then p does nothing); per token whether
        it chose e and the output row of that (token, slot)."""
        e = tl.load(TOPI + p).to(tl.int64)
        offs_q = tl.arange(0, QP)
        prev = tl.load(TOPI + offs_q, mask=offs_q < p, other=-1).to(tl.int64)
        dup = tl.sum((prev == e).to(tl.int32), 0) > 0
        offs_j = tl.arange(0, KP)
        tk = tl.load(TOPI + offs_m[:, None] * KTOP + offs_j[None, :],
                     mask=m_mask[:, None] & (offs_j[None, :] < KTOP), other=-1).to(tl.int64)
        hit = tk == e
        match = tl.sum(hit.to(tl.int32), 1) > 0
        js = tl.min(tl.where(hit, offs_j[None, :], KP), 1)
        row = offs_m * SLOTS + tl.where(match, js, 0)
        return e, dup, match, row

    @triton.jit
    def _grouped_gate_up_kernel(X, TOPI, WGU, SG, SU, ACT, M, H, I, s_x, s_we, s_wn, s_sg, s_su, s_a,
                                KTOP: tl.constexpr, SLOTS: tl.constexpr, KP: tl.constexpr, QP: tl.constexpr,
                                BLOCK_M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
        p = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        if p < M * KTOP:
            e, dup, match, row = _pair_owner(TOPI, p, offs_m, m_mask, KTOP, SLOTS, KP, QP)
            base_g = WGU + e * s_we
            base_u = base_g + I * s_wn
            s_g = s_wn
            s_u = s_wn
        else:  # the shared expert: every token, slot KTOP
            dup = p < 0
            match = m_mask
            row = offs_m * SLOTS + KTOP
            base_g = SG
            base_u = SU
            s_g = s_sg
            s_u = s_su
        if dup == 0:
            offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
            n_mask = offs_n < I
            rows = tl.where(n_mask, offs_n, 0).to(tl.int64)
            offs_k = tl.arange(0, BK)
            g_ptr = base_g + rows[:, None] * s_g + offs_k[None, :]
            u_ptr = base_u + rows[:, None] * s_u + offs_k[None, :]
            x_ptr = X + offs_m[:, None] * s_x + offs_k[None, :]
            acc_g = tl.zeros([BN, BLOCK_M], tl.float32)
            acc_u = tl.zeros([BN, BLOCK_M], tl.float32)
            for k0 in range(0, H, BK):
                km = (k0 + offs_k) < H
                xt = tl.load(x_ptr + k0, mask=m_mask[:, None] & km[None, :], other=0.0)
                wg = tl.load(g_ptr + k0, mask=km[None, :], other=0.0)
                wu = tl.load(u_ptr + k0, mask=km[None, :], other=0.0)
                if IEEE:
                    xf = tl.trans(xt).to(tl.float32)
                    acc_g += tl.dot(wg.to(tl.float32), xf, input_precision="ieee")
                    acc_u += tl.dot(wu.to(tl.float32), xf, input_precision="ieee")
                else:
                    acc_g += tl.dot(wg, tl.trans(xt))
                    acc_u += tl.dot(wu, tl.trans(xt))
            dt = ACT.dtype.element_ty
            g = acc_g.to(dt).to(tl.float32)
            u = acc_u.to(dt).to(tl.float32)
            s = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
            out = (s * u).to(dt)
            tl.store(ACT + row[None, :].to(tl.int64) * s_a + offs_n[:, None], out,
                     mask=n_mask[:, None] & match[None, :])

    @triton.jit
    def _grouped_down_kernel(A, TOPI, WD, SD, Y, M, H, I, s_a, s_we, s_wh, s_sh, s_y,
                             KTOP: tl.constexpr, SLOTS: tl.constexpr, KP: tl.constexpr, QP: tl.constexpr,
                             BLOCK_M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
        p = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        if p < M * KTOP:
            e, dup, match, row = _pair_owner(TOPI, p, offs_m, m_mask, KTOP, SLOTS, KP, QP)
            base = WD + e * s_we
            s_h = s_wh
        else:
            dup = p < 0
            match = m_mask
            row = offs_m * SLOTS + KTOP
            base = SD
            s_h = s_sh
        if dup == 0:
            offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
            n_mask = offs_n < H
            rows = tl.where(n_mask, offs_n, 0).to(tl.int64)
            offs_k = tl.arange(0, BK)
            w_ptr = base + rows[:, None] * s_h + offs_k[None, :]
            a_ptr = A + row[:, None].to(tl.int64) * s_a + offs_k[None, :]
            acc = tl.zeros([BN, BLOCK_M], tl.float32)
            for k0 in range(0, I, BK):
                km = (k0 + offs_k) < I
                at = tl.load(a_ptr + k0, mask=match[:, None] & km[None, :], other=0.0)
                w = tl.load(w_ptr + k0, mask=km[None, :], other=0.0)
                if IEEE:
                    acc += tl.dot(w.to(tl.float32), tl.trans(at).to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(w, tl.trans(at))
            tl.store(Y + row[None, :].to(tl.int64) * s_y + offs_n[:, None], acc.to(Y.dtype.element_ty),
                     mask=n_mask[:, None] & match[None, :])


def _consts(n: int, k: int):
    return {"KTOP": k, "KP": max(2, triton.next_power_of_2(k)), "QP": max(2, triton.next_power_of_2(n * k)),
            "BLOCK_M": 16}


def grouped_gate_up_act(x, top_i, gate_up, shared=None):
    """See ref_grouped_gate_up_act; one launch where the kernel runs, else the reference."""
    inter = gate_up.shape[1] // 2
    if not supported(x, top_i, gate_up) or (shared is not None and any(
            w.shape != (inter, gate_up.shape[2]) or w.stride(1) != 1 or w.dtype != x.dtype for w in shared)):
        return ref_grouped_gate_up_act(x, top_i, gate_up, shared)
    n, hidden = x.shape
    k = top_i.shape[1]
    slots = k + (shared is not None)
    top_i = top_i.contiguous()
    sg, su = shared if shared is not None else (gate_up[0], gate_up[0])
    act = torch.empty(n * slots, inter, dtype=x.dtype, device=x.device)
    _grouped_gate_up_kernel[(n * slots, triton.cdiv(inter, GATE_UP_BN))](
        x, top_i, gate_up, sg, su, act, n, hidden, inter, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        sg.stride(0), su.stride(0), act.stride(0), SLOTS=slots, BN=GATE_UP_BN, BK=GATE_UP_BK,
        IEEE=x.dtype == torch.float32 or not x.is_cuda, num_warps=4, num_stages=3, **_consts(n, k))
    return act


def grouped_down(act, top_i, down, shared_down=None):
    """See ref_grouped_down; one launch where the kernel runs, else the reference."""
    n, k = top_i.shape
    if not (use_triton(act) and 1 <= n <= MAX_TOKENS and act.stride(1) == 1 and down.stride(2) == 1
            and act.dtype == down.dtype) or (shared_down is not None and (
            shared_down.shape != down.shape[1:] or shared_down.stride(1) != 1 or shared_down.dtype != act.dtype)):
        return ref_grouped_down(act, top_i, down, shared_down)
    hidden, inter = down.shape[1], down.shape[2]
    slots = k + (shared_down is not None)
    assert act.shape == (n * slots, inter)
    top_i = top_i.contiguous()
    sd = shared_down if shared_down is not None else down[0]
    y = torch.empty(n * slots, hidden, dtype=act.dtype, device=act.device)
    _grouped_down_kernel[(n * slots, triton.cdiv(hidden, DOWN_BN))](
        act, top_i, down, sd, y, n, hidden, inter, act.stride(0), down.stride(0), down.stride(1),
        sd.stride(0), y.stride(0), SLOTS=slots, BN=DOWN_BN, BK=DOWN_BK,
        IEEE=act.dtype == torch.float32 or not act.is_cuda, num_warps=4, num_stages=3, **_consts(n, k))
    return y
