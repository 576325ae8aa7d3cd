"""--auto-save-evicted on the toy runner: a session bound to a slot file by a save is written back
there before an involuntary eviction, tracking the conversation's newest turn; a shallower copy, an
explicit erase and a superseded spill never write; the option's refusals."""

from __future__ import annotations

import argparse
import random
import threading

import pytest

from ninfer_core.config import EngineOptions
from ninfer_core.engine import cache_slots
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.cache_options import add_cache_arguments, apply_cache_arguments
from ninfer_core.engine.cache_spill import SlotSpiller
from ninfer_core.engine.checkpoints import Continuation
from ninfer_core.engine.engine import Engine
from ninfer_core.testing import ToyRunner, ToyTokenizer, collect, run_async

GREEDY = SamplingParams(temperature=0.0)
COMPAT = {"artifact": "toy", "kv_dtype": "bf16", "page_size": 64}


@pytest.fixture
def eng(tmp_path):
    e = Engine(ToyRunner(), ToyTokenizer(), EngineOptions(
        max_context=1024, prefill_chunk=64, prefix_reuse=True, max_private_continuations=1,
        slot_save_path=str(tmp_path), auto_save_evicted=True))
    e.start()
    yield e
    e.shutdown(timeout=30)


def run(eng, prompt, n=6):
    async def go():
        return await collect(eng.submit(GenerationRequest(prompt_ids=prompt, sampling=GREEDY, max_tokens=n)))

    out = run_async(go())
    assert out.finish is not None
    return out


def save(eng, tmp_path, slot, name):
    """What POST /slots/{id}?action=save does."""
    image = eng.run_control(lambda: cache_slots.collect(eng.cache, slot, None, COMPAT)).result(30)
    cache_slots.write_atomic(str(tmp_path), name, cache_slots.encode(image))
    with eng._cv:
        cache_slots.bind_file(eng.cache, slot, name, len(image.session), COMPAT)
    return image


def read(tmp_path, name):
    return cache_slots.decode((tmp_path / name).read_bytes(), COMPAT)


def root(prompt, n=6):
    e = Engine(ToyRunner(), ToyTokenizer(), EngineOptions(max_context=1024))
    e.start()
    try:
        return run(e, prompt, n).token_ids
    finally:
        e.shutdown(timeout=30)


def test_an_evicted_bound_session_is_written_back_with_its_newest_turn(eng, tmp_path):
    rng = random.Random(1)
    a = [rng.randrange(256) for _ in range(120)]
    out = run(eng, a)
    save(eng, tmp_path, 0, "conv.bin")
    a2 = a + out.token_ids + [rng.randrange(256) for _ in range(20)]
    out2 = run(eng, a2)  # extends the bound conversation: the binding follows it
    assert eng.cache.continuations[0].filename == "conv.bin"
    run(eng, [rng.randrange(256) for _ in range(90)])  # one cell: the bound session is evicted
    eng.cache.spiller.flush(30)
    image = read(tmp_path, "conv.bin")
    assert image.session == a2 + out2.token_ids
    assert eng.snapshot()["context_cache"]["auto_save"]["spills"] == 1
    # Restoring the spilled file resumes the newest turn exactly.
    eng.run_control(lambda: cache_slots.install(eng.cache, 0, image, "conv.bin", 0.0)).result(30)
    nxt = a2 + out2.token_ids + [7, 8]
    again = run(eng, nxt)
    assert again.finish.usage.cached_tokens == len(a2) + len(out2.token_ids) - 1
    assert again.token_ids == root(nxt)


def test_erase_never_writes_and_unbound_sessions_are_not_spilled(eng, tmp_path):
    a = list(range(10, 110))
    run(eng, a)
    save(eng, tmp_path, 0, "keep.bin")
    before = (tmp_path / "keep.bin").read_bytes()
    eng.run_control(lambda: cache_slots.erase(eng.cache, 0, None)).result(30)
    run(eng, list(range(20, 90)))  # unbound
    run(eng, list(range(30, 95)))  # evicts the unbound one
    eng.cache.spiller.flush(30)
    assert (tmp_path / "keep.bin").read_bytes() == before
    snap = eng.snapshot()["context_cache"]["auto_save"]
    assert snap["spills"] == 0


def test_a_shallower_copy_never_replaces_the_file(eng, tmp_path):
    a = list(range(40, 160))
    run(eng, a)
    image = save(eng, tmp_path, 0, "deep.bin")
    with eng._cv:  # as if the file held a deeper state of this session than the slot now does
        eng.cache.continuations[0].file_depth = len(image.session) + 50
    before = (tmp_path / "deep.bin").read_bytes()
    run(eng, list(range(1, 80)))  # evicts it
    eng.cache.spiller.flush(30)
    assert (tmp_path / "deep.bin").read_bytes() == before
    assert eng.snapshot()["context_cache"]["auto_save"]["skipped"] == 1


def test_at_most_two_spills_wait_and_an_explicit_save_supersedes_waiting_ones(tmp_path, monkeypatch):
    gate = threading.Event()
    started = threading.Event()
    real_encode = cache_slots.encode

    def slow_encode(image):
        started.set()
        gate.wait(30)
        return real_encode(image)

    monkeypatch.setattr(cache_slots, "encode", slow_encode)
    monkeypatch.setattr(cache_slots, "snapshot_continuation",
                        lambda cache, cont, compat: cache_slots.SlotImage(compat, list(cont.session), [], {}))
    sp = SlotSpiller(str(tmp_path), COMPAT)

    def cont(name, n):
        return Continuation(0, tuple(range(n)), [], filename=name)

    assert sp.spill(None, cont("a.bin", 10))
    assert started.wait(30)  # the writer holds "a"
    assert sp.spill(None, cont("b.bin", 11)) and sp.spill(None, cont("c.bin", 12))
    assert not sp.spill(None, cont("d.bin", 13))  # a third waiting spill is skipped
    sp.supersede("b.bin")  # an explicit save of b.bin
    gate.set()
    assert sp.flush(30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "c.bin"]
    assert sp.snapshot() == {"spills": 2, "skipped": 1, "failed": 0, "superseded": 1, "waiting": 0}
    sp.close(5)


@pytest.mark.parametrize("argv,error", [
    (["--auto-save-evicted"], "--auto-save-evicted needs --slot-save-path"),
    (["--auto-save-evicted", "--no-prefix-reuse"], "--auto-save-evicted needs the checkpoint catalog"),
])
def test_option_refusals(argv, error):
    p = argparse.ArgumentParser()
    add_cache_arguments(p)
    with pytest.raises(ValueError, match=error):
        apply_cache_arguments(p.parse_args(argv), EngineOptions())


def test_option_is_applied():
    p = argparse.ArgumentParser()
    add_cache_arguments(p)
    opts = EngineOptions()
    apply_cache_arguments(p.parse_args(["--auto-save-evicted", "--slot-save-path", "d"]), opts)
    assert opts.auto_save_evicted and opts.slot_save_path == "d"
