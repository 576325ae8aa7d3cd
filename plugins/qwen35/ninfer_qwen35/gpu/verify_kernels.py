"""Kernels of a speculative verify round's Gated DeltaNet layers, each with its torch reference.

A verify runs T = k + 1 tokens of each of B lanes (rows lane-major: lane b's rows b*T .. b*T+T-1).
GDN state cannot be truncated, so the verify never writes a lane's conv or recurrent state; the
round's commit then advances it by exactly the tokens the lane kept. Two ways to commit, chosen by
measurement (`GpuQwen35Runner.verify_mode`):

- "recompute": the verify keeps its conv inputs and outputs; the commit runs the recurrence again
  over the kept rows from the slot's state (reads and writes the state once more);
- "positions": the verify also stores the state after every row ([B, T, HV, dk, dv] fp32 per layer,
  T times the state's bytes written), and the commit copies the kept position's state into the slot.

- `conv_verify`: the causal conv (+ SiLU) of every row from the lane's conv state, state untouched;
  `conv_commit` sets the state to the last K-1 inputs through the kept rows.
- `gdn_verify`: the gated delta rule over each lane's rows (the decode step's math, looped in the
  kernel with the state in registers): outputs of every row, the state left alone (or stored per
  position); `gdn_commit` re-runs the kept rows and writes the state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer_core.accel.kernels import HAVE_TRITON, ref_gdn_decode, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ninfer_core.accel.kernels import gdn_token_step


# ------------------------------------------------------------------------------------------------
# torch references
# ------------------------------------------------------------------------------------------------
def ref_conv_verify(x, conv_all, weight, slots, t: int):
    """x [B*T, C] raw conv inputs; conv_all [S, C, 3]; weight [C, 4]; slots [B] -> silu(conv) [B*T, C]."""
    b = slots.shape[0]
    c = x.shape[1]
    full = torch.cat([conv_all[slots].to(x.dtype), x.reshape(b, t, c).transpose(1, 2)], dim=-1)  # [B, C, 3+T]
    out = torch.empty(b, t, c, dtype=x.dtype, device=x.device)
    for j in range(t):  # the decode step's math per row: (window * weight).sum in the input dtype
        out[:, j] = F.silu((full[:, :, j: j + 4] * weight[None]).sum(-1))
    return out.reshape(b * t, c)


def ref_conv_commit(x, conv_all, slots, kept, t: int):
    """conv_all[slot] <- the last 3 inputs of [state | x rows of the lane][: 3 + kept]."""
    b = slots.shape[0]
    c = x.shape[1]
    full = torch.cat([conv_all[slots].to(x.dtype), x.reshape(b, t, c).transpose(1, 2)], dim=-1)
    for i in range(b):
        n = int(kept[i])
        conv_all[int(slots[i])] = full[i, :, n: n + 3].to(conv_all.dtype)


def ref_gdn_verify(mixed, a_raw, b_raw, A_log, dt_bias, state, slots, t: int, hk, dk, dv, scale, eps=1e-6,
                   positions=None):
    """Every row's output [B*T, HV, dv]; the slots' state untouched. `positions` [B, T, HV, dk, dv]
    (optional) receives the state after each row."""
    b = slots.shape[0]
    hv = a_raw.shape[1]
    work = state[slots].clone()  # [B, HV, dk, dv]
    tmp_slots = torch.arange(b, device=mixed.device)
    outs = []
    rows = torch.arange(b, device=mixed.device) * t
    for j in range(t):
        outs.append(ref_gdn_decode(mixed[rows + j], a_raw[rows + j], b_raw[rows + j], A_log, dt_bias, work,
                                   tmp_slots, hk, dk, dv, scale, eps))
        if positions is not None:
            positions[:, j] = work
    return torch.stack(outs, 1).reshape(b * t, hv, dv)


def ref_gdn_commit(mixed, a_raw, b_raw, A_log, dt_bias, state, slots, kept, t: int, hk, dk, dv, scale, eps=1e-6):
    """Advance each lane's state by its first `kept[b]` rows (in place)."""
    for i in range(slots.shape[0]):
        n = int(kept[i])
        sl = slots[i: i + 1]
        for j in range(n):
            r = i * t + j
            ref_gdn_decode(mixed[r: r + 1], a_raw[r: r + 1], b_raw[r: r + 1], A_log, dt_bias, state, sl,
                           hk, dk, dv, scale, eps)


def ref_positions_commit(state, positions, slots, kept):
    for i in range(slots.shape[0]):
        state[int(slots[i])] = positions[i, int(kept[i]) - 1]


# ------------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------------
if HAVE_TRITON:

    @triton.jit(do_not_specialize=["T", "C"])
    def _conv_verify_kernel(X, STATE, W, SLOTS, OUT, T, C, s_xr, s_s0, s_or,
                            BT: tl.constexpr, BC: tl.constexpr):
        b = tl.program_id(0)
        t = tl.program_id(1) * BT + tl.arange(0, BT)
        c = tl.program_id(2) * BC + tl.arange(0, BC)
        tm = t < T
        cm = c < C
        slot = tl.load(SLOTS + b).to(tl.int64)
        row0 = b.to(tl.int64) * T
        acc = tl.zeros([BT, BC], tl.float32)
        for j in tl.static_range(4):  # tap j reads input time t - 3 + j: a row, or the cached state
            src = t - 3 + j
            from_x = src >= 0
            xv = tl.load(X + (row0 + src.to(tl.int64))[:, None] * s_xr + c[None, :],
                         mask=(from_x & tm)[:, None] & cm[None, :], other=0.0).to(tl.float32)
            sv = tl.load(STATE + slot * s_s0 + c[None, :] * 3 + (3 + src)[:, None],
                         mask=((~from_x) & tm)[:, None] & cm[None, :], other=0.0).to(tl.float32)
            w = tl.load(W + c * 4 + j, mask=cm, other=0.0).to(tl.float32)
            acc += (xv + sv) * w[None, :]
        out = acc * tl.sigmoid(acc)
        tl.store(OUT + (row0 + t.to(tl.int64))[:, None] * s_or + c[None, :], out.to(OUT.dtype.element_ty),
                 mask=tm[:, None] & cm[None, :])

    @triton.jit(do_not_specialize=["T", "C"])
    def _conv_commit_kernel(X, STATE, SLOTS, KEPT, T, C, s_xr, s_s0, BC: tl.constexpr):
        b = tl.program_id(0)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = c < C
        slot = tl.load(SLOTS + b).to(tl.int64)
        n = tl.load(KEPT + b).to(tl.int64)
        row0 = b.to(tl.int64) * T
        sp = STATE + slot * s_s0 + c * 3
        nv = tl.zeros([BC], tl.int64) + n  # (vector masks: the interpreter refuses scalar ones)
        # the new state is [state | rows][n : n + 3]; index i < 3 is the old state, else row i - 3
        v0 = tl.load(sp + tl.minimum(nv, 2), mask=cm & (nv < 3), other=0.0).to(tl.float32) + tl.load(
            X + (row0 + nv - 3) * s_xr + c, mask=cm & (nv >= 3), other=0.0).to(tl.float32)
        v1 = tl.load(sp + 2, mask=cm & (nv < 2), other=0.0).to(tl.float32) + tl.load(
            X + (row0 + nv - 2) * s_xr + c, mask=cm & (nv >= 2), other=0.0).to(tl.float32)
        v2 = tl.load(X + (row0 + nv - 1) * s_xr + c, mask=cm, other=0.0)  # kept >= 1: always a row
        tl.store(sp, v0.to(STATE.dtype.element_ty), mask=cm)
        tl.store(sp + 1, v1.to(STATE.dtype.element_ty), mask=cm)
        tl.store(sp + 2, v2.to(STATE.dtype.element_ty), mask=cm)

    @triton.jit(do_not_specialize=["T"])
    def _gdn_rows_kernel(MIXED, A_RAW, B_RAW, A_LOG, DT_BIAS, STATE, SLOTS, NSTEP, OUT, POS, T, scale, eps,
                         s_mr, s_ar, s_br, s_s0, s_s1, s_s2, s_or, s_oh, s_p0, s_p1,
                         HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         BV: tl.constexpr, WRITE_OUT: tl.constexpr, WRITE_STATE: tl.constexpr,
                         STORE_POS: tl.constexpr):
        """Rows b*T .. b*T+NSTEP[b]-1 of lane b, one recurrent step each (the decode kernel's math)."""
        b = tl.program_id(0)
        hv = tl.program_id(1)
        iv = tl.program_id(2)
        hk = hv // (HV // HK)
        slot = tl.load(SLOTS + b).to(tl.int64)
        n = tl.load(NSTEP + b)
        offs_k = tl.arange(0, DK)
        offs_v = iv * BV + tl.arange(0, BV)
        sp = STATE + slot * s_s0 + hv * s_s1 + offs_k[:, None] * s_s2 + offs_v[None, :]
        s = tl.load(sp)
        neg_a = -tl.exp(tl.load(A_LOG + hv).to(tl.float32))
        dtb = tl.load(DT_BIAS + hv).to(tl.float32)
        r = b.to(tl.int64) * T
        for j in range(n):
            s, q = gdn_token_step(MIXED + r * s_mr, A_RAW + r * s_ar + hv, B_RAW + r * s_br + hv, s, neg_a, dtb, hk,
                                  hv, offs_k, offs_v, scale, eps, HK, DK, DV)
            if WRITE_OUT:
                o = tl.sum(s * q[:, None], 0)
                tl.store(OUT + r * s_or + hv * s_oh + offs_v, o.to(OUT.dtype.element_ty))
            if STORE_POS:
                tl.store(POS + b.to(tl.int64) * s_p0 + j * s_p1 + hv * s_s1 + offs_k[:, None] * s_s2
                         + offs_v[None, :], s)
            r += 1
        if WRITE_STATE:
            tl.store(sp, s)

    @triton.jit
    def _positions_commit_kernel(STATE, POS, SLOTS, KEPT, s_s0, s_p0, s_p1, N, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        slot = tl.load(SLOTS + b).to(tl.int64)
        j = tl.load(KEPT + b).to(tl.int64) - 1
        v = tl.load(POS + b.to(tl.int64) * s_p0 + j * s_p1 + i, mask=m)
        tl.store(STATE + slot * s_s0 + i, v, mask=m)


def conv_verify(x, conv_all, weight, slots, t: int):
    """See ref_conv_verify (kernel width 4); CUDA-graph safe."""
    if not use_triton(x) or weight.shape[-1] != 4:
        return ref_conv_verify(x, conv_all, weight, slots, t)
    r, c = x.shape
    b = slots.shape[0]
    assert x.stride(1) == 1 and conv_all.is_contiguous() and weight.is_contiguous() and slots.is_contiguous()
    out = torch.empty(r, c, dtype=x.dtype, device=x.device)
    bt, bc = 16, 128
    _conv_verify_kernel[(b, triton.cdiv(t, bt), triton.cdiv(c, bc))](
        x, conv_all, weight, slots, out, t, c, x.stride(0), conv_all.stride(0), out.stride(0),
        BT=bt, BC=bc, num_warps=4)
    return out


def conv_commit(x, conv_all, slots, kept, t: int):
    """See ref_conv_commit; kept int32/int64 [B] on the device (each >= 1)."""
    if not use_triton(x):
        return ref_conv_commit(x, conv_all, slots, kept, t)
    c = x.shape[1]
    b = slots.shape[0]
    bc = 256
    _conv_commit_kernel[(b, triton.cdiv(c, bc))](x, conv_all, slots, kept, t, c, x.stride(0), conv_all.stride(0),
                                                 BC=bc, num_warps=4)


def _gdn_rows(mixed, a_raw, b_raw, A_log, dt_bias, state, slots, nstep, t, hk, dk, dv, scale, eps, out, pos,
              write_out, write_state, store_pos):
    b = slots.shape[0]
    hv = a_raw.shape[1]
    bv = min(32, dv)
    assert mixed.stride(1) == 1 and state.is_contiguous() and slots.is_contiguous() and nstep.is_contiguous()
    assert a_raw.stride(1) == 1 and b_raw.stride(1) == 1
    o = out if out is not None else state  # a dummy pointer when nothing is written
    p = pos if pos is not None else state
    _gdn_rows_kernel[(b, hv, triton.cdiv(dv, bv))](
        mixed, a_raw, b_raw, A_log, dt_bias, state, slots, nstep, o, p, t, scale, eps,
        mixed.stride(0), a_raw.stride(0), b_raw.stride(0), state.stride(0), state.stride(1), state.stride(2),
        o.stride(0) if out is not None else 0, o.stride(1) if out is not None else 0,
        p.stride(0) if pos is not None else 0, p.stride(1) if pos is not None else 0,
        HK=hk, HV=hv, DK=dk, DV=dv, BV=bv, WRITE_OUT=write_out, WRITE_STATE=write_state, STORE_POS=store_pos,
        num_warps=4)


def gdn_verify(mixed, a_raw, b_raw, A_log, dt_bias, state, slots, t: int, hk, dk, dv, scale, eps=1e-6,
               positions=None):
    """See ref_gdn_verify: every row's output [B*T, HV, dv]; the state untouched (positions, when
    given [B, T, HV, dk, dv] fp32, gets the state after each row). CUDA-graph safe."""
    if not use_triton(mixed):
        return ref_gdn_verify(mixed, a_raw, b_raw, A_log, dt_bias, state, slots, t, hk, dk, dv, scale, eps, positions)
    b = slots.shape[0]
    hv = a_raw.shape[1]
    out = torch.empty(b * t, hv, dv, dtype=mixed.dtype, device=mixed.device)
    nstep = torch.full((b,), t, dtype=torch.int32, device=mixed.device)
    _gdn_rows(mixed, a_raw, b_raw, A_log, dt_bias, state, slots, nstep, t, hk, dk, dv, scale, eps, out, positions,
              True, False, positions is not None)
    return out


def gdn_commit(mixed, a_raw, b_raw, A_log, dt_bias, state, slots, kept, t: int, hk, dk, dv, scale, eps=1e-6):
    """See ref_gdn_commit: each lane's state advanced by its kept rows, in place."""
    if not use_triton(mixed):
        return ref_gdn_commit(mixed, a_raw, b_raw, A_log, dt_bias, state, slots, kept, t, hk, dk, dv, scale, eps)
    _gdn_rows(mixed, a_raw, b_raw, A_log, dt_bias, state, slots, kept.to(torch.int32).contiguous(), t, hk, dk, dv,
              scale, eps, None, None, False, True, False)


def positions_commit(state, positions, slots, kept):
    """See ref_positions_commit: the kept position's state copied into each slot."""
    if not use_triton(state):
        return ref_positions_commit(state, positions, slots, kept)
    b = slots.shape[0]
    n = state[0].numel()
    block = 1024
    assert state.is_contiguous() and positions.is_contiguous()
    _positions_commit_kernel[(b, triton.cdiv(n, block))](state, positions, slots, kept, state.stride(0),
                                                         positions.stride(0), positions.stride(1), n,
                                                         BLOCK=block, num_warps=4)
