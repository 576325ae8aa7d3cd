"""The fused forward of the Gemma 4 GPU path: the same math as `Gemma4TextModel.forward` with its
torch modules (the reference, and the CPU path), in few launches per layer, no host sync (a decode
step runs it inside its CUDA Graph).

Why: a 26B-A4B decode step launched 1,460 kernels (H200, docs/gemma4.md) for 1.8 ms of weight
reads at the stream rate; every launch costs a few microseconds of an idle GPU whatever it does.
A layer here is (MoE layer; a dense layer drops the router and expert launches):

    qkv GEMV (q|k|v weights fused) -> qkv_norm_rope (q, and k/v into the caches) -> attention ->
    o_proj GEMV -> add_norms (residual + post-attention norm, then the pre-FF norms and the
    router's input) -> gate|up GEMV -> gelu_mul -> down GEMV -> router GEMV -> route (softmax,
    top-k, scales) -> expert gate|up GEMV with GeGLU -> expert down GEMV (core's grouped_down) ->
    moe_tail (weighted sum, branch norms, residual, layer scalar, next layer's input norm)

13 launches for a 26B-A4B layer, 9 for a 31B layer (about 40 and 23 before). The embedding and
the first norm are one launch, each layer type's RoPE table one, the final norm comes out of the
last layer's tail, the logit soft-cap is one launch after the LM head's GEMV. Linears of 1..8 rows
take core's decode GEMV (`ninfer_core.accel.gemv`, NINFER_GEMV=0: cuBLAS), wider ones F.linear
over the same fused weights (one GEMM for q|k|v and for gate|up in prefill too).

`prepare(model)` fuses the weights once: q|k|v of each attention layer and gate|up of each MLP
become one tensor whose row ranges the modules' own weights are views of (the state dict and the
reference path are unchanged, no memory is added). It declines (returns False, the model keeps the
module-by-module GPU path) for encoded (quantised) weights, biases or an activation other than
gelu_tanh. NINFER_GEMMA4_FUSE=0 turns it off for A/B runs. Forwards with quantised KV pages or
bidirectional media rows take the module path (`applies`).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ninfer_gemma4.gpu import step_kernels as K
from ninfer_gemma4.gpu.attention import use_triton

DECODE_TOKENS = 16  # at most this many rows take the grouped-expert GEMVs (layers.DECODE_TOKENS)


def enabled() -> bool:
    """NINFER_GEMMA4_FUSE=0: the module-by-module GPU path (for A/B runs)."""
    return os.environ.get("NINFER_GEMMA4_FUSE", "1") != "0"


def _plain(w) -> bool:
    """A weight the fused forward reads as it is: a plain tensor (not encoded), loaded (a pipeline
    stage leaves other stages' layers on the meta device: it declines then)."""
    return isinstance(w, torch.Tensor) and type(w) in (torch.Tensor, torch.nn.Parameter) and not w.is_meta


def _fuse(linears) -> torch.Tensor:
    """One weight [sum N, K] whose row ranges become the linears' weights (views)."""
    cat = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    off = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(cat[off: off + n], requires_grad=False)
        off += n
    return cat


def prepare(model) -> bool:
    """Fuse q|k|v and gate|up weights (see the module docstring); True when the fused forward applies."""
    model._fused_step = False
    if not enabled():
        return False
    cfg = model.cfg
    if cfg.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        return False
    mods = []
    for layer in model.layers:
        a = layer.self_attn
        lins = [a.q_proj, a.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
        if a.owns_kv:
            lins += [a.k_proj] + ([a.v_proj] if a.v_proj is not None else [])
        if layer.moe:
            lins.append(layer.router.proj)
            if not (_plain(layer.experts.gate_up_proj) and _plain(layer.experts.down_proj)):
                return False
        if layer.ple:
            lins += [layer.per_layer_input_gate, layer.per_layer_projection]
        if any(lin.bias is not None or not _plain(lin.weight) for lin in lins):
            return False
        mods.append(layer)
    for layer in mods:
        a = layer.self_attn
        qkv = [a.q_proj] + ([a.k_proj] + ([a.v_proj] if a.v_proj is not None else []) if a.owns_kv else [])
        a._qkv_weight = _fuse(qkv) if len(qkv) > 1 else a.q_proj.weight.detach()
        layer.mlp._gate_up_weight = _fuse([layer.mlp.gate_proj, layer.mlp.up_proj])
    model._fused_step = True
    return True


def applies(model, ctx, x_like: torch.Tensor) -> bool:
    return (getattr(model, "_fused_step", False) and enabled() and use_triton(x_like) and not ctx.kv_scale
            and not any(seg.blocks for seg in ctx.segments))


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """x @ w^T: core's decode GEMV for 1..8 rows where it runs, else F.linear."""
    from ninfer_core.accel import gemv as G

    if G.enabled() and G.supported(x, w):
        return G.gemv(x, w, out_dtype=out_dtype)
    y = F.linear(x, w)
    return y if out_dtype is None else y.to(out_dtype)


def _const(model, value: float, like: torch.Tensor) -> torch.Tensor:
    return model._const(value, like)


def forward(model, ids, ctx, embeds=None, ple_ids=None, collect=()):
    """`Gemma4TextModel.forward` fused: (final-normed hidden, {layer: output} for `collect`)."""
    cfg = model.cfg
    layers = model.layers
    first = layers[0].input_layernorm
    table = model.embed_tokens.weight
    if embeds is None and _plain(table):
        x, xn = K.embed_norm(ids, table, _const(model, cfg.hidden_size ** 0.5, table), first.weight, first.eps)
    else:
        x = model.scaled_embed(ids) if embeds is None else embeds
        xn = first(x)
    ple = None
    if cfg.hidden_size_per_layer_input:
        ple = model.per_layer_inputs(ids if ple_ids is None else ple_ids, x)
    ctx.rope = {kind: K.rope_cos_sin(f, ctx.positions, x.dtype) for kind, f in model.freqs.items()}
    outs = {}
    n = len(layers)
    for i, layer in enumerate(layers):
        nxt = layers[i + 1].input_layernorm if i + 1 < n else model.norm
        x, xn = layer_forward(layer, x, xn, None if ple is None else ple[:, i], ctx, nxt)
        if i in collect:
            outs[i] = x
    return xn, outs


def attention(a, xn, ctx):
    """o_proj(attention(xn)) of an Attention module `a` through the fused projection."""
    t = xn.shape[0]
    cos, sin = ctx.rope[a.layer_type]
    qkv = linear(xn, a._qkv_weight)
    k_cache, v_cache = ctx.kv[a.source]
    if a.owns_kv:
        page, row = ctx.write_rows[ctx.group_of[a.layer_idx]]
        q = K.qkv_norm_rope(qkv, a.heads, a.kv_heads, a.head_dim, a.q_norm.weight, a.k_norm.weight, a.q_norm.eps,
                            cos, sin, a.v_proj is None, k_cache, v_cache, page, row)
    else:
        q = K.qkv_norm_rope(qkv, a.heads, 0, a.head_dim, a.q_norm.weight, None, a.q_norm.eps, cos, sin, False)
    out = a._attend_rows(q, k_cache, v_cache, t, ctx)
    return linear(out, a.o_proj.weight)


def experts(layer, xe, weights, index):
    """Routed rows for the tail: (rows, weights, perm) as `moe_tail` reads them."""
    ex = layer.experts
    if index.shape[0] <= DECODE_TOKENS:
        from ninfer_core.accel.moe_gemv import grouped_down

        act = K.expert_gate_up_gelu(xe, index, ex.gate_up_proj)
        return grouped_down(act, index, ex.down_proj), weights, None
    sorted_rows = grouped_sorted(xe, index, ex.gate_up_proj, ex.down_proj)
    if sorted_rows is not None:
        y, inv = sorted_rows
        return y, weights, inv
    return ex.forward_loop(xe, weights, index), None, None


def grouped_sorted(x, index, gate_up, down):
    """Prefill experts: pairs sorted by expert, two `torch._grouped_mm` GEMMs (GeGLU between them in
    one launch); (rows in sorted order, inverse permutation: pair t * k + j is row inv[t * k + j]),
    or None where the grouped GEMM is missing or refuses the input (the caller loops)."""
    from ninfer_gemma4.gpu import moe

    gmm = getattr(torch, "_grouped_mm", None)
    if gmm is None or not x.is_cuda or (x.device.type, x.dtype) in moe._REFUSED:
        return None
    k = index.shape[1]
    flat = index.reshape(-1)
    ids, order = torch.sort(flat, stable=True)
    offs = torch.searchsorted(ids, torch.arange(gate_up.shape[0], device=x.device, dtype=ids.dtype), right=True,
                              out_int32=True)
    try:
        gu = gmm(x.index_select(0, order // k), gate_up.transpose(1, 2), offs=offs)
        y = gmm(K.gelu_mul(gu), down.transpose(1, 2), offs=offs)
    except (RuntimeError, TypeError, ValueError):
        moe._REFUSED.add((x.device.type, x.dtype))
        return None
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=x.device, dtype=order.dtype)
    return y, inv


def layer_forward(layer, x, xn, ple_row, ctx, nxt):
    """(x', next norm(x')) of a DecoderLayer given x and its input norm xn; `nxt` the next RMSNorm."""
    eps = layer.input_layernorm.eps
    y = attention(layer.self_attn, xn, ctx)
    if layer.moe:
        r = layer.router
        x1, n1, n2, rin = K.add_norms(x, y, layer.post_attention_layernorm.weight, eps, None,
                                      (layer.pre_feedforward_layernorm.weight, layer.pre_feedforward_layernorm_2.weight,
                                       _ones(layer, x)), (r.scale, r.root))
    else:
        x1, n1 = K.add_norms(x, y, layer.post_attention_layernorm.weight, eps, None,
                             (layer.pre_feedforward_layernorm.weight,))
    mlp = layer.mlp
    h = K.gelu_mul(linear(n1, mlp._gate_up_weight))
    ym = linear(h, mlp.down_proj.weight)
    scalar = None if layer.ple else layer.layer_scalar
    w_next = None if layer.ple else nxt.weight
    if layer.moe:
        weights, index = K.route(linear(rin, r.proj.weight), r.top_k, r.per_expert_scale)
        rows, rw, perm = experts(layer, n2, weights, index)
        res = K.moe_tail(rows, rw, ym, x1, layer.post_feedforward_layernorm_1.weight,
                         layer.post_feedforward_layernorm_2.weight, layer.post_feedforward_layernorm.weight, eps,
                         scalar, w_next, perm)
    else:
        res = K.add_norms(x1, ym, layer.post_feedforward_layernorm.weight, eps, scalar,
                          () if w_next is None else (w_next,))
    if not layer.ple:
        return res[0], res[1]
    x = res[0]
    from ninfer_gemma4.gpu.fused import add_rms_norm
    from ninfer_gemma4.layers import act

    g = act(layer.activation, linear(x, layer.per_layer_input_gate.weight)) * ple_row
    norm = layer.post_per_layer_input_norm
    x = add_rms_norm(x, linear(g, layer.per_layer_projection.weight), norm.weight, norm.eps, layer.layer_scalar)
    return x, nxt(x)


def _ones(layer, like):
    """The router norm has no weight: a ones vector (made once per layer, on like's device)."""
    o = getattr(layer, "_router_ones", None)
    if o is None or o.device != like.device or o.dtype != like.dtype:
        o = layer._router_ones = torch.ones(like.shape[-1], dtype=like.dtype, device=like.device)
    return o


def logits(model, hidden):
    """The LM head (fp32 out of the GEMV) and the soft-cap in one launch each."""
    w = model.lm_head.weight
    if not _plain(w):
        return None
    out = linear(hidden if hidden.dim() == 2 else hidden.unsqueeze(0), w, out_dtype=torch.float32)
    out = out if hidden.dim() == 2 else out[0]
    cap = model.cfg.final_logit_softcapping
    return K.softcap(out.contiguous(), cap) if cap else out
