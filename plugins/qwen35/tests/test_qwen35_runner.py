"""ModelRunner contract: cache geometry, slots, validation, varlen forward."""

import pytest
import torch
from ninfer_qwen35.family import Qwen35Family
from ninfer_qwen35.testing import build_tiny_artifact

from ninfer_core.artifact import Artifact
from ninfer_core.engine.model_api import CacheSpec, ModelRunner, SeqView


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    art = Artifact.open(build_tiny_artifact(tmp_path_factory.mktemp("run") / "d.ninfer", seed=21))
    r = Qwen35Family().load(art)
    r.allocate_cache(num_pages=12, num_slots=4)
    return r


def fresh(runner, slot):
    runner.reset_slot(slot)


def test_cache_spec_and_info(runner):
    assert isinstance(runner, ModelRunner)
    spec = runner.cache_spec()
    assert isinstance(spec, CacheSpec)
    (grp,) = spec.kv_groups
    assert grp.layers == (3,) and grp.kv_heads == 2 and grp.head_dim == 32
    assert grp.bytes_per_token == 2 * 1 * 2 * 32 * 4  # K+V, one layer, fp32
    conv = (2 * 32 + 64) * 3 * 4
    ssm = 4 * 16 * 16 * 4
    assert spec.state_layers == (0, 1, 2) and spec.state_bytes == 3 * (conv + ssm)
    assert runner.cache.kv[3][0].shape == (12, 64, 2, 32)
    assert runner.cache.ssm[0].shape == (4, 4, 16, 16) and runner.cache.ssm[0].dtype == torch.float32
    info = runner.info
    assert (info.vocab_size, info.hidden_size, info.architecture) == (512, 64, "qwen3_5")
    assert info.eos_token_ids == (258, 256)  # <|im_end|>, <|endoftext|> of the small tokenizer


def test_reset_slot_restarts_a_sequence(runner):
    toks = [5, 6, 7, 8, 9]
    fresh(runner, 0)
    a = runner.prefill(SeqView(0, [0], 0), toks)
    runner.prefill(SeqView(0, [0], 5), [1, 2, 3])  # dirty the state
    fresh(runner, 0)
    b = runner.prefill(SeqView(0, [0], 0), toks)
    assert torch.equal(a, b)


def test_copy_slot_forks_state(runner):
    prefix, cont = [11, 12, 13, 14, 15, 16], [40, 41, 42]
    fresh(runner, 1)
    runner.prefill(SeqView(1, [1], 0), prefix)
    runner.copy_slot(1, 2)
    # the fork shares the prefix's KV page: copy it to the fork's own page first
    for k, v in runner.cache.kv.values():
        k[2].copy_(k[1])
        v[2].copy_(v[1])
    a = runner.prefill(SeqView(1, [1], len(prefix)), cont, all_logits=True)
    b = runner.prefill(SeqView(2, [2], len(prefix)), cont, all_logits=True)
    assert torch.equal(a, b)


def test_varlen_forward_matches_separate_prefills(runner):
    fresh(runner, 0)
    fresh(runner, 1)
    s0, s1 = SeqView(0, [3, 4], 0), SeqView(1, [5], 0)
    runner.prefill(s0, list(range(100, 170)))
    runner.prefill(s1, [1, 2])
    s0.num_cached, s1.num_cached = 70, 2
    hid = runner.forward_hidden([s0, s1], [[7, 8, 9], [10, 11, 12, 13]])
    got = runner.logits(hid)
    fresh(runner, 2)
    fresh(runner, 3)
    r0, r1 = SeqView(2, [6, 7], 0), SeqView(3, [8], 0)
    runner.prefill(r0, list(range(100, 170)))
    runner.prefill(r1, [1, 2])
    r0.num_cached, r1.num_cached = 70, 2
    ref = torch.cat(
        [
            runner.prefill(r0, [7, 8, 9], all_logits=True),
            runner.prefill(r1, [10, 11, 12, 13], all_logits=True),
        ]
    )
    assert got.shape == (7, 512)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)


def test_bad_calls_are_refused(runner):
    with pytest.raises(ValueError, match="pages"):
        runner.prefill(SeqView(0, [0], 60), list(range(10)))  # 70 positions need 2 pages
    with pytest.raises(ValueError, match="slot"):
        runner.prefill(SeqView(9, [0], 0), [1])
    with pytest.raises(ValueError, match="outside the pool"):
        runner.prefill(SeqView(0, [99], 0), [1])
    with pytest.raises(ValueError, match="vocabulary"):
        runner.prefill(SeqView(0, [0], 0), [512])
    with pytest.raises(ValueError, match="at least one"):
        runner.prefill(SeqView(0, [0], 0), [])
    with pytest.raises(ValueError, match="one token per sequence"):
        runner.decode([SeqView(0, [0], 1)], [1, 2])
    with pytest.raises(ValueError, match="same state slot"):
        runner.decode([SeqView(0, [0], 1), SeqView(0, [1], 1)], [1, 2])


def test_forward_before_allocate_is_refused(tmp_path):
    r = Qwen35Family().load(Artifact.open(build_tiny_artifact(tmp_path / "d.ninfer")))
    with pytest.raises(RuntimeError, match="allocate_cache"):
        r.prefill(SeqView(0, [0], 0), [1])
