"""Exactness of prefix reuse with the real Qwen3.5 CPU model (tiny random artifact).

Greedy output of a turn served from each checkpoint kind equals the same prompt served from root
by a root-only engine over the same weights; chat prompts are rendered by the project's template so
the engine derives the turn closure, message boundaries and stable prefix itself. Every test ends
with the pool accounting audited and back to idle once the catalog is cleared.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ninfer_qwen35")

from qwen_format import QWEN35_TEMPLATE, with_format

from ninfer_core.artifact import Artifact
from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.checkpoints import CheckpointHints
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.model_api import SeqView
from ninfer_core.engine.pages import pages_for
from ninfer_core.testing import collect, run_async
from ninfer_core.tokenizer import Tokenizer
from ninfer_core.tokenizer.chat_template import ChatTemplate

GREEDY = SamplingParams(temperature=0.0)
TEMPLATE = ChatTemplate(QWEN35_TEMPLATE)
SYSTEM = "You are a careful assistant. Answer briefly and cite the tool output when you use it."


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from ninfer_qwen35.family import Qwen35Family
    from ninfer_qwen35.testing import build_tiny_artifact, minimal_tokenizer_section

    section = minimal_tokenizer_section()
    path = build_tiny_artifact(tmp_path_factory.mktemp("cache") / "tiny.ninfer", seed=5,
                               tokenizer_section=section)
    art = Artifact.open(path)
    return art, Qwen35Family(), with_format(Tokenizer.from_section(section))


_engines: list[Engine] = []
SPEC = {"mode": "plain"}  # the drafter every engine of the current test runs with (root never drafts)


@pytest.fixture(autouse=True, params=["plain", "mtp", "oracle"])
def _shutdown(request):
    """Every test runs three times: without speculation, with the MTP backend (the random head's
    drafts are mostly rejected) and with an oracle drafter (the target's own greedy continuation,
    corrupted at 0.3: long accepted runs); outputs are compared with a root-only plain engine."""
    if request.param == "mtp":
        pytest.importorskip("ninfer_spec_mtp")
    SPEC["mode"] = request.param
    yield
    SPEC["mode"] = "plain"
    counters = [e.snapshot()["counters"] for e in _engines]
    while _engines:
        _engines.pop().shutdown(timeout=60)
    if request.param != "plain" and counters:  # the drafts were really verified (and some accepted)
        assert sum(c["draft_tokens"] for c in counters) > 0
        if request.param == "oracle":
            assert sum(c["draft_accepted_tokens"] for c in counters) > 0


def _drafter(model, runner):
    import argparse

    art, fam, _ = model
    if SPEC["mode"] == "mtp":
        from ninfer_spec_mtp.backend import MtpBackend

        return MtpBackend.load(runner, art, argparse.Namespace(draft_tokens=3))
    if SPEC["mode"] == "oracle":
        from ninfer_core.testing import OracleDrafter, runner_continuation

        return OracleDrafter(runner_continuation(fam.load(art), 128), draft_tokens=4, corrupt=0.3,
                             vocab_size=runner.info.vocab_size, seed=1)
    return None


def engine(model, reuse=True, spec=True, **opts) -> Engine:
    art, fam, tok = model
    runner = fam.load(art)
    eng = Engine(runner, tok, EngineOptions(**{"max_context": 2048, "prefill_chunk": 64,
                                               "prefix_reuse": reuse, **opts}),
                 spec=_drafter(model, runner) if spec else None)
    _engines.append(eng)
    eng.start()
    return eng


def run(eng, prompt, hints=None, max_tokens=8):
    async def go():
        return await collect(eng.submit(GenerationRequest(prompt_ids=list(prompt), sampling=GREEDY,
                                                          max_tokens=max_tokens, checkpoint_hints=hints,
                                                          logprobs=5)))

    out = run_async(go(), timeout=300)
    assert out.finish is not None, out.events
    return out


class Tokens(list):
    """Greedy output ids, with each position's log probability and top-5 alternatives."""

    lps: list


def tokens_of(out) -> Tokens:
    t = Tokens(out.token_ids)
    t.lps = [lp for e in out.events if e.kind == "delta" for lp in (e.logprobs or [])]
    return t


def assert_same(out, want: Tokens, tol: float = 2e-3):
    """Equal greedy ids, and equal log probabilities at every position: a wrong recurrent state can
    leave a tiny random model's greedy ids unchanged, but not its distributions."""
    got = tokens_of(out)
    assert list(got) == list(want)
    assert len(got.lps) == len(want.lps) == len(want)
    for a, b in zip(got.lps, want.lps):
        assert abs(a.logprob - b.logprob) <= tol, (a, b)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) <= tol, (a.top, b.top)


@pytest.fixture(scope="module")
def root(model):
    """root(prompt) -> greedy output ids (with their logprobs) of a root-only engine (memoised)."""
    eng = engine(model, reuse=False, spec=False)
    _engines.remove(eng)  # module-scoped: outlives the per-test shutdown
    memo: dict = {}

    def serve(prompt, max_tokens=8):
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            memo[key] = tokens_of(run(eng, prompt, max_tokens=max_tokens))
        return memo[key]

    yield serve
    eng.shutdown(timeout=60)


def chat(tok, messages) -> list[int]:
    return tok.encode(TEMPLATE.render(messages, add_generation_prompt=True, enable_thinking=False))


def source_delta(eng, before):
    now = eng.snapshot()["context_cache"]["selections"]
    changed = [k for k in now if now[k] != before[k]]
    assert len(changed) == 1, (before, now)
    return changed[0]


def sel(eng):
    return dict(eng.snapshot()["context_cache"]["selections"])


def idle(eng):
    with eng._cv:
        eng.cache.audit([])
    eng.run_control(eng.cache.clear).result(60)
    snap = eng.snapshot()
    assert snap["pages_free"] == snap["pages_total"] and snap["slots_free"] == snap["slots_total"]
    cc = snap["context_cache"]
    assert cc["device_state_slots_used"] == cc["host_state_slots_used"] == cc["checkpoints"] == 0


def test_every_checkpoint_kind_matches_root(model, root):
    tok = model[2]
    eng = engine(model)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a paged KV cache?"}]
    p1 = chat(tok, msgs)
    o1 = run(eng, p1)
    assert_same(o1, root(p1))

    # private_endpoint: the next turn appends to the exact executed tokens.
    p2 = p1 + o1.token_ids + chat(tok, [{"role": "user", "content": "And a state slot?"}])[-40:]
    s = sel(eng)
    o2 = run(eng, p2)
    assert source_delta(eng, s) == "private_endpoint"
    assert o2.finish.usage.cached_tokens == len(p1) + len(o1.token_ids) - 1
    assert_same(o2, root(p2))

    # private_turn_closure: regenerate the first reply (same prompt).
    s = sel(eng)
    o1b = run(eng, p1)
    assert source_delta(eng, s) == "private_turn_closure"
    assert o1b.token_ids == o1.token_ids

    # private_long_anchor: the endpoint kept as an endpoint anchor, then a different reply to it.
    p3 = p1 + o1.token_ids[:-1] + chat(tok, [{"role": "user", "content": "x"}])[-12:]
    s = sel(eng)
    o3 = run(eng, p3)
    assert source_delta(eng, s) in ("private_long_anchor", "private_endpoint")
    assert_same(o3, root(p3))

    # shared_stable_prefix: two more conversations over the same system prompt.
    q1 = chat(tok, [msgs[0], {"role": "user", "content": "Define recurrent state."}])
    q2 = chat(tok, [msgs[0], {"role": "user", "content": "Define prefix reuse, please."}])
    run(eng, q1)  # second sighting of the system prompt: captured and published
    s = sel(eng)
    o_q2 = run(eng, q2)
    assert source_delta(eng, s) == "shared_stable_prefix"
    assert_same(o_q2, root(q2))
    idle(eng)


def test_marker_anchor_and_host_tier_match_root(model, root):
    tok = model[2]
    eng = engine(model, device_state_slots=1, host_state_slots=16, max_private_continuations=6)
    base = chat(tok, [{"role": "user", "content": "Summarise the design of a checkpoint catalog " * 3}])
    mark = len(base) // 2
    run(eng, base, hints=CheckpointHints(markers=[mark]))
    p = base[:mark] + tok.encode(" then rewrite history")
    s = sel(eng)
    o = run(eng, p, hints=CheckpointHints())
    assert source_delta(eng, s) == "private_long_anchor"
    assert o.finish.usage.cached_tokens == mark
    assert_same(o, root(p))
    # More conversations than Device slots: images are demoted to Host and restored from there.
    convs = [chat(tok, [{"role": "user", "content": f"Question number {i} about caches?"}]) for i in range(3)]
    outs = [run(eng, c) for c in convs]
    assert eng.snapshot()["context_cache"]["host_state_slots_used"] > 0
    for c, o in zip(convs, outs):
        nxt = c + o.token_ids + tok.encode(" more")
        s = sel(eng)
        assert_same(run(eng, nxt), root(nxt))
        assert source_delta(eng, s) == "private_endpoint"
    assert eng.snapshot()["context_cache"]["transfer_bytes"]["state_h2d"] > 0
    idle(eng)


def test_host_kv_tier_matches_root(model, root):
    tok = model[2]
    # Six pages: the third conversation moves the first one's KV pages to Host memory.
    eng = engine(model, kv_capacity=6 * 64, max_private_continuations=6)
    convs = [chat(tok, [{"role": "user", "content": f"Topic {i}: " + "paged attention and recurrent state " * 3}])
             for i in range(3)]
    assert all(129 <= len(c) <= 180 for c in convs)
    outs = [run(eng, c) for c in convs]
    cc = eng.snapshot()["context_cache"]
    assert cc["host_kv_bytes_used"] > 0 and cc["transfer_bytes"]["main_kv_d2h"] > 0
    nxt = convs[0] + outs[0].token_ids + tok.encode(" go on")
    s = sel(eng)
    o = run(eng, nxt)
    assert source_delta(eng, s) == "private_endpoint"
    assert eng.snapshot()["context_cache"]["transfer_bytes"]["main_kv_h2d"] > 0
    assert_same(o, root(nxt))
    idle(eng)


def test_disk_tier_restore_and_a_corrupt_page_match_root(model, root, tmp_path):
    import os

    from ninfer_core.engine.cache_disk import prefix_digests

    tok = model[2]
    opts = {"max_private_continuations": 1, "disk_kv_path": str(tmp_path), "disk_kv_restore": True,
            "disk_kv_model": "tiny"}
    eng = engine(model, **opts)
    a = chat(tok, [{"role": "user", "content": "Explain the disk tier of a context cache " * 3}])
    out = run(eng, a)
    run(eng, chat(tok, [{"role": "user", "content": "Something else entirely."}]))  # evicts A to disk
    eng.cache.disk.flush(60)
    nxt = a + out.token_ids + tok.encode(" continue")
    s = sel(eng)
    o = run(eng, nxt)
    assert source_delta(eng, s) == "private_endpoint"
    assert o.finish.usage.cached_tokens == len(a) + len(out.token_ids) - 1
    assert_same(o, root(nxt))
    idle(eng)  # nothing resident any more; the files stay
    # One corrupted page file: the restore misses and the prompt is recomputed, same output.
    dig = prefix_digests(nxt, {64})[64]
    page = eng.cache.disk.pages[dig].path
    with open(page, "rb") as fh:
        data = bytearray(fh.read())
    data[-3] ^= 0x55
    with open(page, "wb") as fh:
        fh.write(bytes(data))
    s = sel(eng)
    o = run(eng, nxt)
    assert source_delta(eng, s) == "root"
    assert_same(o, root(nxt))
    assert eng.snapshot()["context_cache"]["disk"]["crc_failures"] == 1 and not os.path.exists(page)
    idle(eng)


def test_salvaged_cancelled_prefill_matches_root(model, root):
    import asyncio
    import threading

    tok = model[2]
    eng = engine(model, prefill_chunk=32)
    p = chat(tok, [{"role": "user", "content": "A long question about salvaging cancelled prefills " * 4}])
    assert len(p) > 100
    real = eng.runner.forward
    entered, gate = threading.Event(), threading.Event()

    def held(batch):  # hold the third prefill chunk until the cancel is in
        seg = batch.segments[0]
        if seg.kind == "prefill" and seg.start >= 64 and not gate.is_set():
            entered.set()
            gate.wait(60)
        return real(batch)

    eng.runner.forward = held

    async def go():
        h = eng.submit(GenerationRequest(prompt_ids=list(p), sampling=GREEDY, max_tokens=8))
        await asyncio.to_thread(entered.wait, 60)
        h.cancel()
        gate.set()
        return await collect(h)

    out = run_async(go(), timeout=300)
    assert out.finish.finish_reason == "cancelled"
    cc = eng.snapshot()["context_cache"]
    assert cc["salvage"]["cancelled_prefills_salvaged"] == 1
    (cont,) = [c for c in eng.cache.continuations if c is not None]
    assert len(cont.session) == 96 and cont.session == tuple(p[:96])
    s = sel(eng)
    o = run(eng, p)
    assert source_delta(eng, s) == "private_endpoint" and o.finish.usage.cached_tokens == len(cont.session)
    assert_same(o, root(p))
    idle(eng)


def test_planner_degrade_to_turn_closure_matches_root(model, root):
    tok = model[2]
    # No Host KV and a small pool: the next conversation needs pages, and the planner drops only the
    # first one's endpoint, keeping its turn closure.
    eng = engine(model, kv_capacity=7 * 64, max_context=7 * 64, max_private_continuations=4, host_kv_mib=0)
    a = chat(tok, [{"role": "user", "content": "Tell me about cost based eviction " * 4}])
    out = run(eng, a, max_tokens=80)  # closure near 155 (3 pages), endpoint near 239 (4 pages)
    assert len(out.token_ids) == 80
    b = chat(tok, [{"role": "user", "content": "Another topic that needs a few more pages of prompt " * 4}])
    assert pages_for(len(b) + 8) == 4  # 3 pages free: one more is needed
    run(eng, b, max_tokens=8)
    cc = eng.snapshot()["context_cache"]["pressure"]
    assert cc["checkpoint_dropped"] == 1 and cc["private_owner_evicted"] == 0
    # The regenerate of A needs one more page: resuming at A's closure would evict B (its closure
    # and endpoint, ~450 tokens to rebuild) to save ~140 tokens of prefill, so admission prices the
    # reuse out (a degradation to root) and drops A's closure instead; B stays resident.
    with eng._cv:
        closure = next(e.ckpt.frontier for c in eng.cache.continuations if c is not None
                       for e in c.entries if e.kind == "turn_closure" and e.ckpt.matches(a))
    s = sel(eng)
    o = run(eng, a, max_tokens=8)
    assert source_delta(eng, s) == "root"
    mat = o.finish.context["materialization"]
    assert mat["best_reuse_prompt_tokens"] == mat["degradation_tokens"] == closure and mat["resume_tokens"] == 0
    assert eng.snapshot()["context_cache"]["degraded_admissions"] == 1
    assert o.token_ids == out.token_ids[:8]
    assert_same(o, root(a))
    s = sel(eng)
    assert_same(run(eng, b, max_tokens=8), root(b))  # B was kept: its regenerate resumes
    assert source_delta(eng, s) == "private_turn_closure"
    idle(eng)


def test_capture_inside_a_chunk_with_the_gpu_runner_matches_root(model):
    """The GPU runner's one-forward snapshot (prefill_with_snapshot): the turn closure and the
    shared prefix are captured inside prefill chunks (no split forward), and turns served from
    them equal root on the same runner (its CPU path)."""
    from ninfer_qwen35.gpu.runner import GpuQwen35Runner

    art, fam, tok = model

    def gpu_engine(reuse):
        runner = GpuQwen35Runner.from_runner(fam.load(art))
        eng = Engine(runner, tok, EngineOptions(max_context=2048, prefill_chunk=48, prefix_reuse=reuse),
                     spec=_drafter(model, runner) if reuse else None)
        _engines.append(eng)
        eng.start()
        return eng

    eng, base = gpu_engine(True), gpu_engine(False)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a paged KV cache?"}]
    p1 = chat(tok, msgs)
    o1 = run(eng, p1)
    assert_same(o1, tokens_of(run(base, p1)))
    assert eng.snapshot()["context_cache"]["captures_in_chunk"] >= 1
    # the captured state is the state of the frontier: the same tokens prefilled on the root
    # engine's runner (its lane slot and last pages, unused while it is idle) give it
    with eng._cv:
        ckpts = [e.ckpt for _, e in eng.cache._all_entries() if e.ckpt.device_slot is not None]
    ck = max(ckpts, key=lambda c: c.frontier)
    assert 0 < ck.frontier < len(p1) and ck.frontier % 48, ck.frontier  # inside a chunk

    def fresh_state():
        r = base.runner
        n = pages_for(ck.frontier, 64)
        view = SeqView(0, list(range(r.num_pages - n, r.num_pages)), 0)
        r.reset_slot(0)
        hidden = r.forward_hidden([view], [list(ck.tokens)])[-1]
        return {i: t[0].clone() for i, t in r.cache.ssm.items()}, hidden

    want, hidden = base.run_control(fresh_state).result(60)
    for i, t in want.items():
        torch.testing.assert_close(eng.runner.cache.ssm[i][ck.device_slot], t, rtol=1e-4, atol=1e-5)
    if eng.runner.cache.hidden is not None:  # with the MTP head: the frontier's target hidden too
        torch.testing.assert_close(eng.runner.cache.hidden[ck.device_slot], hidden, rtol=1e-4, atol=1e-5)
    s = sel(eng)
    o1b = run(eng, p1)  # regenerate: from the turn closure captured inside a chunk
    assert source_delta(eng, s) == "private_turn_closure"
    assert_same(o1b, tokens_of(o1))
    q1 = chat(tok, [msgs[0], {"role": "user", "content": "Define recurrent state."}])
    q2 = chat(tok, [msgs[0], {"role": "user", "content": "Define prefix reuse, please."}])
    run(eng, q1)
    s = sel(eng)
    o_q2 = run(eng, q2)
    assert source_delta(eng, s) == "shared_stable_prefix"
    assert_same(o_q2, tokens_of(run(base, q2)))
    idle(eng)
