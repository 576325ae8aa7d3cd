"""The torch reference pieces against direct computations: GDN rule and conv, RoPE vs transformers."""

import torch
import torch.nn.functional as F
from ninfer_qwen35.config import Qwen35Config
from ninfer_qwen35.testing import tiny_text_config

from ninfer_core.nn.gdn import (
    causal_conv_prefill,
    causal_conv_step,
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_step,
)
from ninfer_core.nn.layers import RotaryEmbedding, apply_rotary


def _rule_inputs(T, H=3, dk=8, dv=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(T, H, dk, generator=g)) * dk**-0.5
    k = l2norm(torch.randn(T, H, dk, generator=g))
    v = torch.randn(T, H, dv, generator=g)
    decay = -torch.rand(T, H, generator=g) * 2.0
    beta = torch.rand(T, H, generator=g)
    s0 = torch.randn(H, dk, dv, generator=g)
    return q, k, v, decay, beta, s0


def _token_loop(q, k, v, g, beta, s):
    """The delta rule written per token, per head, with plain matrix algebra."""
    outs = []
    for t in range(q.shape[0]):
        o_t = []
        s_new = torch.empty_like(s)
        for h in range(q.shape[1]):
            sh = s[h] * torch.exp(g[t, h])
            u = beta[t, h] * (v[t, h] - sh.T @ k[t, h])
            sh = sh + torch.outer(k[t, h], u)
            s_new[h] = sh
            o_t.append(sh.T @ q[t, h])
        s = s_new
        outs.append(torch.stack(o_t))
    return torch.stack(outs), s


def test_chunked_rule_matches_token_loop():
    for T, chunk in [(1, 64), (5, 64), (37, 8), (64, 16), (70, 64)]:
        q, k, v, g, beta, s0 = _rule_inputs(T, seed=T)
        ref_o, ref_s = _token_loop(q, k, v, g, beta, s0)
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk=chunk)
        assert torch.allclose(o, ref_o, atol=1e-5, rtol=1e-4), (T, chunk, (o - ref_o).abs().max())
        assert torch.allclose(s, ref_s, atol=1e-5, rtol=1e-4)


def test_recurrent_step_matches_token_loop_batched():
    B, T = 3, 4
    ins = [_rule_inputs(T, seed=100 + b) for b in range(B)]
    s = torch.stack([x[5] for x in ins])
    for t in range(T):
        q, k, v, g, beta = (torch.stack([x[i][t] for x in ins]) for i in range(5))
        o, s = recurrent_gated_delta_step(q, k, v, g, beta, s)
    for b in range(B):
        ref_o, ref_s = _token_loop(*ins[b][:5], ins[b][5])
        assert torch.allclose(o[b], ref_o[-1], atol=1e-5)
        assert torch.allclose(s[b], ref_s, atol=1e-5)


def test_conv_prefill_and_steps_match_full_conv():
    g = torch.Generator().manual_seed(0)
    C, K, T = 6, 4, 11
    w = torch.randn(C, K, generator=g)
    x = torch.randn(C, T, generator=g)
    ref = F.silu(F.conv1d(F.pad(x, (K - 1, 0))[None], w[:, None, :], groups=C)[0])
    # prefill 2 columns (fewer than K-1: the state keeps older zeros), then 5, then steps
    state = torch.zeros(C, K - 1)
    o1, state = causal_conv_prefill(x[:, :2], state, w)
    o2, state = causal_conv_prefill(x[:, 2:7], state, w)
    outs = [o1, o2]
    bstate = state[None]
    for t in range(7, T):
        o, bstate = causal_conv_step(x[None, :, t], bstate, w)
        outs.append(o[0][:, None])
    assert torch.allclose(torch.cat(outs, dim=1), ref, atol=1e-6)


def test_text_rope_equals_transformers_mrope():
    """Text positions are equal on mRoPE's three axes: plain partial RoPE gives identical numbers."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    for head_dim, section, theta in [(256, [11, 11, 10], 1e7), (32, [2, 1, 1], 1e4)]:
        text = tiny_text_config("dense")
        text.update(head_dim=head_dim)
        text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=section, rope_theta=theta)
        text.pop("model_type")
        hf = Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(**text))
        pos = torch.tensor([0, 1, 2, 63, 64, 1000, 262143])
        x = torch.zeros(1, len(pos), 4)
        hf_cos, hf_sin = hf(x, pos[None].expand(3, 1, -1))
        ours = RotaryEmbedding(head_dim, Qwen35Config.from_hf(text, "qwen3_5_text").rope)
        cos, sin = ours.cos_sin(pos, torch.float32)
        assert cos.shape[-1] == head_dim // 4
        assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])


def test_apply_rotary_matches_transformers():
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(3)
    n, h, d, rot = 5, 2, 32, 8
    q, k = torch.randn(n, h, d, generator=g), torch.randn(n, h, d, generator=g)
    cos, sin = torch.randn(n, rot, generator=g), torch.randn(n, rot, generator=g)
    ref_q, ref_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    assert torch.equal(apply_rotary(q, cos, sin), ref_q[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, sin), ref_k[0].transpose(0, 1))
