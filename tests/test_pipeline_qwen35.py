"""Pipeline stages of the real Qwen3.5 CPU model (tiny random artifact): 2 and 3 stage processes
over gloo on this machine against one stage, through the runner, an Engine with the context cache,
and `ninfer serve --devices cpu,cpu` with the openai client."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("ninfer_qwen35")

from ninfer_core.artifact import Artifact
from ninfer_core.engine.model_api import DECODE, PREFILL, ForwardBatch, LaneSegment, SideInputs
from ninfer_core.engine.pipeline.runner import PipelineRunner
from ninfer_core.testing import runner_continuation

FAMILY = "ninfer_qwen35.family:Qwen35Family"
PROMPTS = [list(range(3, 140, 2)), [7, 7, 9, 11, 300, 40]]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from ninfer_qwen35.testing import build_tiny_artifact

    return build_tiny_artifact(tmp_path_factory.mktemp("pipeline") / "tiny6.ninfer", num_layers=6, seed=3, mtp=False)


@pytest.fixture(scope="module")
def whole(artifact):
    from ninfer_qwen35.family import Qwen35Family

    return Qwen35Family().load(Artifact.open(artifact), "cpu")


def _greedy(runner, prompts=PROMPTS, n=12):
    cont = runner_continuation(runner, num_pages=8)
    return [cont(list(p), n) for p in prompts]


@pytest.mark.parametrize("stages, layers, microbatch_tokens", [
    (2, None, 256),  # an even split, no cut: the same bits as one stage
    (3, [1, 3, 2], 16),  # an explicit split; prefill chunks cut into micro-batches
])
def test_greedy_output_of_stages_equals_one_stage(artifact, whole, stages, layers, microbatch_tokens):
    want = _greedy(whole)
    runner = PipelineRunner.start(FAMILY, artifact, ["cpu"] * stages, layers, microbatch_tokens=microbatch_tokens)
    try:
        assert [len(r) for r in runner.ranges] == (layers or [3, 3])
        assert runner.info.extra["pipeline"]["stage_layers"] == (layers or [3, 3])
        assert runner.cache_spec() == whole.cache_spec()
        assert _greedy(runner) == want
        # one batched decode round of two lanes, logits against the whole model's
        for r in (whole, runner):
            r.allocate_cache(8, 3)
        tb, t1 = {"full_attention": [0, 1, 2, 3]}, {"full_attention": [4, 5, 6, 7]}  # lanes own their pages
        for r in (whole, runner):
            r.forward(ForwardBatch([LaneSegment(0, tb, 0, PROMPTS[0], PREFILL)]))
            r.forward(ForwardBatch([LaneSegment(1, t1, 0, PROMPTS[1], PREFILL)]))
        segs = [LaneSegment(0, tb, len(PROMPTS[0]), [5], DECODE), LaneSegment(1, t1, len(PROMPTS[1]), [9], DECODE)]
        a, b = whole.forward(ForwardBatch(segs)), runner.forward(ForwardBatch(segs))
        for x, y in zip(a, b):
            torch.testing.assert_close(y.logits, x.logits, rtol=1e-4, atol=1e-4)
            assert int(y.logits.argmax()) == int(x.logits.argmax())
    finally:
        runner.close()


def test_state_images_and_pages_cross_the_stages(artifact, whole):
    runner = PipelineRunner.start(FAMILY, artifact, ["cpu", "cpu"], [2, 4])
    try:
        runner.allocate_cache(8, 3)
        whole.allocate_cache(8, 3)
        tb = {"full_attention": [0, 1, 2, 3]}
        for r in (whole, runner):
            r.forward(ForwardBatch([LaneSegment(0, tb, 0, PROMPTS[0], PREFILL, snapshot=(40, 2))]))
        image, ref = runner.capture_state(2), whole.capture_state(2)
        assert sorted(image.tensors) == sorted(ref.tensors)  # one image, every stage's layers
        for name, t in ref.tensors.items():
            torch.testing.assert_close(image.tensors[name], t)
        pages = runner.read_pages([0, 1])
        assert sorted(pages) == sorted(whole.read_pages([0, 1]))
        # the checkpoint at 40 restored into another lane, its pages copied: the continuation matches
        runner.restore_state(image, 1)
        runner.write_pages([4, 5], pages)
        t1 = {"full_attention": [4, 5, 6, 7]}
        out = runner.forward(ForwardBatch([LaneSegment(1, t1, 40, PROMPTS[0][40:], PREFILL)]))[0].logits
        ref_out = whole.forward(ForwardBatch([LaneSegment(2, tb, 40, PROMPTS[0][40:], PREFILL)]))[0].logits
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError, match="holds state this model does not keep"):
            runner.restore_state(type(image)(dict(image.tensors, extra=torch.zeros(1))), 1)
        with pytest.raises(ValueError, match="state slot 9 outside"):  # checked before any stage runs
            runner.forward(ForwardBatch([LaneSegment(9, tb, 0, [1], PREFILL)]))
        bad = LaneSegment(0, tb, len(PROMPTS[0]), [5], DECODE, side=SideInputs(positions=[1, 2]))
        with pytest.raises(ValueError, match="side positions of shape"):  # raised inside the stages
            runner.forward(ForwardBatch([bad]))
        # every stage ended that forward in step: the next one runs
        assert runner.forward(ForwardBatch([LaneSegment(0, tb, len(PROMPTS[0]), [5], DECODE)]))[0].logits is not None
    finally:
        runner.close()


def _serve(args, timeout=120):
    return subprocess.run([sys.executable, "-m", "ninfer_core.cli", "serve", *args, "--port", "0"],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flags, message", [
    (["--devices", "cpu"], "--devices lists 1 device; a pipeline has 2 to 8 stages"),
    (["--devices", ",".join(["cpu"] * 9)], "--devices lists 9 devices"),
    (["--devices", "cpu,cpu", "--stage-layers", "2,3"], "--stage-layers adds up to 5 layers; the model has 6"),
    (["--devices", "cpu,cpu,cpu", "--stage-layers", "3,3"], "--stage-layers lists 2 counts for 3 devices"),
    (["--stage-layers", "3,3"], "--stage-layers needs --devices"),
])
def test_serve_refuses_a_bad_split_before_loading(artifact, flags, message):
    r = _serve([str(artifact), *flags])
    assert r.returncode == 1, r.stderr
    assert f"error: {message}" in r.stderr


def test_serve_devices_cpu_cpu_answers_as_one_device_and_reuses_the_context(tiny_artifact, start_server):
    openai = pytest.importorskip("openai")
    piped = start_server("--devices", "cpu,cpu")
    root = start_server("--no-prefix-reuse")
    assert "pipeline of 2 stages (gloo)" in piped.log()

    def two_turns(server):
        client = openai.OpenAI(base_url=server.api_base, api_key="none")
        model = client.models.list().data[0].id
        msgs = [{"role": "user", "content": "Tell me a short story about a cat and a lamp."}]
        out = []
        for follow_up in ("And then what happened to the lamp?", None):
            r = client.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0)
            m = r.choices[0].message
            text = (m.content or "", (m.model_extra or {}).get("reasoning_content") or "")
            out.append((text, r.usage.prompt_tokens_details.cached_tokens))
            if follow_up is None:
                break
            msgs += [{"role": "assistant", "content": m.content or ""}, {"role": "user", "content": follow_up}]
        return out

    got, want = two_turns(piped), two_turns(root)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert any("".join(t) for t, _ in got)  # the turns produced text
    assert got[1][1] > 0 and want[1][1] == 0  # the second turn restored a checkpoint across both stages


@pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast_path"])
def test_stages_chained_in_process_give_the_whole_models_bits(artifact, fast):
    """The family's stage contract alone: three stage runners chained by hand (the fast path's
    fused add + norm at a stage boundary included) give exactly the whole model's logits."""
    from ninfer_qwen35.family import Qwen35Family
    from ninfer_qwen35.gpu.runner import GpuQwen35Runner

    fam, art = Qwen35Family(), Artifact.open(artifact)
    whole = fam.load(art, "cpu")
    stages = [fam.load_stage(art, r, "cpu") for r in (range(0, 2), range(2, 5), range(5, 6))]
    if fast:
        whole = GpuQwen35Runner.from_runner(whole, cuda_graph=False)
        stages = [GpuQwen35Runner.from_runner(s, cuda_graph=False) for s in stages]
    assert stages[0].model.norm is None and stages[-1].model.embed_tokens is None
    for r in (whole, *stages):
        r.allocate_cache(8, 3)
    tb = {"full_attention": [0, 1, 2]}

    def chained(batch):
        h = None
        for s in stages:
            h = s.forward_stage(batch, h)
        return h

    for batch in (ForwardBatch([LaneSegment(0, tb, 0, PROMPTS[0], PREFILL, snapshot=(30, 2))]),
                  ForwardBatch([LaneSegment(0, tb, len(PROMPTS[0]), [9], DECODE),
                                LaneSegment(2, tb, 30, [7], DECODE)])):
        for x, y in zip(whole.forward(batch), chained(batch)):
            assert torch.equal(x.logits, y.logits)
