"""Pipeline stages without processes: the --devices / --stage-layers checks, the default split,
the micro-batch cuts of a forward and how their outputs join (ninfer_core.engine.pipeline)."""

from __future__ import annotations

import argparse

import pytest
import torch

from ninfer_core.config import pipeline_options_from_args
from ninfer_core.engine.model_api import (
    DECODE,
    FINAL_HIDDEN,
    LOGITS_ALL,
    LOGITS_LAST,
    LOGITS_NONE,
    PREFILL,
    CacheSpec,
    ForwardBatch,
    KVGroup,
    LaneSegment,
    SegmentOutput,
)
from ninfer_core.engine.pipeline import microbatch
from ninfer_core.engine.pipeline.runner import merge_cache_specs
from ninfer_core.engine.pipeline.split import StageSplitError, parse_devices, parse_stage_layers, plan_stages


@pytest.mark.parametrize("text, message", [
    ("cpu", "lists 1 device; a pipeline has 2 to 8 stages"),
    (",".join(["cpu"] * 9), "lists 9 devices; a pipeline has 2 to 8 stages"),
    ("cpu,gpu0", "'gpu0' is not a device"),
    ("cpu,,cpu", "an empty device name"),
    ("cpu,cuda:1", "mixes the CPU and CUDA devices"),
    ("cuda:0,cuda:1,cuda:0", "lists cuda:0 twice"),
    ("cuda,cuda:0", "lists cuda:0 twice"),
])
def test_bad_devices_are_refused_with_the_reason(text, message):
    with pytest.raises(StageSplitError, match=message):
        parse_devices(text)


def test_devices_parse():
    assert parse_devices("cpu, cpu,cpu") == ["cpu"] * 3
    assert parse_devices("cuda:1,cuda:0") == ["cuda:1", "cuda:0"]
    assert parse_devices(",".join(f"cuda:{i}" for i in range(8))) == [f"cuda:{i}" for i in range(8)]


@pytest.mark.parametrize("text", ["2,x", "3,0", "2,-1", "1.5,2", ""])
def test_bad_stage_layers_are_refused(text):
    with pytest.raises(StageSplitError, match="whole number of layers, at least 1"):
        parse_stage_layers(text)


def test_explicit_split_is_checked_against_the_model():
    assert plan_stages(6, ["cpu"] * 3, [1, 3, 2]) == [range(1), range(1, 4), range(4, 6)]
    with pytest.raises(StageSplitError, match="adds up to 5 layers; the model has 6"):
        plan_stages(6, ["cpu"] * 2, [2, 3])
    with pytest.raises(StageSplitError, match="lists 3 counts for 2 devices"):
        plan_stages(6, ["cpu"] * 2, [2, 2, 2])
    with pytest.raises(StageSplitError, match="lists 3 stages but the model has 2 layers"):
        plan_stages(2, ["cpu"] * 3)


def test_default_split_is_even_or_follows_free_memory():
    assert [len(r) for r in plan_stages(6, ["cpu"] * 4)] == [2, 2, 1, 1]
    assert [len(r) for r in plan_stages(64, ["cuda:0", "cuda:1"])] == [32, 32]
    # three times the free memory on the first device: three times the layers beyond one each
    assert [len(r) for r in plan_stages(8, ["cuda:0", "cuda:1"], free_bytes=[3 << 30, 1 << 30])] == [6, 2]
    ranges = plan_stages(27, ["cuda:0", "cuda:1", "cuda:2"], free_bytes=[80 << 30, 40 << 30, 40 << 30])
    assert [len(r) for r in ranges] == [13, 7, 7] and ranges[-1].stop == 27


def _ns(**kw):
    base = dict(devices=None, stage_layers=None, spec=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_serve_options_refuse_what_a_pipeline_cannot_run():
    assert pipeline_options_from_args(_ns()) == (None, None)
    assert pipeline_options_from_args(_ns(devices="cpu,cpu", stage_layers="3,1")) == (["cpu", "cpu"], [3, 1])
    with pytest.raises(ValueError, match="--stage-layers needs --devices"):
        pipeline_options_from_args(_ns(stage_layers="2,2"))
    with pytest.raises(ValueError, match="lists 3 counts for 2 devices"):
        pipeline_options_from_args(_ns(devices="cpu,cpu", stage_layers="1,1,2"))
    with pytest.raises(ValueError, match="--vision-residency overlay does not run with --devices"):
        pipeline_options_from_args(_ns(devices="cpu,cpu", vision_residency="overlay"))
    assert pipeline_options_from_args(_ns(devices="cpu,cpu", vision_residency="resident"))[0] == ["cpu", "cpu"]
    # speculative decoding runs across the stages (the draft head on the last; tests/test_pipeline_spec.py)
    assert pipeline_options_from_args(_ns(devices="cpu,cpu", spec="mtp")) == (["cpu", "cpu"], None)


def _seg(slot, start, n, kind=PREFILL, **kw):
    return LaneSegment(slot, {"g": list(range(8))}, start, list(range(1, n + 1)), kind, **kw)


def test_a_decode_round_of_a_few_lanes_stays_one_piece():
    batch = ForwardBatch([_seg(i, 10, 1, DECODE) for i in range(8)])
    pieces, how = microbatch.plan(batch, stages=2, min_tokens=256)
    assert how == "whole" and pieces == [batch]


def test_a_wide_round_is_cut_between_lanes():
    batch = ForwardBatch([_seg(i, 10, 16, "verify", logits=LOGITS_ALL) for i in range(8)])
    pieces, how = microbatch.plan(batch, stages=2, min_tokens=32)
    assert how == "lanes" and len(pieces) == 4
    assert [s.slot for p in pieces for s in p.segments] == list(range(8))


def test_a_prefill_chunk_is_cut_along_its_tokens_with_the_capture_inside_a_piece():
    seg = _seg(0, 64, 100, logits=LOGITS_LAST, hidden=(FINAL_HIDDEN,), snapshot=(50, 3))
    pieces, how = microbatch.plan(ForwardBatch([seg]), stages=2, min_tokens=25)
    assert how == "tokens" and len(pieces) == 4
    segs = [p.segments[0] for p in pieces]
    assert [s.start for s in segs] == [64, 89, 115, 139] and sum(len(s) for s in segs) == 100
    assert [t for s in segs for t in s.tokens] == list(seg.tokens)  # the boundary at 50 moved to 51
    assert [s.snapshot for s in segs] == [None, (25, 3), None, None]
    assert [s.logits for s in segs] == [LOGITS_NONE] * 3 + [LOGITS_LAST]
    outs = [[SegmentOutput(torch.full((5,), float(i)) if i == 3 else None,
                           {FINAL_HIDDEN: torch.full((len(s), 2), float(i))})] for i, s in enumerate(segs)]
    joined = microbatch.join(ForwardBatch([seg]), how, outs)
    assert len(joined) == 1 and torch.equal(joined[0].logits, torch.full((5,), 3.0))
    hidden = joined[0].hidden[FINAL_HIDDEN]
    assert hidden.shape == (100, 2) and hidden[0, 0] == 0 and hidden[-1, 0] == 3


def test_all_logits_join_in_token_order():
    seg = _seg(0, 0, 40, logits=LOGITS_ALL)
    pieces, how = microbatch.plan(ForwardBatch([seg]), stages=3, min_tokens=10)
    assert how == "tokens" and all(p.segments[0].logits == LOGITS_ALL for p in pieces)
    outs = [[SegmentOutput(torch.arange(p.segments[0].start, p.segments[0].end).float()[:, None])] for p in pieces]
    joined = microbatch.join(ForwardBatch([seg]), how, outs)
    assert torch.equal(joined[0].logits[:, 0], torch.arange(40).float())


def test_cache_specs_of_the_stages_merge_into_the_model_spec():
    a = CacheSpec((KVGroup("attn", (3,), 2, 32, 512),), 100, (0, 1, 2))
    b = CacheSpec((KVGroup("attn", (7,), 2, 32, 512),), 60, (4, 5))
    c = CacheSpec((), 40, (8,))
    spec = merge_cache_specs([a, b, c])
    assert spec.kv_groups == (KVGroup("attn", (3, 7), 2, 32, 1024),)
    assert spec.state_bytes == 200 and spec.state_layers == (0, 1, 2, 4, 5, 8)
    with pytest.raises(ValueError, match="another geometry"):
        merge_cache_specs([a, CacheSpec((KVGroup("attn", (7,), 4, 32, 1024),), 0)])
