"""Speculative decoding across pipeline stages (issue 26): `--spec mtp` (the MTP head on the last
stage, beside the final hidden and the LM head) and `--spec dflash` / `dflash2` (the drafter on
rank 0 with stage 0's embeddings, the target layers it reads coming back from the stages that hold
them, the LM head on the last stage) give the same greedy output through the engine as one stage
with the same --spec; gloo processes on this machine, a tiny random Qwen3.5 artifact."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("ninfer_qwen35")
pytest.importorskip("ninfer_spec_mtp")
pytest.importorskip("ninfer_spec_dflash")

import torch
from ninfer_qwen35.family import Qwen35Family
from ninfer_qwen35.testing import build_tiny_artifact
from ninfer_spec_dflash.backend import DFlash2Backend, DFlashBackend
from ninfer_spec_dflash.testing import random_drafter_checkpoint
from ninfer_spec_mtp.backend import MtpBackend

from ninfer_core.artifact import Artifact
from ninfer_core.cli import main as cli
from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.model_api import FINAL_HIDDEN, PREFILL, ForwardBatch, LaneSegment
from ninfer_core.engine.pipeline.runner import PipelineRunner
from ninfer_core.testing import collect, run_async

FAMILY = "ninfer_qwen35.family:Qwen35Family"
BACKENDS = {"mtp": MtpBackend, "dflash": DFlashBackend, "dflash2": DFlash2Backend}
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """4 layers (3 GDN : 1 attention), an MTP head, DFlash drafters reading layers 1 and 3."""
    d = tmp_path_factory.mktemp("pipespec")
    base = build_tiny_artifact(d / "t.ninfer", seed=31)
    for kind in ("dflash", "dflash2"):
        random_drafter_checkpoint(d / kind, kind, 64, 512, [1, 3], seed=4)
    assert cli(["convert", str(base), str(d / "t2.ninfer"), "--dflash", str(d / "dflash"),
                "--dflash2", str(d / "dflash2"), "--no-progress"]) == 0
    return str(d / "t2.ninfer")


class _Tok:
    eos_token_ids = ()
    vocab_size = 512

    def token_bytes(self, t):
        return bytes([t]) if t < 256 else b""

    def is_special(self, t):
        return t >= 256

    def decode(self, ids, skip_special=True):
        return b"".join(self.token_bytes(t) for t in ids).decode("utf-8", "replace")


def requests(n=20):
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, 500, (40,), generator=g).tolist()
    return [GenerationRequest(prompt_ids=base[: 8 + 9 * i] + base[:12], sampling=GREEDY, max_tokens=n)
            for i in range(3)]


def serve(runner, art, spec, k=3):
    backend = BACKENDS[spec].load(runner, Artifact.open(art), argparse.Namespace(draft_tokens=k)) if spec else None

    async def go():
        eng = Engine(runner, _Tok(), EngineOptions(max_context=512, prefill_chunk=32, max_concurrency=3),
                     spec=backend)
        eng.start()
        try:
            outs = [await collect(h) for h in [eng.submit(q) for q in requests()]]
            return [o.token_ids for o in outs], eng.snapshot()
        finally:
            eng.shutdown(timeout=60)

    return run_async(go(), timeout=300)


@pytest.mark.parametrize("spec, k", [("mtp", 3), ("dflash", 7), ("dflash2", 7)])
def test_spec_greedy_output_across_stages_equals_one_stage(art, spec, k):
    want, one = serve(Qwen35Family().load(Artifact.open(art)), art, spec, k)
    runner = PipelineRunner.start(FAMILY, art, ["cpu", "cpu"], [2, 2])
    try:
        got, snap = serve(runner, art, spec, k)
        assert got == want
        c = snap["counters"]
        assert c["draft_tokens"] > 0 and c["draft_tokens"] == one["counters"]["draft_tokens"]
        assert c["draft_accepted_tokens"] == one["counters"]["draft_accepted_tokens"]
        pipe = runner.counters()["pipeline"]
        assert pipe["cut_rounds"] > 0  # the verify rounds of three lanes went through the stages in groups
        if spec == "mtp":  # the head's pages are the last stage's cache
            assert "mtp" in runner.cache_spec().group_names and "mtp" in runner.stage_specs[1].group_names
            assert "mtp" not in runner.stage_specs[0].group_names
    finally:
        runner.close()


def test_asked_layer_outputs_come_back_from_the_stage_that_holds_them(art):
    """Layers 0 (stage 0), 2 and 3 (the last stage) and the final hidden of a prefill cut into
    micro-batches along its tokens equal the whole model's."""
    whole = Qwen35Family().load(Artifact.open(art))
    runner = PipelineRunner.start(FAMILY, art, ["cpu", "cpu"], [2, 2], microbatch_tokens=8)
    try:
        for r in (whole, runner):
            r.allocate_cache(4, 2)
        prompt = list(range(5, 45))
        seg = LaneSegment(0, {"full_attention": [0, 1]}, 0, prompt, PREFILL, hidden=(0, 2, 3, FINAL_HIDDEN))
        want, got = whole.forward(ForwardBatch([seg]))[0], runner.forward(ForwardBatch([seg]))[0]
        assert runner.counters()["pipeline"]["cut_forwards"] == 1
        assert sorted(got.hidden) == sorted(want.hidden)
        for layer, t in want.hidden.items():
            torch.testing.assert_close(got.hidden[layer], t, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
        assert runner.draft_heads() == ("mtp",)
        with pytest.raises(RuntimeError, match="before allocate_cache"):
            runner.enable_draft_head("mtp")
    finally:
        runner.close()


def test_serve_spec_mtp_across_stages_answers_as_one_device(start_server):
    """`ninfer serve --devices cpu,cpu --spec mtp` with the openai client: the same greedy text as
    `--spec mtp` on one device; GET /stats carries the stages' counters."""
    openai = pytest.importorskip("openai")
    import httpx

    piped = start_server("--devices", "cpu,cpu", "--spec", "mtp", "--max-concurrency", "2")
    root = start_server("--spec", "mtp", "--max-concurrency", "2")
    assert "pipeline of 2 stages (gloo)" in piped.log() and "speculative backend mtp" in piped.log()

    def ask(server):
        client = openai.OpenAI(base_url=server.api_base, api_key="none")
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt="Once upon a time, in a house by the sea,",
                                      max_tokens=24, temperature=0)
        return r.choices[0].text

    got, want = ask(piped), ask(root)
    assert got == want and got
    stats = httpx.get(piped.base_url + "/stats", timeout=10).json()
    p = stats["pipeline"]
    assert p["stages"] == 2 and p["forwards"] > 0 and len(p["busy_seconds"]) == 2


@pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast_path"])
def test_stage_verify_commit_and_mtp_ride_along_chained_in_process(art, fast):
    """The stage contract under speculation, without processes: two stage runners chained by hand
    (the MTP head on the last) run prefill, a verify of uneven lanes, its commit and a decode with
    the whole model's bits, and the head drafts the same from what the stages wrote."""
    from ninfer_qwen35.gpu.runner import GpuQwen35Runner

    from ninfer_core.engine.model_api import DECODE, VERIFY, DraftStep

    fam, a = Qwen35Family(), Artifact.open(art)
    whole, stages = fam.load(a, "cpu"), [fam.load_stage(a, r, "cpu") for r in (range(2), range(2, 4))]
    if fast:
        whole = GpuQwen35Runner.from_runner(whole, cuda_graph=False)
        stages = [GpuQwen35Runner.from_runner(s, cuda_graph=False) for s in stages]
    assert stages[0].mtp is None and stages[1].draft_heads() == ("mtp",)
    heads = [whole.enable_draft_head("mtp"), stages[1].enable_draft_head("mtp")]
    for r in (whole, *stages):
        r.allocate_cache(8, 3)
    t0, t1 = {"full_attention": [0, 1], "mtp": [0, 1]}, {"full_attention": [2, 3], "mtp": [2, 3]}
    p0, p1 = list(range(5, 75)), list(range(100, 130))

    def both(batch):
        h = None
        for s in stages:
            h = s.forward_stage(batch, h)
        return whole.forward(batch), h

    for batch in (ForwardBatch([LaneSegment(0, t0, 0, p0, PREFILL, snapshot=(40, 2))]),
                  ForwardBatch([LaneSegment(1, t1, 0, p1, PREFILL)]),
                  ForwardBatch([LaneSegment(0, t0, 70, [9, 8, 7, 6], VERIFY, "all"),
                                LaneSegment(1, t1, 30, [4, 3], VERIFY, "all")])):
        want, got = both(batch)
        for x, y in zip(want, got):
            assert torch.equal(x.logits, y.logits)
    for r in (whole, *stages):
        r.commit([(0, 2), (1, 1)])
    want, got = both(ForwardBatch([LaneSegment(0, t0, 72, [11], DECODE), LaneSegment(1, t1, 31, [12], DECODE)]))
    for x, y in zip(want, got):
        assert torch.equal(x.logits, y.logits)
    rows = [DraftStep(0, 73, 13, t0["mtp"]), DraftStep(1, 32, 14, t1["mtp"])]
    assert torch.equal(heads[0].step(rows), heads[1].step(rows))
