"""The local Response store: LRU by record count and by bytes, refusal of one record too large."""

from __future__ import annotations

import pytest

from ninfer_core.engine.api import EngineError
from ninfer_core.server.response_store import ResponseStore, StoredResponse, record_size


def rec(rid: str, text: str = "x") -> StoredResponse:
    response = {"id": rid, "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}
    items = [{"id": f"msg_{rid}", "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]
    return StoredResponse(id=rid, response=response, input_items=items, context=items)


def test_evicts_least_recently_used_by_bytes():
    one = record_size(rec("a", "x" * 100).response, rec("a", "x" * 100).input_items)
    store = ResponseStore(max_records=100, max_bytes=2 * one + one // 2)
    for rid in "abc":
        store.put(rec(rid, "x" * 100))
    assert store.get("a") is None and store.get("b") is not None and store.get("c") is not None
    assert store.bytes <= store.max_bytes and store.evicted == 1
    store.get("b")  # b becomes the most recent: c goes next
    store.put(rec("d", "x" * 100))
    assert store.get("c") is None and store.get("b") is not None


def test_one_record_larger_than_the_budget_is_refused_and_nothing_is_evicted():
    store = ResponseStore(max_records=10, max_bytes=400)
    store.put(rec("small"))
    with pytest.raises(EngineError) as e:
        store.put(rec("big", "x" * 1000))
    assert e.value.code == "response_store_capacity_exceeded" and e.value.status == 400
    assert store.get("small") is not None and store.get("big") is None


def test_delete_frees_bytes_and_a_child_context_survives_its_parent():
    store = ResponseStore(max_records=10, max_bytes=1 << 20)
    parent = rec("p")
    store.put(parent)
    child = StoredResponse(id="c", response={"id": "c"}, input_items=[], context=parent.context + [{"id": "m"}])
    store.put(child)
    before = store.bytes
    assert store.delete("p") and not store.delete("p")
    assert store.bytes == before - parent.size
    assert [i["id"] for i in store.get("c").context] == ["msg_p", "m"]


def test_zero_records_stores_nothing():
    store = ResponseStore(max_records=0, max_bytes=1 << 20)
    with pytest.raises(EngineError):
        store.put(rec("a"))
