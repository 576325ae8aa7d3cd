"""The local Response store: a bounded LRU of terminal Responses and their conversation context.

Stored Responses live only in this process (spec "Local response state and resources"): an LRU
bounded by a record count (--response-store-max-records) and a byte budget
(--response-store-max-mib). A record keeps the terminal Response object, the normalized input
Items of its own request (GET .../input_items), and the whole context a child continues from
(parent context + own input + own output). Contexts share their Item dicts with the parent's, so
a child stays usable after its parent is deleted or evicted, and a chain costs one reference per
Item rather than a copy. Touched only on the event loop thread.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ninfer_core.engine.api import EngineError


@dataclass
class StoredResponse:
    id: str
    response: dict[str, Any]  # the terminal wire object
    input_items: list[dict[str, Any]]  # this request's normalized input Items, client order
    context: list[dict[str, Any]]  # everything a child continues from (instructions excluded)
    preserve_thinking: bool | None = None  # the resolved value a child inherits
    session_id: str | None = None  # Engine session identity of the chain
    size: int = field(default=0)  # bytes charged against the budget


def record_size(response: dict, input_items: list[dict]) -> int:
    """Bytes a record is charged: its envelope and its own Items as compact JSON."""
    return len(json.dumps(response, separators=(",", ":"))) + len(json.dumps(input_items, separators=(",", ":")))


class ResponseStore:
    """Bounded LRU of StoredResponse by id; `put` refuses one record larger than the whole budget."""

    def __init__(self, max_records: int, max_bytes: int):
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._records)

    def check_fits(self, size: int) -> None:
        """Raise response_store_capacity_exceeded when a record of `size` bytes can never be stored."""
        if self.max_records < 1 or size > self.max_bytes:
            raise EngineError(
                400, "response_store_capacity_exceeded",
                f"The Response needs {size} bytes of local storage, more than the store holds "
                f"({self.max_bytes} bytes, {self.max_records} records; see --response-store-max-mib and "
                "--response-store-max-records). Send store: false to run it without storing it.",
                param="store")

    def put(self, record: StoredResponse) -> None:
        if not record.size:
            record.size = record_size(record.response, record.input_items)
        self.check_fits(record.size)
        self.delete(record.id)
        self._records[record.id] = record
        self.bytes += record.size
        while len(self._records) > self.max_records or self.bytes > self.max_bytes:
            _, old = self._records.popitem(last=False)
            self.bytes -= old.size
            self.evicted += 1

    def get(self, response_id: str) -> StoredResponse | None:
        rec = self._records.get(response_id)
        if rec is not None:
            self._records.move_to_end(response_id)
        return rec

    def delete(self, response_id: str) -> bool:
        rec = self._records.pop(response_id, None)
        if rec is None:
            return False
        self.bytes -= rec.size
        return True
