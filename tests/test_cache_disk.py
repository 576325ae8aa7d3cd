"""The disk tier on the toy runner: evicted and shut-down continuations are written as prefix-digest
keyed page files and StateImages with a CRC each; a later request (or a restarted engine) with no
resident prefix restores the longest intact matching frontier exactly; a corrupted page, a missing
page or an exhausted budget falls back to recomputing, with the same output."""

from __future__ import annotations

import os
import random

import pytest

from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.cache_disk import PAGE_MAGIC, DiskTier, pack, prefix_digests, unpack
from ninfer_core.engine.checkpoints import CheckpointHints, session_digest
from ninfer_core.engine.engine import Engine
from ninfer_core.testing import ToyRunner, ToyTokenizer, collect, run_async

GREEDY = SamplingParams(temperature=0.0)


def make(path, reuse=True, **opts) -> Engine:
    base = {"max_context": 1024, "prefill_chunk": 64, "prefix_reuse": reuse, "max_private_continuations": 1,
            "disk_kv_path": str(path) if reuse else None, "disk_kv_restore": True, "disk_kv_model": "toy"}
    eng = Engine(ToyRunner(), ToyTokenizer(), EngineOptions(**{**base, **opts}))
    eng.start()
    return eng


def run(eng, prompt, n=6, hints=None):
    async def go():
        return await collect(eng.submit(GenerationRequest(prompt_ids=prompt, sampling=GREEDY, max_tokens=n,
                                                          checkpoint_hints=hints)))

    out = run_async(go())
    assert out.finish is not None
    return out


def root(prompt, n=6):
    eng = make(None, reuse=False)
    try:
        return run(eng, prompt, n).token_ids
    finally:
        eng.shutdown(timeout=30)


def files(path, suffix):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(suffix))


def disk(eng):
    eng.cache.disk.flush(30)
    return eng.snapshot()["context_cache"]["disk"]


@pytest.fixture
def rng():
    return random.Random(21)


def toks(rng, n):
    return [rng.randrange(256) for _ in range(n)]


def test_prefix_digests_are_the_session_digest_of_each_prefix():
    t = list(range(300))
    d = prefix_digests(t, {0, 64, 200})
    assert d == {0: session_digest([]), 64: session_digest(t[:64]), 200: session_digest(t[:200])}


def test_page_records_verify_their_crc(tmp_path):
    import torch

    data = pack(PAGE_MAGIC, {"digest": "x"}, {"kv": torch.arange(8).reshape(1, 8)})
    header, tensors = unpack(PAGE_MAGIC, data)
    assert header["digest"] == "x" and tensors["kv"].tolist() == [list(range(8))]
    for i in (len(PAGE_MAGIC) + 1, len(data) // 2, len(data) - 1):
        bad = bytearray(data)
        bad[i] ^= 0x10
        with pytest.raises(ValueError):
            unpack(PAGE_MAGIC, bytes(bad))
    with pytest.raises(ValueError):
        unpack(PAGE_MAGIC, data[:-3])


def test_evicted_continuation_is_restored_from_disk_exactly(tmp_path, rng):
    eng = make(tmp_path)
    try:
        a = toks(rng, 150)
        out_a = run(eng, a)
        run(eng, toks(rng, 120))  # one continuation cell: A is evicted and written
        d = disk(eng)
        # A's executed frontier 155: two full pages and a 27-row tail page, one StateImage.
        assert (d["disk_pages"], d["disk_states"]) == (3, 1)
        assert len(files(tmp_path, ".page")) == 3 and len(files(tmp_path, ".state")) == 1
        nxt = a + out_a.token_ids + [1, 2, 3]
        again = run(eng, nxt)
        assert again.finish.usage.cached_tokens == len(a) + len(out_a.token_ids) - 1
        assert again.finish.context["source"] == "private_endpoint"
        assert again.token_ids == root(nxt)
        assert disk(eng)["restores"] == 1
        with eng._cv:
            eng.cache.audit([])
    finally:
        eng.shutdown(timeout=30)


def test_turn_closure_and_early_anchors_keep_their_tail_pages_and_states(tmp_path, rng):
    eng = make(tmp_path)
    try:
        p = toks(rng, 300)
        run(eng, p, hints=CheckpointHints(turn_closure=290, markers=[70, 150]))
        run(eng, toks(rng, 100))  # evicts it
        d = disk(eng)
        # Endpoint 305 (4 full pages + tail), closure 290 tail, anchors 70 and 150 tails: 8 pages;
        # four StateImages.
        assert (d["disk_pages"], d["disk_states"]) == (8, 4)
        # An edit after the first anchor restores from that anchor (no resident prefix).
        edit = p[:150] + toks(rng, 20)
        o = run(eng, edit)
        assert o.finish.usage.cached_tokens == 150 and o.finish.context["source"] == "private_long_anchor"
        assert o.token_ids == root(edit)
    finally:
        eng.shutdown(timeout=30)


def test_an_identical_prefix_is_stored_once(tmp_path, rng):
    eng = make(tmp_path)
    try:
        system = toks(rng, 128)
        run(eng, system + toks(rng, 40))
        run(eng, system + toks(rng, 50))  # evicts the first
        run(eng, toks(rng, 30))  # evicts the second
        d = disk(eng)
        # Two full shared pages once, plus each conversation's third page (a tail): 4 page files.
        assert d["disk_pages"] == 4 and d["disk_states"] == 2
    finally:
        eng.shutdown(timeout=30)


def test_files_survive_a_restart_and_a_corrupt_page_recomputes(tmp_path, rng):
    eng = make(tmp_path)
    p = toks(rng, 200)
    out = run(eng, p)
    eng.shutdown(timeout=30)  # the resident continuation is written at shutdown
    assert len(files(tmp_path, ".state")) == 1
    nxt = p + out.token_ids + [9]
    eng = make(tmp_path)
    try:
        again = run(eng, nxt)
        assert again.finish.usage.cached_tokens == len(p) + len(out.token_ids) - 1
        assert again.token_ids == root(nxt)
        eng.run_control(eng.cache.clear).result(30)  # nothing resident: the next one reads the disk
    finally:
        eng.shutdown(timeout=30)
    # Flip one byte in one page file (the chain's second page): its CRC fails, the restore misses,
    # drops the page, and the prompt is computed from root with the same output.
    first_pages = prefix_digests(nxt, {128})
    target = next(f for f in files(tmp_path, ".page") if os.path.basename(f) == f"{first_pages[128]}.page")
    with open(target, "rb") as fh:
        data = bytearray(fh.read())
    data[len(data) - 5] ^= 0xFF
    with open(target, "wb") as fh:
        fh.write(bytes(data))
    eng = make(tmp_path)
    try:
        miss = run(eng, nxt)
        assert miss.finish.usage.cached_tokens == 0 and miss.finish.context["source"] == "root"
        assert miss.token_ids == root(nxt)
        d = disk(eng)
        assert d["restores"] == 0 and d["crc_failures"] == 1 and d["misses"] >= 1
        assert not os.path.exists(target)
    finally:
        eng.shutdown(timeout=30)


def test_a_missing_page_falls_back_to_a_shallower_frontier(tmp_path, rng):
    eng = make(tmp_path)
    try:
        p = toks(rng, 300)
        out = run(eng, p, hints=CheckpointHints(markers=[100]))
        run(eng, toks(rng, 90))  # evicts it: pages of 305, tail of 100, states at 100 and 305
        assert disk(eng)["disk_states"] == 2
        dig = prefix_digests(p, {192})
        os.unlink(eng.cache.disk.pages[dig[192]].path)  # the third page: only the deep chain needs it
        eng.cache.disk.pages.pop(dig[192])
        nxt = p + out.token_ids + [5, 6, 7]
        o = run(eng, nxt)
        assert o.finish.usage.cached_tokens == 100 and o.token_ids == root(nxt)
    finally:
        eng.shutdown(timeout=30)


def test_budget_split_drops_the_least_recently_used_files(tmp_path, rng):
    # 16 KiB: 85% (13.6 KiB) for pages of about 1.6 KiB each, 15% for StateImages of about 0.4 KiB.
    eng = make(tmp_path, disk_kv_gib=16 * 2**-20)
    try:
        for _ in range(5):
            run(eng, toks(rng, 300))
        d = disk(eng)
        tier = eng.cache.disk
        assert d["writes"] == 4 and d["evicted_files"] > 0
        assert d["disk_main_bytes"] <= tier.main_budget and d["disk_state_bytes"] <= tier.state_budget
        assert d["disk_main_bytes"] == sum(os.path.getsize(f) for f in files(tmp_path, ".page"))
        # The newest eviction is whole; it restores.
        assert d["disk_states"] >= 1
    finally:
        eng.shutdown(timeout=30)


def test_restore_off_only_writes(tmp_path, rng):
    eng = make(tmp_path, disk_kv_restore=False)
    try:
        a = toks(rng, 100)
        out = run(eng, a)
        run(eng, toks(rng, 100))
        assert disk(eng)["disk_states"] == 1
        o = run(eng, a + out.token_ids + [3])
        assert o.finish.context["source"] == "root"
    finally:
        eng.shutdown(timeout=30)


def test_a_foreign_profile_never_sees_the_files(tmp_path):
    a = DiskTier(str(tmp_path), 2**20, {"model": "m", "kv_dtype": "bf16"}, True)
    b = DiskTier(str(tmp_path), 2**20, {"model": "m", "kv_dtype": "int8"}, True)
    assert a.dir != b.dir and os.path.dirname(a.dir) == os.path.dirname(b.dir)
    a.close(5)
    b.close(5)


def test_an_evicted_conversation_is_read_out_in_batches_between_rounds(tmp_path, rng, monkeypatch):
    import ninfer_core.engine.cache_tiers as cache_mod

    monkeypatch.setattr(cache_mod, "DISK_WRITE_BATCH_PAGES", 4)
    eng = make(tmp_path, kv_capacity=40 * 64)  # no page pressure: A stays on Device until evicted
    try:
        reads: list[int] = []
        read_pages = eng.runner.read_pages

        def counted(pages):
            reads.append(len(pages))
            return read_pages(pages)

        eng.runner.read_pages = counted
        a = toks(rng, 900)
        out_a = run(eng, a)
        run(eng, toks(rng, 120))  # one continuation cell: A (905 tokens, 15 pages) is evicted
        d = disk(eng)
        # 14 full pages, a tail page and a StateImage: 16 reads of at most 4 pages, 4 batches.
        assert d["writes"] == 1 and d["write_batches"] == 4 and d["abandoned_writes"] == 0
        assert sum(reads) == 15 and max(reads) <= 4
        assert (d["disk_pages"], d["disk_states"]) == (15, 1)
        with eng._cv:
            eng.cache.audit([])
            assert not eng.cache.has_background_work()
        nxt = a + out_a.token_ids + [7, 8]
        again = run(eng, nxt)
        assert again.finish.context["source"] == "private_endpoint" and again.token_ids == root(nxt)
    finally:
        eng.shutdown(timeout=30)


def test_a_write_past_its_deadline_is_abandoned_and_the_prompt_recomputes(tmp_path, rng, monkeypatch):
    import ninfer_core.engine.cache_tiers as cache_mod

    monkeypatch.setattr(cache_mod, "DISK_WRITE_DEADLINE_S", 0.0)
    eng = make(tmp_path)
    try:
        a = toks(rng, 300)
        out_a = run(eng, a)
        run(eng, toks(rng, 120))  # A is evicted; its staged write is already past the deadline
        d = disk(eng)
        assert d["abandoned_writes"] == 1 and d["writes"] == 0 and d["disk_files"] == 0
        assert files(tmp_path, ".page") == [] and files(tmp_path, ".state") == []
        with eng._cv:
            eng.cache.audit([])  # the abandoned write's memory was released
        nxt = a + out_a.token_ids + [7, 8]
        again = run(eng, nxt)
        assert again.finish.context["source"] == "root" and again.token_ids == root(nxt)
    finally:
        eng.shutdown(timeout=30)
