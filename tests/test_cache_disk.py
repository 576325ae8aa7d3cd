"""The disk tier on the toy runner: evicted and shut-down continuations are written, a later request
(or a restarted engine) with no resident prefix restores the deepest matching one exactly, and a
torn file or an exhausted budget falls back to recomputing."""

from __future__ import annotations

import os
import random

import pytest

from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.testing import ToyRunner, ToyTokenizer, collect, run_async

GREEDY = SamplingParams(temperature=0.0)


def make(path, reuse=True, **opts) -> Engine:
    eng = Engine(ToyRunner(), ToyTokenizer(), EngineOptions(
        max_context=1024, prefill_chunk=64, prefix_reuse=reuse, max_private_continuations=1,
        disk_kv_path=str(path) if reuse else None, disk_kv_restore=True, disk_kv_model="toy", **opts))
    eng.start()
    return eng


def run(eng, prompt, n=6):
    async def go():
        return await collect(eng.submit(GenerationRequest(prompt_ids=prompt, sampling=GREEDY, max_tokens=n)))

    out = run_async(go())
    assert out.finish is not None
    return out


def root(prompt, n=6):
    eng = make(None, reuse=False)
    try:
        return run(eng, prompt, n).token_ids
    finally:
        eng.shutdown(timeout=30)


def files(path):
    return sorted(p for d, _, fs in os.walk(path) for p in fs if p.endswith(".nkv"))


@pytest.fixture
def rng():
    return random.Random(21)


def test_evicted_continuation_is_restored_from_disk_exactly(tmp_path, rng):
    eng = make(tmp_path)
    try:
        a = [rng.randrange(256) for _ in range(150)]
        b = [rng.randrange(256) for _ in range(120)]
        out_a = run(eng, a)
        run(eng, b)  # one continuation cell: A is evicted and written
        assert len(files(tmp_path)) == 1
        nxt = a + out_a.token_ids + [1, 2, 3]
        again = run(eng, nxt)
        assert again.finish.usage.cached_tokens == len(a) + len(out_a.token_ids) - 1
        assert again.finish.context["source"] == "private_endpoint"
        assert again.token_ids == root(nxt)
        assert eng.snapshot()["context_cache"]["disk"]["restores"] == 1
        with eng._cv:
            eng.cache.audit([])
    finally:
        eng.shutdown(timeout=30)


def test_files_survive_a_restart_and_torn_files_are_misses(tmp_path, rng):
    eng = make(tmp_path)
    p = [rng.randrange(256) for _ in range(200)]
    out = run(eng, p)
    eng.shutdown(timeout=30)  # the resident continuation is written at shutdown
    assert len(files(tmp_path)) == 1
    nxt = p + out.token_ids + [9]
    eng = make(tmp_path)
    try:
        again = run(eng, nxt)
        assert again.finish.usage.cached_tokens > 0 and again.token_ids == root(nxt)
    finally:
        eng.shutdown(timeout=30)
    # Tear every file: the next engine misses, recomputes from root, and drops the torn file.
    for d, _, fs in os.walk(tmp_path):
        for f in fs:
            full = os.path.join(d, f)
            with open(full, "rb") as fh:
                data = bytearray(fh.read())
            data[len(data) // 2] ^= 0xFF
            with open(full, "wb") as fh:
                fh.write(bytes(data))
    eng = make(tmp_path)
    try:
        miss = run(eng, nxt)
        assert miss.finish.usage.cached_tokens == 0 and miss.token_ids == root(nxt)
        assert eng.snapshot()["context_cache"]["disk"]["restores"] == 0
    finally:
        eng.shutdown(timeout=30)


def test_budget_drops_the_least_recently_used_file(tmp_path, rng):
    eng = make(tmp_path, disk_kv_gib=10 * 2**-20)  # 10 KiB: room for one toy session file (~6 KiB)
    try:
        prompts = [[rng.randrange(256) for _ in range(300)] for _ in range(4)]
        for p in prompts:
            run(eng, p)
        disk = eng.snapshot()["context_cache"]["disk"]
        assert disk["writes"] == 3 and disk["disk_files"] == 1 and disk["evicted_files"] == 2
        assert 0 < disk["disk_bytes_used"] <= 10 * 2**10
        assert len(files(tmp_path)) == 1
    finally:
        eng.shutdown(timeout=30)
