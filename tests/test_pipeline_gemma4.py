"""Gemma 4 split into pipeline stages (issue 26): E2B's shape (per-layer inputs that travel with the
residual stream, KV-shared layers kept with their source layer, sliding rings per stage) and the
MoE 26B-A4B shape give the greedy output of one stage through the engine (three lanes decoding
together, prompts of several chunks past the sliding window, a second turn reusing the prefix);
a split that would part a KV-shared layer from its source is refused with the layers that work."""

from __future__ import annotations

import pytest

pytest.importorskip("ninfer_gemma4")

import torch
from ninfer_gemma4.family import Gemma4Family
from ninfer_gemma4.testing import build_tiny_artifact

from ninfer_core.artifact import Artifact
from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.pipeline.runner import PipelineRunner
from ninfer_core.engine.pipeline.split import StageSplitError, plan_stages
from ninfer_core.testing import collect, run_async

FAMILY = "ninfer_gemma4.family:Gemma4Family"
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    d = tmp_path_factory.mktemp("pipegemma")
    return {kind: build_tiny_artifact(d / f"{kind}.ninfer", kind=kind, seed=7) for kind in ("e2b", "26b-a4b")}


class _Tok:
    eos_token_ids = ()
    vocab_size = 512

    def token_bytes(self, t):
        return bytes([t]) if t < 256 else b""

    def is_special(self, t):
        return t >= 256

    def decode(self, ids, skip_special=True):
        return b"".join(self.token_bytes(t) for t in ids).decode("utf-8", "replace")


def serve(runner):
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (70, 41, 90)]

    async def go():
        eng = Engine(runner, _Tok(), EngineOptions(max_context=512, prefill_chunk=32, max_concurrency=3,
                                                   prefix_reuse=True))
        eng.start()
        try:
            hs = [eng.submit(GenerationRequest(prompt_ids=p, sampling=GREEDY, max_tokens=10)) for p in prompts]
            outs = [(await collect(h)).token_ids for h in hs]
            follow = prompts[0] + outs[0] + [5, 6, 7]
            again = await collect(eng.submit(GenerationRequest(prompt_ids=follow, sampling=GREEDY, max_tokens=10)))
            cached = next(e for e in again.events if e.kind == "admitted").usage.cached_tokens
            return [*outs, again.token_ids], cached
        finally:
            eng.shutdown(timeout=60)

    return run_async(go(), timeout=300)


@pytest.mark.parametrize("kind, devices, layers", [("e2b", 2, None), ("e2b", 2, [3, 12]), ("26b-a4b", 3, [4, 4, 4])])
def test_gemma4_stages_give_one_stages_greedy_output(arts, kind, devices, layers):
    art = arts[kind]
    want, _ = serve(Gemma4Family().load(Artifact.open(art)))
    runner = PipelineRunner.start(FAMILY, art, ["cpu"] * devices, layers)
    try:
        cuts = Gemma4Family().pipeline_cuts(Artifact.open(art))
        assert all(r.start == 0 or r.start in cuts for r in runner.ranges)
        got, cached = serve(runner)
        assert got == want
        assert cached > 0  # the second turn restored every stage's sliding rings and global pages
        assert runner.counters()["pipeline"]["cut_rounds"] > 0
    finally:
        runner.close()


def test_a_split_inside_the_kv_shared_layers_is_refused(arts):
    fam = Gemma4Family()
    art = Artifact.open(arts["e2b"])
    n, cuts = fam.pipeline_layers(art), fam.pipeline_cuts(art)
    assert n == 15 and cuts == (1, 2, 3, 4)  # layers 6..14 read layer 4's (global) and 5's (sliding) K/V
    assert plan_stages(n, ["cpu"] * 2, None, None, cuts) == [range(4), range(4, 15)]  # the even cut at 8 moved
    with pytest.raises(StageSplitError, match="starts a stage at layer 8, .* may start at layers 1..4"):
        plan_stages(n, ["cpu"] * 2, [8, 7], None, cuts)
    with pytest.raises(StageSplitError, match="split into 5 stages at most"):
        plan_stages(n, ["cpu"] * 6, None, None, cuts)
    assert fam.pipeline_cuts(Artifact.open(arts["26b-a4b"])) == tuple(range(1, 12))


def test_serve_refuses_a_split_inside_the_kv_shared_layers_before_loading(arts):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "serve", arts["e2b"], "--port", "0",
                        "--devices", "cpu,cpu", "--stage-layers", "8,7"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1
    assert ("error: --stage-layers starts a stage at layer 8, which reads state of a layer before it; this model's "
            "stages may start at layers 1..4") in r.stderr
