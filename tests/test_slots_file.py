"""Slot files on the toy runner: round trip, refused files, and a failed restore leaves the slot empty
with the pools exactly accounted."""

from __future__ import annotations

import random

import pytest

from ninfer_core.config import EngineOptions
from ninfer_core.engine import cache_slots
from ninfer_core.engine.api import EngineError, GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.testing import ToyRunner, ToyTokenizer, collect, run_async

GREEDY = SamplingParams(temperature=0.0)
COMPAT = {"artifact": "toy", "kv_dtype": "bf16", "page_size": 64}


@pytest.fixture
def eng():
    e = Engine(ToyRunner(), ToyTokenizer(), EngineOptions(max_context=1024, prefill_chunk=64, prefix_reuse=True,
                                                          max_private_continuations=3))
    e.start()
    yield e
    e.shutdown(timeout=30)


def run(eng, prompt, n=6):
    async def go():
        return await collect(eng.submit(GenerationRequest(prompt_ids=prompt, sampling=GREEDY, max_tokens=n)))

    return run_async(go())


def on_worker(eng, fn):
    return eng.run_control(fn).result(30)


def retained(eng):
    return [c.slot for c in eng.cache.continuations if c is not None]


def assert_accounted(eng):
    with eng._cv:
        eng.cache.audit([])


def saved_bytes(eng, prompt):
    out = run(eng, prompt)
    (slot,) = retained(eng)
    image = on_worker(eng, lambda: cache_slots.collect(eng.cache, slot, None, COMPAT))
    return slot, out, cache_slots.encode(image)


def test_round_trip_restores_an_ordinary_cache_entry(eng):
    prompt = [random.Random(1).randrange(256) for _ in range(150)]
    slot, out, data = saved_bytes(eng, prompt)
    digest = eng.cache.continuations[slot].digest
    assert on_worker(eng, lambda: cache_slots.erase(eng.cache, slot, digest)) == len(prompt) + len(out.token_ids)
    assert retained(eng) == []
    image = cache_slots.decode(data, COMPAT)
    cont = on_worker(eng, lambda: cache_slots.install(eng.cache, 2, image, "a.bin", 0.0))
    assert cont.digest == digest and retained(eng) == [2]
    assert_accounted(eng)
    nxt = prompt + out.token_ids + [7, 8, 9]
    again = run(eng, nxt)
    assert again.finish.usage.cached_tokens == len(prompt) + len(out.token_ids) - 1
    fresh = Engine(ToyRunner(), ToyTokenizer(), EngineOptions(max_context=1024))
    fresh.start()
    try:
        assert again.token_ids == run(fresh, nxt).token_ids
    finally:
        fresh.shutdown(timeout=30)
    on_worker(eng, eng.cache.clear)
    snap = eng.snapshot()
    assert snap["pages_free"] == snap["pages_total"]


@pytest.mark.parametrize("damage", ["truncate", "flip_header", "flip_payload", "flip_checksum", "empty"])
def test_truncated_or_altered_file_is_refused_and_slot_stays_empty(eng, damage):
    slot, _, data = saved_bytes(eng, list(range(10, 140)))
    bad = bytearray(data)
    if damage == "truncate":
        bad = bad[: len(bad) - 100]
    elif damage == "flip_header":
        bad[20] ^= 0x40
    elif damage == "flip_payload":
        bad[len(bad) // 2] ^= 0x01
    elif damage == "flip_checksum":
        bad[-1] ^= 0x01
    else:
        bad = bytearray()
    free_before = eng.snapshot()["pages_free"]
    with pytest.raises(EngineError) as e:
        cache_slots.decode(bytes(bad), COMPAT)  # checksum first: nothing parsed, nothing allocated
    assert e.value.status == 400 and e.value.code == "slot_restore_failed"
    assert eng.snapshot()["pages_free"] == free_before
    on_worker(eng, lambda: cache_slots.clear_slot(eng.cache, slot))  # what the route does on failure
    assert retained(eng) == []
    assert_accounted(eng)


def test_incompatible_file_names_the_difference(eng):
    _, _, data = saved_bytes(eng, list(range(20, 100)))
    with pytest.raises(EngineError) as e:
        cache_slots.decode(data, {**COMPAT, "kv_dtype": "int8"})
    assert e.value.code == "slot_restore_failed" and "kv_dtype" in e.value.message


def test_install_failure_leaves_the_slot_empty_and_nothing_allocated(eng):
    slot, _, data = saved_bytes(eng, list(range(30, 200)))
    image = cache_slots.decode(data, COMPAT)
    image.checkpoints[0]["state"] = {"wrong": image.checkpoints[0]["state"]["state"]}
    free = eng.snapshot()["pages_free"]
    with pytest.raises(EngineError) as e:
        on_worker(eng, lambda: cache_slots.install(eng.cache, slot, image, "x.bin", 0.0))
    assert e.value.code == "slot_restore_failed"
    assert retained(eng) == []
    assert_accounted(eng)
    # The slot's own session was released by the restore, so more pages are free than before.
    assert eng.snapshot()["pages_free"] >= free
    snap = eng.snapshot()["context_cache"]
    assert snap["device_state_slots_used"] == 0 and snap["host_state_slots_used"] == 0


def test_if_digest_busy_and_empty_slot_errors(eng):
    slot, _, _ = saved_bytes(eng, list(range(40, 120)))
    with pytest.raises(EngineError) as e:
        on_worker(eng, lambda: cache_slots.erase(eng.cache, slot, "0" * 16))
    assert (e.value.status, e.value.code, e.value.param) == (409, "slot_session_mismatch", "if_digest")
    eng.cache.continuations[slot].busy = 1
    with pytest.raises(EngineError) as e:
        on_worker(eng, lambda: cache_slots.erase(eng.cache, slot, None))
    assert (e.value.status, e.value.code) == (409, "slot_busy")
    eng.cache.continuations[slot].busy = 0
    with pytest.raises(EngineError) as e:
        on_worker(eng, lambda: cache_slots.collect(eng.cache, 2, None, COMPAT))
    assert e.value.code == "slot_save_failed"
    with pytest.raises(EngineError) as e:
        on_worker(eng, lambda: cache_slots.collect(eng.cache, 9, None, COMPAT))
    assert (e.value.code, e.value.param) == ("invalid_slot", "id_slot")


@pytest.mark.parametrize("name,ok", [("Conv-1.BIN", "conv-1.bin"), ("a", "a"), ("x" * 128, "x" * 128),
                                     ("../up", None), (".dot", None), ("dot.", None), ("CON", None),
                                     ("lpt1.txt", None), ("x" * 129, None), ("", None), ("a b", None),
                                     ("a/b", None), (None, None), (5, None)])
def test_filename_rules(name, ok):
    if ok is None:
        with pytest.raises(EngineError) as e:
            cache_slots.check_filename(name)
        assert (e.value.code, e.value.param) == ("invalid_filename", "filename")
    else:
        assert cache_slots.check_filename(name) == ok


def test_write_atomic_leaves_no_temporary_file(tmp_path):
    cache_slots.write_atomic(str(tmp_path), "s.bin", b"abc")
    cache_slots.write_atomic(str(tmp_path), "s.bin", b"defg")
    assert [p.name for p in tmp_path.iterdir()] == ["s.bin"] and (tmp_path / "s.bin").read_bytes() == b"defg"
