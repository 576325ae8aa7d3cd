"""The MTP head against a direct torch computation from the artifact's tensors."""

import math

import pytest
import torch
import torch.nn.functional as F
from ninfer_qwen35.family import Qwen35Family
from ninfer_qwen35.testing import build_tiny_artifact

from ninfer_core.artifact import Artifact


def rms1p(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def direct_mtp(art, tokens, hidden, start):
    """Written out from the checkpoint description, sharing nothing with the plugin's modules."""
    t = art.get_tensor
    tc = art.config["text_config"]
    nh, kvh, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    rp = tc["rope_parameters"]
    rot = int(hd * rp["partial_rotary_factor"])
    emb = t("model.language_model.embed_tokens.weight")[torch.tensor(tokens)]
    x = torch.cat(
        [
            rms1p(emb, t("mtp.pre_fc_norm_embedding.weight")),
            rms1p(hidden, t("mtp.pre_fc_norm_hidden.weight")),
        ],
        -1,
    )
    x = x @ t("mtp.fc.weight").T
    p = "mtp.layers.0."
    T = len(tokens)
    hn = rms1p(x, t(p + "input_layernorm.weight"))
    qg = (hn @ t(p + "self_attn.q_proj.weight").T).view(T, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
    q = rms1p(q, t(p + "self_attn.q_norm.weight"))
    k = rms1p((hn @ t(p + "self_attn.k_proj.weight").T).view(T, kvh, hd), t(p + "self_attn.k_norm.weight"))
    v = (hn @ t(p + "self_attn.v_proj.weight").T).view(T, kvh, hd)
    # neox rotation of the first `rot` dims: pair (i, i + rot/2) turned by pos * theta^(-2i/rot)
    pos = torch.arange(start, start + T, dtype=torch.float64)
    inv = rp["rope_theta"] ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = (pos[:, None] * inv[None]).float()
    c, s = ang.cos()[:, None], ang.sin()[:, None]

    def rope(z):
        a, b = z[..., : rot // 2], z[..., rot // 2 : rot]
        return torch.cat([a * c - b * s, b * c + a * s, z[..., rot:]], -1)

    q, k = rope(q), rope(k)
    k = k.repeat_interleave(nh // kvh, dim=1)
    v = v.repeat_interleave(nh // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, nh * hd)
    x = x + (attn * torch.sigmoid(gate)) @ t(p + "self_attn.o_proj.weight").T
    hn = rms1p(x, t(p + "post_attention_layernorm.weight"))
    m = F.silu(hn @ t(p + "mlp.gate_proj.weight").T) * (hn @ t(p + "mlp.up_proj.weight").T)
    x = x + m @ t(p + "mlp.down_proj.weight").T
    x = rms1p(x, t("mtp.norm.weight"))
    return x @ t("lm_head.weight").T


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    art = Artifact.open(build_tiny_artifact(tmp_path_factory.mktemp("mtp") / "d.ninfer", seed=11))
    return art, Qwen35Family().load(art)


def test_mtp_head_matches_direct_computation(dense):
    art, runner = dense
    assert runner.mtp is not None and art.components == ["text", "mtp"]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 500, (9,), generator=g).tolist()
    hidden = torch.randn(9, 64, generator=g)
    logits, _h, kv = runner.mtp_forward(tokens, hidden, start=17)
    ref = direct_mtp(art, tokens, hidden, start=17)
    assert logits.shape == ref.shape == (9, 512)
    err = float((logits - ref).abs().max() / ref.abs().max())
    print(f"PARITY mtp   direct computation             max rel err {err:.2e}")
    assert err <= 1e-5
    assert len(kv) == 1 and kv[0][0].shape == (9, 2, 32)


def test_mtp_past_kv_continues_exactly(dense):
    _, runner = dense
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 500, (8,), generator=g).tolist()
    hidden = torch.randn(8, 64, generator=g)
    full, _, _ = runner.mtp_forward(tokens, hidden, start=4)
    a, _, past = runner.mtp_forward(tokens[:5], hidden[:5], start=4)
    b, _, _ = runner.mtp_forward(tokens[5:], hidden[5:], start=9, past=past)
    assert torch.allclose(torch.cat([a, b]), full, atol=1e-5)


def test_moe_mtp_head_loads_and_runs(tmp_path):
    art = Artifact.open(build_tiny_artifact(tmp_path / "m.ninfer", kind="moe", seed=12))
    r = Qwen35Family().load(art)
    assert r.mtp.layers[0].mlp.experts.gate_up_proj.shape == (8, 64, 64)
    logits, _, _ = r.mtp_forward([1, 2, 3], torch.randn(3, 64), start=0)
    assert logits.shape == (3, 512) and torch.isfinite(logits).all()
