"""fp32 parity with transformers' Gemma 4 on random weights: a full prefill, chunks of 7 that cross
the sliding window, token-by-token decode past the window, a batch of 3 lanes, a verify of k+1.

Each test runs twice: with a sliding-window ring larger than the test's 40 tokens, and with one
sized for forwards of at most 7 new tokens (window 8 + 7 - 1 -> 4 pages of 4), so the ring wraps
several times and longer segments run split."""

import pytest
import torch
from ninfer_gemma4.family import Gemma4Family
from ninfer_gemma4.testing import hf_model

from ninfer_core.artifact import Artifact
from ninfer_core.engine.model_api import (
    DECODE,
    LOGITS_ALL,
    VERIFY,
    ForwardBatch,
    LaneSegment,
    RunnerOptions,
    SeqView,
)

TOL = 1e-4
PS = 4  # small pages, so a window of 8 spans several


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module", params=["e2b", "26b-a4b"])
def pair(request, gemma_artifacts):
    art = Artifact.open(gemma_artifacts[request.param])
    runner = Gemma4Family().load(art)
    seed = {"e2b": 1, "26b-a4b": 2}[request.param]
    ref = hf_model(art.config, seed=seed)
    return request.param, runner, ref


def reference(ref, ids):
    with torch.no_grad():
        return ref(input_ids=torch.tensor([ids])).logits[0].float()


@pytest.fixture(params=[256, 7], ids=["ring-256", "ring-7"])
def seg(request):
    return request.param


def fresh(runner, seg=256, lanes=4, pages=48):
    runner.free_cache()
    runner.configure(RunnerOptions(max_segment_tokens=seg))
    runner.allocate_cache(pages, lanes, page_size=PS)


def table(lane, n=12):
    return list(range(lane * n, lane * n + n))


IDS = [int(x) for x in torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(7))]


def test_config_has_the_real_structure(pair):
    kind, runner, _ = pair
    cfg = runner.cfg
    assert {"sliding_attention", "full_attention"} == set(cfg.layer_types)
    if kind == "e2b":
        assert cfg.num_kv_shared_layers > 0 and cfg.hidden_size_per_layer_input > 0 and cfg.use_double_wide_mlp
        assert any(cfg.shares_kv(i) for i in range(cfg.num_hidden_layers))
    else:
        assert cfg.enable_moe_block and cfg.attention_k_eq_v
        assert cfg.num_global_key_value_heads != cfg.num_key_value_heads
    assert cfg.global_head_dim != cfg.head_dim and cfg.final_logit_softcapping


def test_full_prefill(pair, seg):
    _, runner, ref = pair
    fresh(runner, seg)
    out = runner.prefill(SeqView(0, table(0), 0), IDS, all_logits=True)
    assert rel_err(out, reference(ref, IDS)) <= TOL


def test_chunks_of_7_cross_the_window(pair, seg):
    _, runner, ref = pair
    fresh(runner, seg)
    assert runner.cfg.sliding_window < len(IDS)
    outs = [runner.prefill(SeqView(1, table(1), s), IDS[s:s + 7], all_logits=True) for s in range(0, len(IDS), 7)]
    assert rel_err(torch.cat(outs), reference(ref, IDS)) <= TOL


def test_decode_token_by_token_past_the_window(pair, seg):
    _, runner, ref = pair
    fresh(runner, seg)
    runner.prefill(SeqView(0, table(0), 0), IDS[:3])
    want = reference(ref, IDS)
    got = [runner.decode([SeqView(0, table(0), p)], [IDS[p]])[0] for p in range(3, len(IDS))]
    assert rel_err(torch.stack(got), want[3:]) <= TOL


def test_batch_of_3_lanes(pair, seg):
    _, runner, ref = pair
    fresh(runner, seg)
    prompts = [IDS[:17], IDS[5:30], IDS[11:20]]
    segs = [LaneSegment(i, {g: table(i) for g in runner.cache_spec().group_names}, 0, p, logits=LOGITS_ALL)
            for i, p in enumerate(prompts)]
    outs = runner.forward(ForwardBatch(segs))
    for p, o in zip(prompts, outs):
        assert rel_err(o.logits, reference(ref, p)) <= TOL
    # then one batched decode step of the three lanes
    nxt = [IDS[30], IDS[31], IDS[32]]
    dec = runner.forward(ForwardBatch([LaneSegment(i, {g: table(i) for g in runner.cache_spec().group_names},
                                                   len(p), [t], DECODE) for i, (p, t) in enumerate(zip(prompts, nxt))]))
    for p, t, o in zip(prompts, nxt, dec):
        assert rel_err(o.logits, reference(ref, p + [t])[-1]) <= TOL


def test_verify_then_commit_a_prefix(pair, seg):
    _, runner, ref = pair
    fresh(runner, seg)
    groups = runner.cache_spec().group_names
    runner.prefill(SeqView(2, table(2), 0), IDS[:20])
    draft = IDS[20:25]
    out = runner.forward(ForwardBatch([LaneSegment(2, {g: table(2) for g in groups}, 20, draft, VERIFY, LOGITS_ALL)]))
    assert rel_err(out[0].logits, reference(ref, IDS[:25])[20:]) <= TOL
    with pytest.raises(RuntimeError):  # the verify must be committed first
        runner.decode([SeqView(2, table(2), 25)], [IDS[25]])
    runner.commit([(2, 2)])
    # the lane continues after the 2 accepted tokens: rows past them are overwritten
    nxt = runner.decode([SeqView(2, table(2), 22)], [IDS[30]])[0]
    assert rel_err(nxt, reference(ref, IDS[:22] + [IDS[30]])[-1]) <= TOL


def test_cache_spec_counts_real_bytes(pair, seg):
    """The pool holds the global layers only; the sliding layers' ring is state: window + chunk."""
    _, runner, _ = pair
    fresh(runner, seg)
    cfg, spec = runner.cfg, runner.cache_spec()
    (group,) = spec.kv_groups
    assert group.name == "global" and group.window is None and group.head_dim == cfg.global_head_dim
    glob = [i for i in cfg.kv_layers("full_attention")]
    assert set(group.layers) == set(glob)
    assert spec.kv_bytes_per_token == sum(2 * cfg.layer_kv_heads(i) * cfg.layer_head_dim(i) * 4 for i in glob)
    ring_tokens = -(-(seg + cfg.sliding_window - 1) // PS) * PS
    assert runner.ring_tokens == ring_tokens and ring_tokens < seg + cfg.sliding_window + PS
    sliding = [i for i in range(cfg.num_hidden_layers) if not cfg.shares_kv(i) and cfg.is_sliding(i)]
    assert spec.state_bytes == ring_tokens * sum(2 * cfg.layer_kv_heads(i) * cfg.layer_head_dim(i) * 4 for i in sliding)
    # the tensors allocated are exactly those bytes: pool pages for global, 4 ring slots for sliding
    held = sum(t.numel() * t.element_size() for kv in runner.kv.values() for t in kv)
    assert held == 48 * PS * spec.kv_bytes_per_token + 4 * spec.state_bytes
    # a model suspend copies the pool's live pages only: the page tensors are the global layers'
    pages = runner.kv_page_tensors()
    assert len(pages) == 2 * len(glob) and all(t.shape[0] == 48 for t in pages)


def test_ring_capture_restore_and_snapshot_resume_equal_recompute(pair):
    """A lane resumed from a captured ring (another slot, the pool pages copied) and one resumed
    from a snapshot inside a chunk continue exactly as the uninterrupted lane, past the window."""
    _, runner, ref = pair
    fresh(runner, 7)
    want = reference(ref, IDS)
    groups = runner.cache_spec().group_names
    # lane 0: 20 tokens in chunks of 7, snapshot after 13 into slot 2 (inside the second chunk)
    segs = [LaneSegment(0, {g: table(0) for g in groups}, 0, IDS[:7]),
            LaneSegment(0, {g: table(0) for g in groups}, 7, IDS[7:14], snapshot=(6, 2)),
            LaneSegment(0, {g: table(0) for g in groups}, 14, IDS[14:20])]
    for s in segs:
        runner.forward(ForwardBatch([s]))
    image = runner.capture_state(0)
    assert image.nbytes == runner.cache_spec().state_bytes
    runner.restore_state(image, 1)
    for i in range(5):  # lane 1's pool pages: a copy of lane 0's
        runner.copy_page(table(0)[i], table(1)[i])
    a = torch.stack([runner.decode([SeqView(1, table(1), p)], [IDS[p]])[0] for p in range(20, 30)])
    assert rel_err(a, want[20:30]) <= TOL
    for i in range(4):  # the snapshot slot resumes at 13 over lane 0's first pages (shared, read only up to 13)
        runner.copy_page(table(0)[i], table(2)[i])
    b = torch.cat([runner.forward(ForwardBatch([LaneSegment(2, {g: table(2) for g in groups}, s, IDS[s:s + 7],
                                                            logits=LOGITS_ALL)]))[0].logits for s in range(13, 34, 7)])
    assert rel_err(b, want[13:34]) <= TOL
    with pytest.raises(ValueError, match="ring"):
        fresh(runner, 20)  # another ring size (7 pages, not 4): an image of the 4-page ring does not fit
        runner.restore_state(image, 0)


def test_core_parity_helper(pair, gemma_artifacts):
    """ninfer_core.contract.parity (the helper a third-party family uses) on a fresh runner: one
    prefill, chunks of 7 across the window and token-by-token decode against transformers."""
    from ninfer_core.contract.parity import transformers_parity

    kind, _, ref = pair
    runner = Gemma4Family().load(Artifact.open(gemma_artifacts[kind]))
    errs = transformers_parity(runner, ref, IDS[:30], page_size=PS, label=kind)
    assert len(errs) == 3
