"""State slots: one fixed-size recurrent-state slot per active lane, handed out by index."""

from __future__ import annotations


class SlotPool:
    """Slot indices 0..num_slots-1; the lowest free index is handed out first."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = set(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("slot pool: no free slot")
        slot = min(self._free)
        self._free.remove(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"slot pool: freeing slot {slot} that is not held")
        self._free.add(slot)
