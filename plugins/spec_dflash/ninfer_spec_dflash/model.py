"""The DFlash / DFlash2 drafter as torch modules, parameters under the checkpoint's names.

Context: the target's outputs of `target_layer_ids` at each committed position, concatenated
[T, L*H], become `hidden_norm(fc(.))` [T, H]; each draft layer projects them to its own K/V
(`k_norm(k_proj(.))` with RoPE at the position, `v_proj(.)`). Those rows depend only on the target,
so they are computed once per position and kept (the backend's per-lane context).

Block: [last committed token, mask x K] at positions p .. p+K, embedded with the target's
embeddings; every draft layer's queries attend, without a causal mask, to the context K/V and to
the block's own K/V; the final norm's output at block rows 1..K goes to the target's LM head.

DFlash2 wraps each attention and MLP sublayer in a two-tap grouped dynamic causal convolution
over the block axis (tap weights = a learned base kernel per channel + a per-group correction
projected from the sublayer input; taps never reach before the block's first row), and picks the
drafts with a candidate selector: each position keeps its top-k candidates by the LM-head logits
and walks them from the anchor token, scoring candidate b after predecessor a as
logit(b) + <pred[a] * proj(h_t), succ[b]> (low-rank codebooks over the vocabulary).

The same modules train (ninfer_tiny.train_dflash): `layer_forward` takes an explicit key mask, so
many anchored blocks of one sequence run in one pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ninfer_spec_dflash.config import DrafterConfig


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm (weight times the normalised input; the drafter's norms are not zero-centred)."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE over the whole head: x [..., T, heads, hd], pos [..., T] (int)."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = pos.to(torch.float32)[..., None] * inv  # [..., T, hd/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[..., None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[..., None, :]
    xf = x.float()
    x1, x2 = xf[..., : hd // 2], xf[..., hd // 2:]
    return (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class GroupedDynamicConv(nn.Module):
    """DFlash2's two-tap (kernel_size taps) depthwise causal conv over the block axis.

    out[t, c] = sum_o (base[o, c] + dyn[t, o, c // group]) * x[t - o, c], x before the block = 0.
    `prepare` convolves the sublayer input and returns the output side's dynamic taps for `finish`.
    """

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group, self.groups = kernel, group, hidden // group
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * self.groups, bias=False)

    def _conv(self, x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        # x [..., S, H]; dyn [..., S, K, G]; base [K, H]
        s, h = x.shape[-2], x.shape[-1]
        out = torch.zeros_like(x)
        for o in range(min(self.kernel, s)):
            shifted = x if o == 0 else F.pad(x[..., : s - o, :], (0, 0, o, 0))
            w = base[o].to(x.dtype) + dyn[..., o, :].repeat_interleave(self.group, dim=-1)  # [..., S, H]
            out = out + w * shifted
        return out.view(*x.shape[:-1], h)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel, self.groups)
        return self._conv(x, dyn[..., 0, :, :], self.base_kernel[0]), dyn[..., 1, :, :]

    def finish(self, x: torch.Tensor, dyn: torch.Tensor) -> torch.Tensor:
        return self._conv(x, dyn, self.base_kernel[1])


class Attention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        hd, bias = c.head_dim, c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(c.num_heads * hd, c.hidden_size, bias=bias)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V [..., T, kv_heads, hd] of rows x [..., T, H] at positions pos."""
        shape = (*x.shape[:-1], self.c.num_kv_heads, self.c.head_dim)
        k = rope(self.k_norm(self.k_proj(x).view(shape)), pos, self.c.rope_theta)
        return k, self.v_proj(x).view(shape)

    def forward(self, x, pos, ctx_k, ctx_v, mask):
        """x [B, S, H] at pos [B, S]; ctx_k/v [B, C, kvh, hd]; mask [B, S, C + S] (True: attend)."""
        c = self.c
        b, s, _ = x.shape
        q = rope(self.q_norm(self.q_proj(x).view(b, s, c.num_heads, c.head_dim)), pos, c.rope_theta)
        k, v = self.kv(x, pos)
        k = torch.cat([ctx_k.to(k.dtype), k], 1).transpose(1, 2)  # [B, kvh, C+S, hd]
        v = torch.cat([ctx_v.to(v.dtype), v], 1).transpose(1, 2)
        rep = c.num_heads // c.num_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None])
        return self.o_proj(o.transpose(1, 2).reshape(b, s, c.num_heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.kind == "dflash2":
            self.attention_conv = GroupedDynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)
            self.mlp_conv = GroupedDynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)
        else:
            self.attention_conv = self.mlp_conv = None

    def _sub(self, conv, fn, h, block: int):
        if conv is None:
            return fn(h)
        # the conv runs inside each block of `block` rows: [B, N*S, H] -> [B, N, S, H]
        shape = h.shape
        hb, dyn = conv.prepare(h.view(shape[0], -1, block, shape[-1]))
        out = fn(hb.reshape(shape))
        return conv.finish(out.view(shape[0], -1, block, shape[-1]), dyn).reshape(shape)

    def forward(self, x, pos, ctx_k, ctx_v, mask, block: int):
        h = self.input_layernorm(x)
        x = x + self._sub(self.attention_conv, lambda t: self.self_attn(t, pos, ctx_k, ctx_v, mask), h, block)
        h = self.post_attention_layernorm(x)
        return x + self._sub(self.mlp_conv, self.mlp, h, block)


class CandidateSelector(nn.Module):
    def __init__(self, c: DrafterConfig, vocab_size: int):
        super().__init__()
        self.top_k = c.selector_top_k
        self.hidden_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, c.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, c.selector_rank))

    def scores(self, prev: torch.Tensor, proj: torch.Tensor, cand: torch.Tensor, unary: torch.Tensor):
        """prev [...] ids, proj [..., r], cand [..., k] ids, unary [..., k] -> scores [..., k]."""
        ctx = self.predecessor_codebook[prev].float() * proj.float()  # [..., r]
        return unary.float() + torch.einsum("...r,...kr->...k", ctx, self.successor_codebook[cand].float())

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor,
             ids: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy path over the top-k candidates: hidden [B, K, H], logits [B, K, V'] (V' columns of
        token ids `ids`, all ids when None), anchor [B] -> drafts [B, K]."""
        unary, cols = torch.topk(logits.float(), min(self.top_k, logits.shape[-1]), dim=-1)
        cand = cols if ids is None else ids[cols]
        proj = self.hidden_projection(hidden)
        prev, path = anchor, []
        for t in range(hidden.shape[1]):
            s = self.scores(prev, proj[:, t], cand[:, t], unary[:, t])
            prev = cand[:, t].gather(-1, s.argmax(-1, keepdim=True))[:, 0]
            path.append(prev)
        return torch.stack(path, 1)


class Drafter(nn.Module):
    """The drafter's own weights; the target supplies embeddings and the LM head."""

    def __init__(self, c: DrafterConfig, vocab_size: int = 0):
        super().__init__()
        self.c = c
        self.layers = nn.ModuleList([DraftLayer(c) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.candidate_selector = CandidateSelector(c, vocab_size) if c.kind == "dflash2" else None

    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features [..., T, L*H] (layer outputs concatenated in target_layer_ids order) -> [..., T, H]."""
        return self.hidden_norm(self.fc(feats.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each draft layer's K/V rows [..., T, kvh, hd] of context rows ctx [..., T, H] at pos [..., T]."""
        return [layer.self_attn.kv(ctx, pos) for layer in self.layers]

    def window_mask(self, layer: int, mask: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        """A sliding-window layer's mask: keys no more than window - 1 positions before the query."""
        w = self.c.window(layer)
        if w is None:
            return mask
        return mask & (kpos[:, None, :] > qpos[:, :, None] - w)

    def forward(self, x, pos, ctx_kv, mask, kpos=None, block: int | None = None) -> torch.Tensor:
        """Blocks x [B, N*S, H] (noise embeddings) at pos [B, N*S]; ctx_kv per layer ([B, C, kvh, hd]
        K and V); mask [B, N*S, C + N*S] (True: attend); kpos [B, C + N*S] the keys' positions (for
        sliding-window layers). Returns the final-normed hidden [B, N*S, H]."""
        block = block or x.shape[1]
        for i, layer in enumerate(self.layers):
            m = mask if kpos is None else self.window_mask(i, mask, pos, kpos)
            x = layer(x, pos, ctx_kv[i][0], ctx_kv[i][1], m, block)
        return self.norm(x)
