"""fp32 parity with transformers' Gemma 4 on random weights: a full prefill, chunks of 7 that cross
the sliding window, token-by-token decode past the window, a batch of 3 lanes, a verify of k+1."""

import pytest
import torch
from ninfer_gemma4.family import Gemma4Family
from ninfer_gemma4.testing import hf_model

from ninfer_core.artifact import Artifact
from ninfer_core.engine.model_api import DECODE, LOGITS_ALL, VERIFY, ForwardBatch, LaneSegment, SeqView

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


def fresh(runner, lanes=4, pages=48):
    runner.free_cache()
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


def test_full_prefill(pair):
    _, runner, ref = pair
    fresh(runner)
    out = runner.prefill(SeqView(0, table(0), 0), IDS, all_logits=True)
    assert rel_err(out, reference(ref, IDS)) <= TOL


def test_chunks_of_7_cross_the_window(pair):
    _, runner, ref = pair
    fresh(runner)
    assert runner.cfg.sliding_window < len(IDS)
    outs = [runner.prefill(SeqView(1, table(1), s), IDS[s:s + 7], all_logits=True) for s in range(0, len(IDS), 7)]
    assert rel_err(torch.cat(outs), reference(ref, IDS)) <= TOL


def test_decode_token_by_token_past_the_window(pair):
    _, runner, ref = pair
    fresh(runner)
    runner.prefill(SeqView(0, table(0), 0), IDS[:3])
    want = reference(ref, IDS)
    got = [runner.decode([SeqView(0, table(0), p)], [IDS[p]])[0] for p in range(3, len(IDS))]
    assert rel_err(torch.stack(got), want[3:]) <= TOL


def test_batch_of_3_lanes(pair):
    _, runner, ref = pair
    fresh(runner)
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


def test_verify_then_commit_a_prefix(pair):
    _, runner, ref = pair
    fresh(runner)
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


def test_cache_spec_counts_real_bytes(pair):
    _, runner, _ = pair
    cfg, spec = runner.cfg, runner.cache_spec()
    by_name = {g.name: g for g in spec.kv_groups}
    assert by_name["sliding"].window == cfg.sliding_window and by_name["global"].window is None
    assert by_name["global"].head_dim == cfg.global_head_dim
    owners = [i for i in range(cfg.num_hidden_layers) if not cfg.shares_kv(i)]
    want = sum(2 * cfg.layer_kv_heads(i) * cfg.layer_head_dim(i) * 4 for i in owners)
    assert spec.kv_bytes_per_token == want and spec.state_bytes == 0
    assert set(by_name["sliding"].layers) | set(by_name["global"].layers) == set(owners)
