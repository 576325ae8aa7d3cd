"""CUDA checks of the DFlash paths (skipped without CUDA; `gpu_check.py --order dflash` runs them):
the draft pass's CUDA Graphs draft what the eager pass drafts, the GPU runner's verify and decode
graphs with layer outputs give the logits of the graphs without them, and 8 concurrent greedy
requests with either drafter equal plain decoding of each alone, in bf16."""

from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("ninfer_qwen35")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from ninfer_qwen35.family import Qwen35Family
from ninfer_qwen35.testing import build_tiny_artifact
from ninfer_spec_dflash.backend import DFlash2Backend, DFlashBackend
from ninfer_spec_dflash.testing import random_drafter_checkpoint

from ninfer_core.artifact import Artifact
from ninfer_core.cli import main as cli
from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.model_api import DECODE, PREFILL, VERIFY, ForwardBatch, LaneSegment
from ninfer_core.engine.spec import DraftLane
from ninfer_core.testing import collect, run_async

BACKENDS = {"dflash": DFlashBackend, "dflash2": DFlash2Backend}


class _Tok:
    """A byte tokenizer: the random model's ids above 255 decode to nothing."""

    eos_token_ids = ()
    vocab_size = 512

    def token_bytes(self, t):
        return bytes([t]) if t < 256 else b""

    def is_special(self, t):
        return t >= 256

    def decode(self, ids, skip_special=True):
        return b"".join(self.token_bytes(t) for t in ids).decode("utf-8", "replace")


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    d = tmp_path_factory.mktemp("dflgpu")
    base = build_tiny_artifact(d / "t.ninfer", seed=31)
    for kind in BACKENDS:
        random_drafter_checkpoint(d / kind, kind, 64, 512, [1, 3], seed=4)
    assert cli(["convert", str(base), str(d / "t2.ninfer"), "--dflash", str(d / "dflash"),
                "--dflash2", str(d / "dflash2"), "--no-progress"]) == 0
    return Artifact.open(d / "t2.ninfer")


def load(art, kind=None, k=7):
    r = Qwen35Family().load(art, device="cuda", dtype="bfloat16")
    return r, (BACKENDS[kind].load(r, art, argparse.Namespace(draft_tokens=k)) if kind else None)


@pytest.mark.parametrize("kind", list(BACKENDS))
def test_draft_graphs_equal_the_eager_pass(art, kind):
    r, backend = load(art, kind)
    r.allocate_cache(32, 9)
    assert r.graphs_enabled
    g = torch.Generator().manual_seed(1)
    lanes = []
    for i, p in enumerate((5, 40, 77)):
        feats = torch.randn(p, 128, generator=g).to("cuda", torch.bfloat16)
        backend.observe_target(f"r{i}", 0, {1: feats[:, :64], 3: feats[:, 64:]})
        lanes.append(DraftLane(f"r{i}", i, {}, p, 7 + i, 7))
    rows, tokens, bases, width = backend._lanes(lanes)
    eager = backend.graphs.run(rows, tokens, bases, width, 7, static=False).clone()
    for _ in range(3):  # capture, then replays
        graphed = backend.graphs.run(rows, tokens, bases, width, 7, static=True)
        assert torch.equal(graphed, eager)
    assert backend.graphs.graphs[(4, 128, 7)]["graph"] is not None
    print(f"dflash graphs {kind}: 3 lanes in the (4, 128, 7) graph draft what the eager pass drafts")


def test_runner_graphs_with_layer_outputs_give_the_same_logits(art):
    outs = []
    for taps in ((), (1, 3)):
        r, _ = load(art)
        r.allocate_cache(16, 2)
        tables = {gn: list(range(4)) for gn in r.cache_spec().group_names}
        ids = list(range(3, 43))
        got = [r.forward(ForwardBatch([LaneSegment(0, tables, 0, ids, PREFILL, "last", taps)]))[0],
               r.forward(ForwardBatch([LaneSegment(0, tables, 40, [5], DECODE, "last", taps)]))[0],
               r.forward(ForwardBatch([LaneSegment(0, tables, 41, [6, 7, 8], VERIFY, "all", taps)]))[0]]
        r.commit([(0, 2)])
        got.append(r.forward(ForwardBatch([LaneSegment(0, tables, 43, [9], DECODE, "last", taps)]))[0])
        outs.append(got)
        if taps:
            assert any(isinstance(k, tuple) and k[1] == taps for k in r._graphs)
            assert any(k[2] == taps for k in r._vgraphs)
    for a, b in zip(*outs):
        assert torch.equal(a.logits, b.logits)
    print("dflash taps: prefill, graphed decode and verify logits with layer outputs equal those without")


@pytest.mark.parametrize("kind", list(BACKENDS))
def test_eight_concurrent_greedy_equal_each_alone(art, kind):
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 500, (6 + 9 * i,), generator=g).tolist() for i in range(8)]
    rs = [GenerationRequest(prompt_ids=p, sampling=SamplingParams(temperature=0.0), max_tokens=24) for p in prompts]

    def serve(spec, lanes, concurrent):
        r, backend = load(art, spec)

        async def go():
            eng = Engine(r, _Tok(), EngineOptions(max_context=512, prefill_chunk=64, max_concurrency=lanes,
                                                device="cuda"), spec=backend)
            eng.start()
            try:
                if concurrent:
                    hs = [eng.submit(q) for q in rs]
                    return [await collect(h) for h in hs]
                return [await collect(eng.submit(q)) for q in rs]
            finally:
                eng.shutdown(timeout=60)

        return [o.token_ids for o in run_async(go(), timeout=600)]

    alone = serve(None, 1, False)
    got = serve(kind, 8, True)
    same = sum(a == b for a, b in zip(alone, got))
    print(f"dflash 8 concurrent {kind}: {same}/8 greedy outputs equal each request alone")
    assert same == 8
