"""Model suspend on the CPU reference path (ninfer_core.router.residency), without a server.

- The snapshot skips free KV pages: on the toy runner (whose logits read the whole prefix back out
  of the KV pages and check it against the state slot, so a page restored to the wrong place or not
  at all raises), the host snapshot holds exactly the state storage plus the pages in use, and the
  retained conversations reuse their prefixes after the resume with the same greedy output.
- --suspend-weights artifact: with a bf16 artifact the CPU model's weights are float32 copies; a
  suspend drops them from memory without copying them, a resume reads them again from the file
  (fused MoE experts and all), and greedy output and prefix reuse after waking equal those before.
- --suspend-weights host keeps them in the snapshot; a weight that is not a run of artifact
  tensors goes to the snapshot in artifact mode too.
"""

from __future__ import annotations

import pytest
import torch

from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.router.residency import Residency
from ninfer_core.router.storages import owned_storages, storage_key, used_pages
from ninfer_core.router.weights import ArtifactWeights
from ninfer_core.testing import ToyRunner, ToyTokenizer, collect, run_async

GREEDY = SamplingParams(temperature=0.0)
_engines: list[Engine] = []


@pytest.fixture(autouse=True)
def _shutdown():
    yield
    while _engines:
        _engines.pop().shutdown(timeout=60)


def start(runner, tokenizer, **opts) -> Engine:
    eng = Engine(runner, tokenizer, EngineOptions(**{"max_context": 1024, "prefill_chunk": 64,
                                                     "prefix_reuse": True, **opts}))
    _engines.append(eng)
    eng.start()
    return eng


def run(eng: Engine, prompt, max_tokens=8):
    async def go():
        return await collect(eng.submit(GenerationRequest(prompt_ids=list(prompt), sampling=GREEDY,
                                                          max_tokens=max_tokens)))

    out = run_async(go(), timeout=300)
    assert out.finish is not None and out.finish.kind == "finish", out.events
    return out


def test_the_snapshot_holds_only_the_kv_pages_in_use():
    runner = ToyRunner()
    eng = start(runner, ToyTokenizer(), kv_capacity=16 * 64)
    prompts = [list(range(1, 150)), list(range(200, 260))]
    first = [run(eng, p) for p in prompts]
    live = used_pages(eng)
    assert 0 < len(live) < 16  # retained conversations hold some pages, most are free
    res = Residency(eng, weights="host")
    resident = res.report()
    kv_bytes = runner.kv.untyped_storage().nbytes()
    # the state slots and the toy's own small tables: everything but the pages is copied whole
    state_bytes = sum(h.nbytes for h in owned_storages(eng) if h.paged is None)
    assert state_bytes >= runner.state.untyped_storage().nbytes()
    assert resident["releasable_device_bytes"] == kv_bytes + state_bytes
    page_bytes = runner.kv[0].numel() * runner.kv.element_size()
    report = res.suspend()
    assert report["state"] == "suspended" and report["device_bytes"] == 0
    # exactly the state slots plus the pages in use, counted in bytes: no free page is copied
    assert report["host_snapshot_bytes"] == state_bytes + len(live) * page_bytes < kv_bytes + state_bytes
    assert report["last_suspend"]["state_bytes"] == report["host_snapshot_bytes"]
    assert report["last_suspend"]["weight_bytes"] == 0
    assert all(h.storage.nbytes() == 0 for h in owned_storages(eng))
    back = res.resume()
    assert back["state"] == "resident" and back["device_bytes"] == kv_bytes + state_bytes
    assert back["host_snapshot_bytes"] == 0 and back["last_resume"]["state_bytes"] == report["host_snapshot_bytes"]
    free = [p for p in range(16) if p not in live]
    assert bool((runner.kv[free] == 0).all())  # free pages read as zeros, not stale bytes
    for p, before in zip(prompts, first):
        again = run(eng, p + before.token_ids + [7])  # the next turn resumes from the retained endpoint
        assert again.finish.usage.cached_tokens >= len(p)
    # a page the suspend skipped is allocated and written again like any free page
    fresh = run(eng, [(7 * i) % 250 + 1 for i in range(200)], max_tokens=16)
    assert fresh.finish.usage.completion_tokens == 16


@pytest.fixture(scope="module")
def bf16_moe(tmp_path_factory):
    pytest.importorskip("ninfer_qwen35")
    from ninfer_qwen35.testing import build_tiny_artifact, minimal_tokenizer_section

    from ninfer_core.artifact import Artifact
    from ninfer_core.tokenizer import Tokenizer

    section = minimal_tokenizer_section()
    # per-expert MoE weights: the loader fuses them, so a weight storage is a run of many tensors
    path = build_tiny_artifact(tmp_path_factory.mktemp("suspend") / "tiny-moe.ninfer", kind="moe",
                               expert_layout="per_expert", dtype=torch.bfloat16, seed=3,
                               tokenizer_section=section)
    return Artifact.open(path), Tokenizer.from_section(section)


def load(model):
    from ninfer_qwen35.family import Qwen35Family

    art, tok = model
    return start(Qwen35Family().load(art), tok)


PROMPT = [5, 9, 17, 33, 65, 129, 257, 3, 6, 12] * 8


def test_artifact_weights_leave_memory_and_come_back_from_the_file(bf16_moe):
    art, _ = bf16_moe
    eng = load(bf16_moe)
    before = run(eng, PROMPT, max_tokens=12)
    turn2 = PROMPT + before.token_ids + [11, 13]
    two = run(eng, turn2, max_tokens=12)
    assert two.finish.usage.cached_tokens > 0
    params = {storage_key(p.untyped_storage()): p.untyped_storage() for p in eng.runner.model.parameters()}
    weight_bytes = sum(s.nbytes() for s in params.values())
    assert weight_bytes > 0
    res = Residency(eng, weights="artifact", artifact=art)
    resident = res.report()
    assert resident["suspend_weights"] == "artifact"
    report = res.suspend()
    assert report["device_bytes"] == 0
    assert all(s.nbytes() == 0 for s in params.values())  # the weights are gone from memory
    # every parameter comes back from the artifact: none is in the snapshot (buffers computed at
    # load, such as the rotary table, are not artifact tensors and are kept)
    held = {storage_key(h.storage): h for h in res._held}
    assert all(held[k].from_artifact and held[k].snapshot is None for k in params)
    fused = [h for h in res._held if len(h.segments) > 1]
    assert fused, "the fused experts are runs of several artifact tensors"
    assert report["host_snapshot_bytes"] <= resident["releasable_device_bytes"] - weight_bytes
    assert report["last_suspend"]["weight_bytes"] == sum(
        h.snapshot.nbytes for h in res._held if h.weight and h.snapshot is not None)
    back = res.resume()
    read = sum(art.tensor_nbytes(s.name) for h in held.values() for s in h.segments)
    assert back["last_resume"]["artifact_read_bytes"] == read > 0
    assert back["last_resume"]["weight_bytes"] >= weight_bytes
    assert back["device_bytes"] == resident["device_bytes"]
    again = run(eng, turn2, max_tokens=12)
    assert again.token_ids == two.token_ids  # greedy: the same answer after waking
    assert again.finish.usage.cached_tokens == two.finish.usage.cached_tokens
    # a second sleep reuses the proven sources
    res.suspend()
    res.resume()
    assert run(eng, PROMPT, max_tokens=12).token_ids == before.token_ids


def test_host_weights_and_a_weight_the_artifact_cannot_give_back(bf16_moe):
    art, _ = bf16_moe
    eng = load(bf16_moe)
    before = run(eng, PROMPT, max_tokens=10)
    res = Residency(eng, weights="host", artifact=art)
    params = {storage_key(p.untyped_storage()): p.untyped_storage().nbytes() for p in eng.runner.model.parameters()}
    report = res.suspend()
    assert report["suspend_weights"] == "host"
    assert report["last_suspend"]["weight_bytes"] >= sum(params.values()) > 0
    assert all(h.snapshot is not None for h in res._held if storage_key(h.storage) in params)
    back = res.resume()
    assert back["last_resume"]["artifact_read_bytes"] == 0
    assert run(eng, PROMPT, max_tokens=10).token_ids == before.token_ids

    # a weight changed after the load is no run of artifact tensors: artifact mode keeps it
    eng2 = load(bf16_moe)
    norm = eng2.runner.model.layers[0].input_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach() + 0.5, requires_grad=False)
    out = run(eng2, PROMPT, max_tokens=10)
    res2 = Residency(eng2, weights="artifact", artifact=art)
    res2.suspend()
    held = {storage_key(h.storage): h for h in res2._held}
    flipped = held[storage_key(norm.weight.untyped_storage())]
    assert not flipped.from_artifact and flipped.snapshot is not None
    res2.resume()
    assert run(eng2, PROMPT, max_tokens=10).token_ids == out.token_ids


def test_locate_finds_runs_and_refuses_what_is_not_one(bf16_moe):
    art, _ = bf16_moe
    src = ArtifactWeights(art)
    names = [n for n in art.tensor_names() if art.get_tensor(n).numel() >= 64][:3]
    parts = [art.get_tensor(n).reshape(-1).to(torch.float32) for n in names]
    run_ = torch.cat(parts)
    segs = src.locate(run_.untyped_storage(), torch.float32)
    assert [s.name for s in segs] == names and [s.numel for s in segs] == [p.numel() for p in parts]
    assert [s.offset for s in segs] == [0, parts[0].numel(), parts[0].numel() + parts[1].numel()]
    # a reload writes the same bytes back
    copy = torch.zeros_like(run_)
    assert src.reload(copy.untyped_storage(), torch.float32, segs) == sum(art.tensor_nbytes(n) for n in names)
    assert torch.equal(copy, run_)
    changed = run_.clone()
    changed[-1] += 1.0
    assert src.locate(changed.untyped_storage(), torch.float32) == []
    assert src.locate(torch.randn(100).untyped_storage(), torch.float32) == []
    # a random-weights stand-in (no file) cannot be read back: artifact mode falls back to host
    assert not ArtifactWeights.usable(None)
    eng = start(ToyRunner(), ToyTokenizer())
    assert Residency(eng, weights="artifact", artifact=None).weights == "host"


def test_owned_storages_mark_page_tensors_only_when_the_runner_lists_them():
    runner = ToyRunner()
    eng = start(runner, ToyTokenizer())
    by_ptr = {storage_key(h.storage): h for h in owned_storages(eng)}
    assert by_ptr[storage_key(runner.kv.untyped_storage())].paged is runner.kv
    assert by_ptr[storage_key(runner.state.untyped_storage())].paged is None


def test_a_listed_tensor_that_is_not_one_row_per_page_is_copied_whole():
    runner = ToyRunner()
    eng = start(runner, ToyTokenizer(), kv_capacity=8 * 64)
    scale = torch.ones(3)  # shorter than the pool: not a page tensor, whatever the runner says
    runner.extra_scale = scale
    runner.kv_page_tensors = lambda: (runner.kv, scale)
    run(eng, list(range(1, 100)))
    by_ptr = {storage_key(h.storage): h for h in owned_storages(eng)}
    assert by_ptr[storage_key(scale.untyped_storage())].paged is None
    res = Residency(eng, weights="host")
    res.suspend()
    res.resume()
    assert torch.equal(scale, torch.ones(3))
