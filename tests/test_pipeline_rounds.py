"""Pipelined decode rounds (issue 26): a round of several lanes cut into one lane group per stage,
so stage s+1 runs group j while stage s runs group j+1; greedy output equals one stage and the
runner's overlap counters show the stages worked at once (gloo processes on this machine)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ninfer_qwen35")

from ninfer_core.artifact import Artifact
from ninfer_core.engine.model_api import SeqView
from ninfer_core.engine.pipeline.overlap import OverlapCounters, concurrent_seconds, overlapped_pairs
from ninfer_core.engine.pipeline.runner import PipelineRunner

FAMILY = "ninfer_qwen35.family:Qwen35Family"
PROMPTS = [list(range(3, 90, 3)), [7, 7, 9, 11, 300, 40], list(range(200, 150, -1)), [5, 6, 7]]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from ninfer_qwen35.testing import build_tiny_artifact

    return build_tiny_artifact(tmp_path_factory.mktemp("rounds") / "tiny6.ninfer", num_layers=6, seed=5, mtp=False)


def batched_greedy(runner, prompts, steps: int):
    """Every lane prefilled, then `steps` decode rounds over all lanes at once (the engine's round)."""
    runner.allocate_cache(4 * len(prompts), len(prompts))
    views = [SeqView(i, list(range(4 * i, 4 * i + 4)), 0) for i in range(len(prompts))]
    out = []
    for v, p in zip(views, prompts):
        runner.reset_slot(v.slot)
        out.append([int(runner.prefill(v, p).argmax())])
        v.num_cached = len(p)
    last = None
    for _ in range(steps):
        last = runner.decode(views, [o[-1] for o in out])
        for o, t in zip(out, last.argmax(-1).tolist()):
            o.append(int(t))
        for v in views:
            v.num_cached += 1
    return out, last


def test_overlap_counts_pairs_and_concurrent_time():
    # stage 0 runs pieces 0, 1, 2 back to back; stage 1 runs piece 0 during stage 0's piece 1, etc.
    spans = [[(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)], [(1.5, 2.5), (2.5, 3.5), (3.5, 4.5)]]
    assert overlapped_pairs(spans) == 2
    assert concurrent_seconds(spans) == pytest.approx(1.5)  # 1.5 .. 3.0
    serial = [[(0.0, 1.0), (1.0, 2.0)], [(2.0, 3.0), (3.0, 4.0)]]
    assert overlapped_pairs(serial) == 0 and concurrent_seconds(serial) == 0.0
    c = OverlapCounters(2)
    assert c.add(spans, "lanes", True) == 2
    d = c.as_dict()
    assert d["cut_rounds"] == 1 and d["pieces"] == 3 and d["busy_seconds"] == [3.0, 3.0]


@pytest.mark.parametrize("stages, layers", [(2, [3, 3]), (3, [2, 1, 3])])
def test_pipelined_decode_rounds_keep_greedy_output_and_overlap(artifact, stages, layers):
    from ninfer_qwen35.family import Qwen35Family

    want, want_logits = batched_greedy(Qwen35Family().load(Artifact.open(artifact), "cpu"), PROMPTS, 10)
    runner = PipelineRunner.start(FAMILY, artifact, ["cpu"] * stages, layers)
    try:
        assert runner.round_groups == stages
        got, logits = batched_greedy(runner, PROMPTS, 10)
        assert got == want
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        c = runner.counters()["pipeline"]
        # every decode round of 4 lanes was cut into one lane group per stage
        assert c["cut_rounds"] == 10 and c["stages"] == stages
        assert c["pieces"] == len(PROMPTS) + 10 * stages  # the short prefills stay whole
        assert all(b > 0 for b in c["busy_seconds"])
        # stage s+1 ran group j while stage s ran group j+1. The stages are processes of a shared
        # machine whose scheduler may run them one after the other in a given round, so more rounds
        # run until one overlaps (a pipeline that sent a group on only after the whole round never does)
        views = [SeqView(i, list(range(4 * i, 4 * i + 4)), len(p) + 10) for i, p in enumerate(PROMPTS)]
        for _ in range(100):
            if runner.counters()["pipeline"]["overlapped_pieces"]:
                break
            runner.decode(views, [o[-1] for o in got])  # the same positions again: nothing moves on
        c = runner.counters()["pipeline"]
        assert c["overlapped_pieces"] > 0 and c["overlap_seconds"] > 0

        runner.round_groups = 1  # whole rounds: the same tokens, no round cut
        again, _ = batched_greedy(runner, PROMPTS, 10)
        assert again == want and runner.counters()["pipeline"]["cut_rounds"] == c["cut_rounds"]
    finally:
        runner.close()
