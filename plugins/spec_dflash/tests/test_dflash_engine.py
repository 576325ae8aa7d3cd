"""Greedy output with `--spec dflash` / `--spec dflash2` (K = 7 and 15) equals the output without,
through the engine on a random-weight Qwen3.5 artifact with random drafters converted from
checkpoints in the published layout: single lanes, mixed batches ending inside rounds, prefix reuse
(the reused positions' context is absent), sampled requests token for token. The drafter's context
follows the target: what the backend keeps equals the drafter over the target's own hidden states."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("ninfer_qwen35")

import torch
from ninfer_qwen35.family import Qwen35Family
from ninfer_qwen35.gpu.runner import GpuQwen35Runner
from ninfer_qwen35.testing import build_tiny_artifact
from ninfer_spec_dflash.backend import DFlash2Backend, DFlashBackend
from ninfer_spec_dflash.testing import random_drafter_checkpoint

from ninfer_core.artifact import Artifact
from ninfer_core.cli import main as cli
from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.model_api import PREFILL, ForwardBatch, LaneSegment
from ninfer_core.testing import collect, run_async

GREEDY = SamplingParams(temperature=0.0)
BACKENDS = {"dflash": DFlashBackend, "dflash2": DFlash2Backend}


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    d = tmp_path_factory.mktemp("dfl")
    base = build_tiny_artifact(d / "t.ninfer", seed=31)
    for kind in BACKENDS:
        random_drafter_checkpoint(d / kind, kind, 64, 512, [1, 3], seed=4)
    assert cli(["convert", str(base), str(d / "t2.ninfer"), "--dflash", str(d / "dflash"),
                "--dflash2", str(d / "dflash2"), "--no-progress"]) == 0
    return Artifact.open(d / "t2.ninfer")


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


def prompts(n=3):
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, 500, (70,), generator=g).tolist()
    return [base[: 8 + 25 * i] for i in range(n)]  # the third crosses the 32-token prefill chunk twice


def serve(art, reqs, spec=None, k=7, concurrent=False, gpu=False, **opts):
    r = Qwen35Family().load(art)
    if gpu:  # the GPU runner's path (its CPU fallbacks): layer outputs from its fused decode/verify bodies
        r = GpuQwen35Runner.from_runner(r)
    backend = BACKENDS[spec].load(r, art, argparse.Namespace(draft_tokens=k)) if spec else None

    async def go():
        eng = Engine(r, _Tok(), EngineOptions(**{"max_context": 512, "prefill_chunk": 32, **opts}), spec=backend)
        eng.start()
        try:
            if concurrent:
                hs = [eng.submit(q) for q in reqs]
                outs = [await collect(h) for h in hs]
            else:
                outs = [await collect(eng.submit(q)) for q in reqs]
            return outs, eng.snapshot()
        finally:
            eng.shutdown(timeout=60)

    return run_async(go(), timeout=600)


def reqs(n=24, **kw):
    return [GenerationRequest(prompt_ids=p, sampling=GREEDY, max_tokens=n, **kw) for p in prompts()]


@pytest.fixture(scope="module")
def plain(art):
    return [o.token_ids for o in serve(art, reqs())[0]]


@pytest.mark.parametrize("k", [7, 15])
@pytest.mark.parametrize("spec", ["dflash", "dflash2"])
def test_greedy_output_equals_plain(art, plain, spec, k):
    got, snap = serve(art, reqs(), spec=spec, k=k)
    assert [o.token_ids for o in got] == plain
    assert snap["counters"]["draft_tokens"] > 0


@pytest.mark.parametrize("gpu", [False, True])
@pytest.mark.parametrize("spec", ["dflash", "dflash2"])
def test_mixed_batch_ending_inside_rounds(art, spec, gpu):
    lens = [5, 13, 22]
    rs = [GenerationRequest(prompt_ids=p, sampling=GREEDY, max_tokens=n) for p, n in zip(prompts(), lens)]
    base, _ = serve(art, rs, max_concurrency=3, concurrent=True, gpu=gpu)
    got, _ = serve(art, rs, spec=spec, k=7, max_concurrency=3, concurrent=True, gpu=gpu)
    assert [o.token_ids for o in got] == [o.token_ids for o in base]
    assert [len(o.token_ids) for o in got][:2] == lens[:2]  # (the third meets the model's EOS id first)


def test_sampled_requests_are_token_for_token_the_same(art):
    s = SamplingParams(temperature=0.8, top_p=0.9, seed=77)
    rs = [GenerationRequest(prompt_ids=p, sampling=s, max_tokens=20) for p in prompts()]
    base, _ = serve(art, rs)
    for spec in BACKENDS:
        got, _ = serve(art, rs, spec=spec, k=7)
        assert [o.token_ids for o in got] == [o.token_ids for o in base]


def test_context_equals_the_drafter_over_the_targets_hidden_states(art):
    """After a prefill and rounds, the backend's context rows for each position are the drafter's
    K/V of the target's layer outputs at that position, computed here by one reference prefill."""
    r = Qwen35Family().load(art)
    backend = DFlashBackend.load(r, art, argparse.Namespace(draft_tokens=7))
    captured = {}
    orig = backend.lane_finished
    backend.lane_finished = lambda rid: (captured.setdefault(rid, backend.context_rows(rid)), orig(rid))

    async def go():
        eng = Engine(r, _Tok(), EngineOptions(max_context=512, prefill_chunk=32), spec=backend)
        eng.start()
        try:
            return await collect(eng.submit(GenerationRequest(prompt_ids=prompts()[2], sampling=GREEDY,
                                                              max_tokens=20)))
        finally:
            eng.shutdown(timeout=60)

    out = run_async(go(), timeout=600)
    (ctx,) = [c for c in captured.values() if c is not None]
    seq = list(prompts()[2]) + list(out.token_ids)
    ref = Qwen35Family().load(art)
    ref.allocate_cache(8, 1)
    n = ctx["n"]
    assert len(prompts()[2]) < n < len(seq)  # the prompt and the rounds' committed rows
    hid = ref.forward(ForwardBatch([LaneSegment(0, {g: list(range(8)) for g in ref.cache_spec().group_names}, 0,
                                                seq[:n], PREFILL, "none", backend.target_layers)]))[0].hidden
    feats = torch.cat([hid[i] for i in backend.cfg.target_layer_ids], -1)
    kv = backend.drafter.context_kv(backend.drafter.context(feats), torch.arange(n))
    assert bool(ctx["valid"][:n].all())
    for i, (k, v) in enumerate(kv):
        torch.testing.assert_close(ctx["k"][i][:n], k, atol=2e-4, rtol=1e-3)
        torch.testing.assert_close(ctx["v"][i][:n], v, atol=2e-4, rtol=1e-3)


def test_prefix_reuse_keeps_greedy_output(art):
    """A second turn reuses the first's prefix from the context cache (its positions never run in
    the second request's forwards, so their context rows are absent): output is still plain's."""
    first = prompts()[2]
    one = GenerationRequest(prompt_ids=first, sampling=GREEDY, max_tokens=12)
    follow = first + list(serve(art, [one])[0][0].token_ids) + [7, 8, 9, 10]
    rs = [one, GenerationRequest(prompt_ids=follow, sampling=GREEDY, max_tokens=12)]
    base, _ = serve(art, rs, prefix_reuse=True)
    got, snap = serve(art, rs, spec="dflash2", k=7, prefix_reuse=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in base]
    assert snap["counters"]["prefix_cache_hit_tokens"] > 0


def eight_prompts():
    g = torch.Generator().manual_seed(9)
    return [torch.randint(0, 500, (6 + 9 * i,), generator=g).tolist() for i in range(8)]


@pytest.mark.parametrize("gpu", [False, True])
@pytest.mark.parametrize("spec", ["dflash", "dflash2"])
def test_eight_concurrent_greedy_requests_equal_each_alone(art, spec, gpu):
    """8 concurrent greedy requests with the drafter equal plain decoding of each request alone
    (the H200 run of 2026-12-02 had one of 8 part: the layer outputs the drafter asks for sent the
    GPU runner's prefill down the reference path and its decode/verify out of their graphs)."""
    rs = [GenerationRequest(prompt_ids=p, sampling=GREEDY, max_tokens=20) for p in eight_prompts()]
    alone, _ = serve(art, rs, gpu=gpu)
    got, snap = serve(art, rs, spec=spec, k=7, max_concurrency=8, concurrent=True, gpu=gpu)
    assert [o.token_ids for o in got] == [o.token_ids for o in alone]
    assert snap["counters"]["draft_tokens"] > 0


def test_layer_outputs_never_change_the_gpu_runners_numbers(art):
    """Asking a forward for layer outputs (the drafter's context) leaves the GPU runner's logits the
    same bits (its CPU fallbacks here): prefill, decode and verify take the same paths with or
    without them, and the layer outputs equal the reference runner's."""
    from ninfer_core.engine.model_api import DECODE, VERIFY

    def run(taps):
        r = GpuQwen35Runner.from_runner(Qwen35Family().load(art))
        r.allocate_cache(16, 2)
        tables = {g: list(range(4)) for g in r.cache_spec().group_names}
        ids = prompts()[2][:40]
        outs = [r.forward(ForwardBatch([LaneSegment(0, tables, 0, ids, PREFILL, "last", taps)]))[0],
                r.forward(ForwardBatch([LaneSegment(0, tables, 40, [5], DECODE, "last", taps)]))[0],
                r.forward(ForwardBatch([LaneSegment(0, tables, 41, [6, 7, 8], VERIFY, "all", taps)]))[0]]
        r.commit([(0, 2)])
        return outs

    plain, tapped = run(()), run((1, 3))
    for a, b in zip(plain, tapped):
        assert torch.equal(a.logits, b.logits)
        assert set(b.hidden) == {1, 3} and not a.hidden
    ref = Qwen35Family().load(art)
    ref.allocate_cache(8, 1)
    tables = {g: list(range(4)) for g in ref.cache_spec().group_names}
    want = ref.forward(ForwardBatch([LaneSegment(0, tables, 0, prompts()[2][:40], PREFILL, "last", (1, 3))]))[0]
    for layer in (1, 3):
        assert tapped[0].hidden[layer].shape == (40, 64)
        torch.testing.assert_close(tapped[0].hidden[layer], want.hidden[layer], atol=1e-4, rtol=1e-4)
    assert tapped[1].hidden[1].shape == (1, 64) and tapped[2].hidden[3].shape == (3, 64)


@pytest.mark.parametrize("spec", ["dflash", "dflash2"])
def test_eight_concurrent_chat_requests_on_ninfer_tiny_equal_each_alone(spec):
    """The trained ninfer-tiny with its shipped drafters through the GPU runner's path (its CPU
    fallbacks): 8 chat requests at once with the drafter, each request's plain output alone."""
    tiny = pytest.importorskip("ninfer_tiny.plugin")
    if tiny.packaged_artifact() is None:
        pytest.skip("no packaged ninfer-tiny artifact")
    from ninfer_core.tokenizer import Tokenizer
    from ninfer_core.tokenizer.chat_template import ChatTemplate

    art = Artifact.open(tiny.packaged_artifact())
    tok = Tokenizer.from_section(art.tokenizer_section)
    tpl = ChatTemplate(art.chat_template)
    qs = ["What is 38 + 47?", "Hello", "What is your name?", "Count from 3 to 9.", "What is 61 + 29?",
          "What is 17 + 25?", "Count from 1 to 12.", "What is 90 + 9?"]
    rs = [GenerationRequest(prompt_ids=tok.encode(tpl.render([{"role": "user", "content": q}])), sampling=GREEDY,
                            max_tokens=48) for q in qs]

    def run(backend_kind, lanes, concurrent):
        r = GpuQwen35Runner.from_runner(Qwen35Family().load(art))
        backend = BACKENDS[backend_kind].load(r, art, argparse.Namespace(draft_tokens=7)) if backend_kind else None

        async def go():
            eng = Engine(r, tok, EngineOptions(max_context=1024, max_concurrency=lanes, ngram_draft_tokens=0),
                         spec=backend)
            eng.start()
            try:
                if concurrent:
                    hs = [eng.submit(q) for q in rs]
                    outs = [await collect(h) for h in hs]
                else:
                    outs = [await collect(eng.submit(q)) for q in rs]
                return [o.token_ids for o in outs], eng.snapshot()["counters"]
            finally:
                eng.shutdown(timeout=60)

        return run_async(go(), timeout=600)

    alone, _ = run(None, 1, False)
    got, c = run(spec, 8, True)
    assert got == alone
    assert c["draft_accepted_tokens"] > 0
