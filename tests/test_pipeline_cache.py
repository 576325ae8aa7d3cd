"""The context cache over pipeline stages (issue 26): every checkpoint's StateImage is captured on
each stage (its own layers' state, the MTP head's hidden and pages on the last) and restored
there; a second turn reusing the first turn's prefix gives what a recompute gives, with the
checkpoints in Device slots (a slot copy on every stage) or in the Host tier (images merged on
rank 0 and handed back stage by stage), with and without `--spec mtp`."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("ninfer_qwen35")
pytest.importorskip("ninfer_spec_mtp")

import torch
from ninfer_qwen35.family import Qwen35Family
from ninfer_qwen35.testing import build_tiny_artifact
from ninfer_spec_mtp.backend import MtpBackend

from ninfer_core.artifact import Artifact
from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.pipeline.runner import PipelineRunner
from ninfer_core.testing import collect, run_async

FAMILY = "ninfer_qwen35.family:Qwen35Family"
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return str(build_tiny_artifact(tmp_path_factory.mktemp("pipecache") / "t.ninfer", seed=11, num_layers=4))


class _Tok:
    eos_token_ids = ()
    vocab_size = 512

    def token_bytes(self, t):
        return bytes([t]) if t < 256 else b""

    def is_special(self, t):
        return t >= 256

    def decode(self, ids, skip_special=True):
        return b"".join(self.token_bytes(t) for t in ids).decode("utf-8", "replace")


def two_turns(runner, art, spec: bool, reuse: bool, **opts):
    """Turn 1 on a prompt, turn 2 on prompt + answer + more; (outputs, turn 2's cached tokens, snapshot)."""
    backend = MtpBackend.load(runner, Artifact.open(art), argparse.Namespace(draft_tokens=3)) if spec else None
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 500, (150,), generator=g).tolist()

    async def go():
        eng = Engine(runner, _Tok(), EngineOptions(max_context=512, prefill_chunk=64, prefix_reuse=reuse, **opts),
                     spec=backend)
        eng.start()
        try:
            first = await collect(eng.submit(GenerationRequest(prompt_ids=prompt, sampling=GREEDY, max_tokens=12)))
            follow = prompt + first.token_ids + [7, 8, 9, 10, 11]
            second = await collect(eng.submit(GenerationRequest(prompt_ids=follow, sampling=GREEDY, max_tokens=12)))
            admitted = next(e for e in second.events if e.kind == "admitted")
            return [first.token_ids, second.token_ids], admitted.usage.cached_tokens, eng.snapshot()
        finally:
            eng.shutdown(timeout=60)

    return run_async(go(), timeout=300)


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "mtp"])
@pytest.mark.parametrize("tier", ["device", "host"])
def test_second_turn_reusing_the_prefix_equals_recompute(art, spec, tier):
    want, cached, _ = two_turns(Qwen35Family().load(Artifact.open(art)), art, spec, reuse=False)
    assert cached == 0
    opts = {"device_state_slots": 0, "host_state_slots": 4} if tier == "host" else {}
    runner = PipelineRunner.start(FAMILY, art, ["cpu", "cpu"], [1, 3])
    try:
        got, cached, snap = two_turns(runner, art, spec, reuse=True, **opts)
        assert got == want
        assert cached >= 150  # the first turn's prompt at least came from a checkpoint
        cc = snap["context_cache"]
        assert cc["checkpoints"] > 0
        if tier == "host":
            assert cc["device_state_slots_used"] == 0 and cc["host_state_slots_used"] > 0, cc
        # the image is every stage's: stage 0's first layer, the last stage's layers (and MTP hidden)
        image = runner.capture_state(0)
        held = [set(names) for names, _ in runner._names]
        assert all(held) and set(image.tensors) == held[0] | held[1] and not held[0] & held[1]
        pages = [set(names) for _, names in runner._names]
        assert held[0] == {"conv.0", "ssm.0"}  # layer 0 (GDN) on stage 0; layer 3 is the attention layer
        assert {"k.3", "v.3"} <= pages[1] and not pages[0]
        if spec:  # the MTP head's hidden and its KV (layer id 4, past the model's) on the last stage
            assert "hidden" in held[1] and {"k.4", "v.4"} <= pages[1]
    finally:
        runner.close()
