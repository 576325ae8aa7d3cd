"""The drafter's batched, cached forward against a direct torch computation of the same function
(per head, per position, explicit softmax, explicit conv taps and selector walk); the published
checkpoint layout through `ninfer convert --dflash/--dflash2`; options and artifacts refused with
errors that name the fix."""

from __future__ import annotations

import argparse
import math
import types

import pytest
import torch
from ninfer_spec_dflash.backend import DFlash2Backend, DFlashBackend, SpecOptionError
from ninfer_spec_dflash.config import DrafterConfig, DrafterConfigError
from ninfer_spec_dflash.model import Drafter
from ninfer_spec_dflash.testing import drafter_hf_config, random_tensors

from ninfer_core.engine.spec import DraftLane

H, V = 32, 96


class FakeRunner:
    """The two contract calls a drafter uses: the target's embeddings and LM head (random here)."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.E = torch.randn(V, H, generator=g)
        self.W = torch.randn(V, H, generator=g) / math.sqrt(H)
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.info = types.SimpleNamespace(vocab_size=V, hidden_size=H, extra={"layer_types": ["x"] * 6})

    def embed(self, ids):
        return self.E[torch.as_tensor(ids)]

    def logits(self, h):
        return h.float() @ self.W.T


def make(kind, layers=2, seed=0, **kw):
    cfg_json = drafter_hf_config(kind, H, V, [1, 4], layers=layers, heads=4, kv_heads=2, head_dim=8,
                                 intermediate=48, block_size=8, conv_group_size=8, selector_rank=6,
                                 selector_top_k=5, **kw)
    cfg = DrafterConfig.from_hf(cfg_json, kind)
    model = Drafter(cfg, V)
    model.load_state_dict(random_tensors(cfg, V, seed, scale=0.3))
    return cfg, model.eval()


# -- the direct computation ----------------------------------------------------------------------
def rms(x, w, eps=1e-6):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def rot(x, p, theta):  # x [hd] at position p
    hd = x.shape[0]
    out = torch.empty_like(x)
    for i in range(hd // 2):
        a = p / theta ** (2 * i / hd)
        c, s = math.cos(a), math.sin(a)
        out[i] = x[i] * c - x[i + hd // 2] * s
        out[i + hd // 2] = x[i + hd // 2] * c + x[i] * s
    return out


def direct_block(sd, cfg, feats, tokens_ctx_valid, token, p, k, runner):
    """The block's final-normed hidden [k+1, H] for one lane: context feats [p, L*H] (rows with
    valid False left out), block [token, mask x k] at positions p..p+k."""
    hd, nh, kvh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    ctx = rms(feats @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    x = runner.embed([token] + [cfg.mask_token_id] * k).float()
    s = k + 1

    def conv(h, dyn, base):  # h [S, H], dyn [S, K, G], base [K, H]
        out = torch.zeros_like(h)
        for t in range(s):
            for o in range(cfg.conv_kernel_size):
                if t - o < 0:
                    continue
                for c in range(H):
                    out[t, c] += (base[o, c] + dyn[t, o, c // cfg.conv_group_size]) * h[t - o, c]
        return out

    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        a = sd.get
        h = rms(x, a(pre + "input_layernorm.weight"))
        if cfg.kind == "dflash2":
            dyn = (h @ a(pre + "attention_conv.kernel_projection.weight").T).view(s, 2, cfg.conv_kernel_size, -1)
            h = conv(h, dyn[:, 0], a(pre + "attention_conv.base_kernel")[0])
        keys, vals = [], []
        for src, rows, pos0 in ((ctx, range(p), 0), (h, range(s), p)):
            for r in rows:
                if src is ctx and not tokens_ctx_valid[r]:
                    continue
                kk = (src[r] @ a(pre + "self_attn.k_proj.weight").T).view(kvh, hd)
                vv = (src[r] @ a(pre + "self_attn.v_proj.weight").T).view(kvh, hd)
                kk = torch.stack([rot(rms(kk[j], a(pre + "self_attn.k_norm.weight")), pos0 + r, cfg.rope_theta)
                                  for j in range(kvh)])
                keys.append(kk)
                vals.append(vv)
        keys, vals = torch.stack(keys), torch.stack(vals)  # [N, kvh, hd]
        att = torch.zeros(s, nh * hd)
        for t in range(s):
            q = (h[t] @ a(pre + "self_attn.q_proj.weight").T).view(nh, hd)
            for j in range(nh):
                qj = rot(rms(q[j], a(pre + "self_attn.q_norm.weight")), p + t, cfg.rope_theta)
                g = j // (nh // kvh)
                w = torch.softmax(keys[:, g] @ qj / math.sqrt(hd), 0)
                att[t, j * hd:(j + 1) * hd] = w @ vals[:, g]
        o = att @ a(pre + "self_attn.o_proj.weight").T
        if cfg.kind == "dflash2":
            o = conv(o, dyn[:, 1], a(pre + "attention_conv.base_kernel")[1])
        x = x + o
        h = rms(x, a(pre + "post_attention_layernorm.weight"))
        if cfg.kind == "dflash2":
            dyn = (h @ a(pre + "mlp_conv.kernel_projection.weight").T).view(s, 2, cfg.conv_kernel_size, -1)
            h = conv(h, dyn[:, 0], a(pre + "mlp_conv.base_kernel")[0])
        m = (torch.nn.functional.silu(h @ a(pre + "mlp.gate_proj.weight").T) * (h @ a(pre + "mlp.up_proj.weight").T)
             ) @ a(pre + "mlp.down_proj.weight").T
        if cfg.kind == "dflash2":
            m = conv(m, dyn[:, 1], a(pre + "mlp_conv.base_kernel")[1])
        x = x + m
    return rms(x, sd["norm.weight"])


def direct_walk(sd, cfg, hidden, logits, anchor):
    prev, out = anchor, []
    proj = hidden @ sd["candidate_selector.hidden_projection.weight"].T
    pred, succ = sd["candidate_selector.predecessor_codebook"], sd["candidate_selector.successor_codebook"]
    for t in range(hidden.shape[0]):
        cand = torch.topk(logits[t], cfg.selector_top_k).indices
        best = max(cand.tolist(), key=lambda b: float(logits[t, b] + (pred[prev] * proj[t] * succ[b]).sum()))
        out.append(best)
        prev = best
    return out


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_block_forward_equals_the_direct_computation(kind):
    cfg, model = make(kind)
    runner = FakeRunner()
    cls = DFlash2Backend if kind == "dflash2" else DFlashBackend
    backend = cls(runner, model, draft_tokens=5)
    g = torch.Generator().manual_seed(3)
    n_layers = len(cfg.target_layer_ids)
    lanes, feats_of = [], {}
    for rid, p in (("a", 11), ("b", 4)):  # two lanes of different lengths batched (padded context)
        feats = torch.randn(p, n_layers * H, generator=g)
        # the context arrives in two pieces, the way a prefill chunk and a round deliver it
        cut = p // 2
        for lo, hi in ((0, cut), (cut, p)):
            backend.observe_target(rid, lo, {t: feats[lo:hi, j * H:(j + 1) * H]
                                             for j, t in enumerate(cfg.target_layer_ids)})
        feats_of[rid] = feats
        lanes.append(DraftLane(rid, 0, {}, p, int(torch.randint(0, V, (1,), generator=g)), 5))
    hidden = backend.hidden_block(lanes, 5)
    sd = {k: v.float() for k, v in model.state_dict().items()}
    for b, lane in enumerate(lanes):
        want = direct_block(sd, cfg, feats_of[lane.request_id], [True] * lane.position, lane.token,
                            lane.position, 5, runner)
        torch.testing.assert_close(hidden[b], want, atol=2e-4, rtol=2e-4)
    drafts = [p.tokens for p in backend.propose(lanes)]
    for b, lane in enumerate(lanes):
        rows = hidden[b, 1:]
        logits = runner.logits(rows)
        want = logits.argmax(-1).tolist() if kind == "dflash" else direct_walk(sd, cfg, rows, logits, lane.token)
        assert drafts[b] == want


def test_positions_never_seen_are_left_out_of_the_context():
    """A lane admitted with a reused prefix sees its first rows only from position 6 on."""
    cfg, model = make("dflash")
    runner = FakeRunner()
    backend = DFlashBackend(runner, model, draft_tokens=3)
    feats = torch.randn(10, 2 * H, generator=torch.Generator().manual_seed(1))
    backend.observe_target("r", 6, {t: feats[6:, j * H:(j + 1) * H] for j, t in enumerate(cfg.target_layer_ids)})
    lane = DraftLane("r", 0, {}, 10, 5, 3)
    got = backend.hidden_block([lane], 3)[0]
    sd = {k: v.float() for k, v in model.state_dict().items()}
    want = direct_block(sd, cfg, feats, [False] * 6 + [True] * 4, 5, 10, 3, runner)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    backend.lane_finished("r")
    assert backend.context_rows("r") is None


def test_sliding_window_layers_see_only_the_window():
    cfg, model = make("dflash", layers=1)
    c2 = DrafterConfig.from_hf({**drafter_hf_config("dflash", H, V, [1, 4], layers=1, heads=4, kv_heads=2,
                                                    head_dim=8, intermediate=48, block_size=8),
                                "layer_types": ["sliding_attention"], "sliding_window": 4}, "dflash")
    assert c2.window(0) == 4
    m2 = Drafter(c2, V)
    m2.load_state_dict(model.state_dict())
    runner = FakeRunner()
    lane = DraftLane("r", 0, {}, 9, 5, 2)
    feats = torch.randn(9, 2 * H, generator=torch.Generator().manual_seed(2))
    outs = []
    for m in (m2, model):
        b = DFlashBackend(runner, m, draft_tokens=2)
        b.observe_target("r", 0, {t: feats[:, j * H:(j + 1) * H] for j, t in enumerate(c2.target_layer_ids)})
        outs.append(b.hidden_block([lane], 2)[0])
    # the windowed block's first row sees keys 6..8 of the context (positions > 9 - 4) and its block
    sd = {k: v.float() for k, v in model.state_dict().items()}
    full = direct_block(sd, cfg, feats, [True] * 9, 5, 9, 2, runner)
    torch.testing.assert_close(outs[1], full, atol=2e-4, rtol=2e-4)
    assert not torch.allclose(outs[0], outs[1], atol=1e-3)


def test_config_errors_name_the_key():
    good = drafter_hf_config("dflash2", H, V, [1], layers=1, heads=4, kv_heads=2)
    for bad, key in ((dict(good, hidden_size=0), "hidden_size"),
                     (dict(good, dflash_config={"target_layer_ids": [1]}), "mask_token_id"),
                     (dict(good, dflash_config={"mask_token_id": 3, "target_layer_ids": [1]}), "conv_kernel_size"),
                     (dict(good, block_size=1), "block_size")):
        with pytest.raises(DrafterConfigError, match=key):
            DrafterConfig.from_hf(bad, "dflash2")
    # no target_layer_ids: the reference rule over num_target_layers
    plain = dict(good, dflash_config={"mask_token_id": 3}, num_hidden_layers=3, num_target_layers=64)
    assert DrafterConfig.from_hf(plain, "dflash").target_layer_ids == (1, 31, 61)


def test_mtp_options_are_refused():
    with pytest.raises(SpecOptionError, match="--adaptive-mtp is an MTP option"):
        DFlashBackend.check_options(argparse.Namespace(adaptive_mtp=True))
    with pytest.raises(SpecOptionError, match="contradict"):
        DFlash2Backend.check_options(argparse.Namespace(lm_head_draft=True, full_draft_head=True))


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_graph_buckets_run_the_eager_pass(kind):
    """The graph path's logic on the CPU: lanes padded to a bucket on static buffers (scratch-row
    padding lanes) draft what the eager pass drafts; one entry per (lanes, width, K); a lane past
    the width bucket takes the next; the store growing drops every entry."""
    from ninfer_spec_dflash.graphs import lane_bucket, width_bucket

    cfg, model = make(kind)
    runner = FakeRunner()
    backend = (DFlash2Backend if kind == "dflash2" else DFlashBackend)(runner, model, draft_tokens=5)
    g = torch.Generator().manual_seed(7)
    n_layers = len(cfg.target_layer_ids)
    lanes = []
    for i, p in enumerate((11, 4, 30)):
        feats = torch.randn(p, n_layers * H, generator=g)
        backend.observe_target(f"r{i}", 0, {t: feats[:, j * H:(j + 1) * H] for j, t in enumerate(cfg.target_layer_ids)})
        lanes.append(DraftLane(f"r{i}", 0, {}, p, int(torch.randint(0, V, (1,), generator=g)), 5))
    assert (lane_bucket(3), lane_bucket(8), lane_bucket(9)) == (4, 8, None)
    assert (width_bucket(30), width_bucket(64), width_bucket(65)) == (64, 64, 128)

    def both(ls):
        rows, tokens, bases, width = backend._lanes(ls)
        static = backend.graphs.run(rows, tokens, bases, width, 5, static=True)
        eager = backend.graphs.run(rows, tokens, bases, width, 5, static=False)
        return static, eager, width

    static, eager, _ = both(lanes)
    assert static.shape == (3, 5) and torch.equal(static, eager)
    hidden = backend.hidden_block(lanes, 5)
    want = backend._pick(hidden, torch.tensor([lane.token for lane in lanes]))
    assert torch.equal(static, want)
    assert set(backend.graphs.graphs) == {(4, 64, 5)}
    static2, eager2, _ = both(lanes[:2])  # a second bucket; the first one is reused below
    assert torch.equal(static2, eager2) and torch.equal(static2, static[:2])
    both(lanes)
    assert set(backend.graphs.graphs) == {(4, 64, 5), (2, 64, 5)} and backend.graphs.captures == 2
    far = DraftLane("r0", 0, {}, 70, 3, 5)  # a position past 64: the next width bucket
    static3, eager3, width3 = both([far])
    assert width3 == 128 and torch.equal(static3, eager3) and (1, 128, 5) in backend.graphs.graphs
    gen = backend.store.generation
    for i in range(3, 3 + backend.store.rows):  # more requests than rows: the store re-allocates
        backend.observe_target(f"r{i}", 0, {t: torch.zeros(1, H) for t in cfg.target_layer_ids})
    backend.store.flush()
    assert backend.store.generation > gen
    static4, eager4, _ = both(lanes)
    assert torch.equal(static4, eager4) and torch.equal(static4, static) and set(backend.graphs.graphs) == {(4, 64, 5)}  # the old entries went
    assert [p.tokens for p in backend.propose(lanes)] == static.tolist()


def test_padding_lanes_and_released_rows_read_no_context():
    """A request without context (its row released, or never observed) drafts from the scratch row:
    the same drafts as a lane whose every context row is masked out."""
    cfg, model = make("dflash")
    runner = FakeRunner()
    backend = DFlashBackend(runner, model, draft_tokens=3)
    feats = torch.randn(8, 2 * H, generator=torch.Generator().manual_seed(4))
    backend.observe_target("a", 0, {t: feats[:, j * H:(j + 1) * H] for j, t in enumerate(cfg.target_layer_ids)})
    lane = DraftLane("a", 0, {}, 8, 5, 3)
    with_ctx = backend.hidden_block([lane], 3)
    backend.lane_finished("a")
    without = backend.hidden_block([lane], 3)
    sd = {k: v.float() for k, v in model.state_dict().items()}
    torch.testing.assert_close(without[0], direct_block(sd, cfg, feats, [False] * 8, 5, 8, 3, runner),
                               atol=2e-4, rtol=2e-4)
    assert not torch.allclose(with_ctx, without, atol=1e-4)
    # the released row is handed to the next request with its valid flags cleared
    backend.observe_target("b", 6, {t: feats[6:, j * H:(j + 1) * H] for j, t in enumerate(cfg.target_layer_ids)})
    rows = backend.context_rows("b")
    assert rows["n"] == 8 and rows["valid"].tolist() == [False] * 6 + [True] * 2
