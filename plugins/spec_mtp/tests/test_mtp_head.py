"""The Qwen3.5 MTP draft head over the paged cache (the family's `DraftHead`, enabled by the
backend) against the plain-tensor reference head (`HybridRunner.mtp_forward`), on the reference
runner and on the GPU runner's CPU fallback path; ride-along K/V after prefill, decode and
verify + commit; the attention window; the proposal head."""

from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("ninfer_qwen35")

from ninfer_qwen35.family import Qwen35Family  # noqa: E402
from ninfer_qwen35.gpu.runner import GpuQwen35Runner  # noqa: E402
from ninfer_qwen35.testing import build_tiny_artifact  # noqa: E402

from ninfer_core.artifact import Artifact  # noqa: E402
from ninfer_core.engine.model_api import (  # noqa: E402
    DraftStep,
    ForwardBatch,
    LaneSegment,
    SeqView,
)
from ninfer_spec_mtp.backend import MtpBackend, SpecOptionError  # noqa: E402


@pytest.fixture(scope="module", params=["dense", "moe"])
def art(request, tmp_path_factory):
    return Artifact.open(build_tiny_artifact(tmp_path_factory.mktemp("mtp") / f"{request.param}.ninfer",
                                             kind=request.param, seed=21))


def runner(art, gpu=False):
    r = Qwen35Family().load(art)
    if gpu:
        r = GpuQwen35Runner.from_runner(r)
    r.enable_draft_head("mtp")
    r.allocate_cache(16, 3)
    return r


def tokens(n, seed=0):
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("gpu", [False, True])
def test_draft_step_at_the_frontier_equals_the_reference_head(art, gpu):
    """Prefill in chunks (ride-along K/V), decode two tokens (ride-along), then one draft step at
    the frontier: equal to the reference head run over the whole history with the target's hidden."""
    r = runner(art, gpu)
    ref = Qwen35Family().load(art)
    ref.allocate_cache(16, 1)
    t = tokens(90, 1)
    pages = [7, 3, 11]
    view = SeqView(1, pages, 0)
    for a, b in ((0, 40), (40, 88)):
        r.prefill(view, t[a:b])
        view.num_cached = b
    for p in (88, 89):
        r.decode([view], [t[p]])
        view.num_cached += 1
    hidden = ref.forward_hidden([SeqView(0, [0, 1, 2], 0)], [t])  # [90, H] target hidden of every position
    nxt = 42
    h = r.draft.step([DraftStep(slot=1, position=90, token=nxt, table=pages)])
    want_logits, want_h, _ = ref.mtp_forward(t[1:] + [nxt], hidden, start=1)
    err = float((h[0] - want_h[-1]).abs().max() / want_h[-1].abs().max())
    assert err < 1e-4, err
    got = r.logits(h)[0]
    assert int(got.argmax()) == int(want_logits[-1].argmax())
    # a second chained step feeds the head's own hidden: position 91 after [.., nxt]
    h2 = r.draft.step([DraftStep(slot=1, position=91, token=7, table=pages, prev_hidden=h[0])])
    want2, want2_h, _ = ref.mtp_forward(t[1:] + [nxt, 7], torch.cat([hidden, want_h[-1:]]), start=1)
    assert float((h2[0] - want2_h[-1]).abs().max() / want2_h[-1].abs().max()) < 1e-4


@pytest.mark.parametrize("gpu", [False, True])
def test_verify_then_commit_leaves_the_head_and_state_as_plain_decode(art, gpu):
    """A verify of 4 tokens committed at 2 leaves the target state, the slot's hidden and the head's
    K/V exactly as decoding those 2 tokens would: the next decode and the next draft agree."""
    t = tokens(70, 2)
    outs = []
    for mode in ("decode", "verify"):
        r = runner(art, gpu)
        view = SeqView(0, [2, 5], 0)
        r.prefill(view, t[:60])
        view.num_cached = 60
        if mode == "decode":
            for p in (60, 61):
                r.decode([view], [t[p]])
                view.num_cached += 1
        else:
            seg = LaneSegment(0, {g: view.pages for g in r.cache_spec().group_names}, 60, t[60:64], "verify", "all")
            out = r.forward(ForwardBatch([seg]))[0]
            assert out.logits.shape[0] == 4
            with pytest.raises(RuntimeError, match="uncommitted"):
                r.decode([view], [t[62]])
            r.commit([(0, 2)])
            view.num_cached = 62
        logits = r.decode([view], [t[62]])[0]
        view.num_cached += 1
        h = r.draft.step([DraftStep(slot=0, position=63, token=t[63], table=view.pages)])
        outs.append((logits, h))
    (la, ha), (lb, hb) = outs
    assert float((la - lb).abs().max() / la.abs().max()) < 1e-4
    assert float((ha - hb).abs().max() / ha.abs().max()) < 1e-4


def test_state_image_and_pages_carry_the_head(art):
    r = runner(art)
    spec = r.cache_spec()
    assert "mtp" in spec.group_names
    view = SeqView(0, [1], 0)
    r.prefill(view, tokens(20, 3))
    img = r.capture_state(0)
    assert "hidden" in img.tensors
    kv = r.read_pages([1])
    assert any(k.startswith("k.") and int(k[2:]) >= r.cfg.num_hidden_layers for k in kv)
    plain = Qwen35Family().load(art)
    plain.allocate_cache(16, 3)
    with pytest.raises(ValueError, match="speculative"):
        plain.restore_state(img, 0)
    with pytest.raises(ValueError, match="speculative"):
        plain.write_pages([2], kv)


def test_attention_window_rebinds_to_the_first_and_newest_pages(art):
    """A window covering the whole history drafts exactly as no window; a short one still runs and
    attends to page 0 plus the newest pages only."""
    t = tokens(300, 4)
    pages = [0, 1, 2, 3, 4]
    got = {}
    for window in (0, 400, 70):
        r = runner(art)
        view = SeqView(0, pages, 0)
        r.prefill(view, t)
        b = MtpBackend(r, r.draft, 3, None, window)
        from ninfer_core.engine.spec import DraftLane

        lane = DraftLane("x", 0, {g: pages for g in r.cache_spec().group_names}, 300, 9, 3)
        if window == 70:
            assert b._window_start(lane) == (300 - 70) // 64 == 3
            table, kv_len = b._tables(pages, 3, 300)
            assert table == [0, 3, 4] and kv_len == 64 + (300 - 192 + 1)
        got[window] = b.propose([lane])[0].tokens
    assert got[400] == got[0]
    assert len(got[70]) == 3


def test_backend_refuses_bad_options(art):
    r = Qwen35Family().load(art)
    ns = argparse.Namespace(draft_tokens=3, mtp_attention_window=2, lm_head_draft=False, full_draft_head=False,
                            adaptive_mtp=False)
    with pytest.raises(SpecOptionError, match="at least --draft-tokens"):
        MtpBackend.load(r, art, ns)
    ns.mtp_attention_window = 0
    ns.lm_head_draft = True
    with pytest.raises(SpecOptionError, match="proposal head"):
        MtpBackend.load(r, art, ns)


def test_an_artifact_without_a_head_is_refused(tmp_path):
    art = Artifact.open(build_tiny_artifact(tmp_path / "n.ninfer", mtp=False))
    r = Qwen35Family().load(art)
    assert r.draft_heads() == ()
    with pytest.raises(SpecOptionError, match="MTP head"):
        MtpBackend.load(r, art, argparse.Namespace(draft_tokens=2))


def test_proposal_head_drafts_only_its_rows_and_full_draft_head_ignores_it(art, tmp_path):
    from ninfer_core.artifact.convert import convert_artifact
    from ninfer_core.artifact.proposal import TOKEN_IDS

    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog " * 40)
    out = tmp_path / "p.ninfer"
    convert_artifact(art.path, str(out), proposal_head=40, corpus=str(corpus))
    part = Artifact.open(str(out))
    rows = set(part.get_tensor(TOKEN_IDS).tolist())
    for flags, head in (({}, "proposal"), ({"lm_head_draft": True}, "proposal"), ({"full_draft_head": True}, "full")):
        r = Qwen35Family().load(part)
        b = MtpBackend.load(r, part, argparse.Namespace(draft_tokens=3, **flags))
        assert b.describe()["draft_head"] == head
        r.allocate_cache(16, 2)
        view = SeqView(0, [1, 2], 0)
        r.prefill(view, tokens(70, 5))
        from ninfer_core.engine.spec import DraftLane

        drafts = b.propose([DraftLane("x", 0, {g: view.pages for g in r.cache_spec().group_names}, 70, 3, 3)])
        assert len(drafts[0].tokens) == 3
        if head == "proposal":
            assert set(drafts[0].tokens) <= rows


@pytest.mark.parametrize("window", [0, 70])
def test_the_gpu_heads_chain_drafts_what_the_reference_head_drafts(art, window):
    """The backend's K-step chain through the GPU runner's head (one batched chain; a CUDA Graph on
    the device) equals the chain of the reference head stepping one position at a time."""
    from ninfer_core.engine.spec import DraftLane

    t = tokens(300, 6)
    got = []
    for gpu in (False, True):
        r = runner(art, gpu)
        lanes = []
        for slot, n, pages in ((0, 300, [0, 1, 2, 3, 4]), (2, 131, [9, 10, 11])):
            view = SeqView(slot, pages, 0)
            r.prefill(view, t[:n])
            lanes.append(DraftLane(f"l{slot}", slot, {g: pages for g in r.cache_spec().group_names}, n, 5, 4))
        b = MtpBackend(r, r.draft, 4, None, window)
        got.append([p.tokens for p in b.propose(lanes)])
    assert got[0] == got[1] and all(len(x) == 4 for x in got[0])
