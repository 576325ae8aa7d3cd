"""Lanes, admission and the prefill choice: pure CPU bookkeeping over pages and slots.

The scheduler never calls the model. Its callers (the engine worker) hold the engine lock while
they mutate it, so snapshots read a consistent state.
"""

from __future__ import annotations

import time
from collections import deque

from ninfer_core.engine.pages import PagePool
from ninfer_core.engine.request import SeqStatus, Sequence
from ninfer_core.engine.slots import SlotPool

STARVATION_LIMIT = 8  # a staged lane passed over this many times runs the next prefill unit


class Scheduler:
    """A FIFO of waiting sequences and up to `max_lanes` admitted ones.

    Admission is strictly first come first served: the head of the FIFO waits until a lane and its
    whole page entitlement are free, and nothing behind it overtakes it.
    """

    def __init__(self, max_lanes: int, pages: PagePool, slots: SlotPool,
                 starvation_limit: int = STARVATION_LIMIT, cache=None):
        self.max_lanes = max_lanes
        self.pages = pages
        self.slots = slots
        self.cache = cache  # ninfer_core.engine.cache.ContextCache, or None (root only)
        self.starvation_limit = starvation_limit
        self.waiting: deque[Sequence] = deque()
        self.lanes: list[Sequence] = []  # admission order

    # -- FIFO -----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.entitlement_pages > self.pages.num_pages:
            raise ValueError(f"entitlement of {seq.entitlement_pages} pages can never fit "
                             f"a pool of {self.pages.num_pages}")
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def remove_waiting(self, seq: Sequence) -> bool:
        try:
            self.waiting.remove(seq)
        except ValueError:
            return False
        return True

    def expired(self, now: float) -> list[Sequence]:
        """Waiting sequences whose admission deadline has passed (left in the FIFO)."""
        return [s for s in self.waiting if s.deadline is not None and s.deadline <= now]

    def can_admit_head(self) -> bool:
        if not self.waiting or len(self.lanes) >= self.max_lanes or self.slots.num_free == 0:
            return False
        if self.cache is not None:
            # Plans the head's reuse and evicts inactive checkpoints until its entitlement fits.
            return self.cache.make_room(self.waiting[0])
        return self.pages.can_allocate(self.waiting[0].entitlement_pages)

    def admit(self, concurrent_prefill: bool = False) -> list[Sequence]:
        """Move FIFO heads into lanes while a lane and their entitlement are free.

        Without concurrent prefill a staged prefill holds admission back (spec: Execution
        behavior): a head is admitted only while no lane is prefilling, one at a time.
        """
        admitted = []
        while self.can_admit_head():
            if not concurrent_prefill and any(s.status is SeqStatus.PREFILL for s in self.lanes):
                break
            seq = self.waiting.popleft()
            seq.slot = self.slots.allocate()
            if self.cache is not None:
                self.cache.admit(seq, time.monotonic())  # pages, num_cached at the reuse frontier
            else:
                seq.pages = self.pages.allocate(seq.entitlement_pages)
                seq.num_cached = 0
            seq.passed_over = 0
            seq.status = SeqStatus.PREFILL
            self.lanes.append(seq)
            admitted.append(seq)
        return admitted

    # -- lanes ----------------------------------------------------------------------------------
    def release(self, seq: Sequence) -> None:
        """Give back a lane's pages and slot (or drop a waiting sequence) and mark it finished."""
        if self.cache is not None:
            self.cache.release(seq)  # holds of a request that did not publish (cancel, failure)
        if seq in self.lanes:
            self.lanes.remove(seq)
            self.pages.free(seq.pages)
            self.slots.free(seq.slot)
            seq.pages = []
            seq.slot = None
        else:
            self.remove_waiting(seq)
        seq.status = SeqStatus.FINISHED

    def decode_batch(self) -> list[Sequence]:
        """Every decode-ready lane, in admission order (compacted: no empty rows)."""
        return [s for s in self.lanes if s.status is SeqStatus.DECODE]

    def staged(self) -> list[Sequence]:
        return [s for s in self.lanes if s.status is SeqStatus.PREFILL]

    def pick_prefill(self) -> Sequence | None:
        """Choose the staged lane that runs the next prefill unit and count the others as passed over.

        Shortest remaining prompt first (ties by admission order); a lane passed over
        `starvation_limit` times goes first so a long prompt is not starved.
        """
        staged = self.staged()
        if not staged:
            return None
        starving = [s for s in staged if s.passed_over >= self.starvation_limit]
        if starving:
            chosen = min(starving, key=lambda s: s.order)
        else:
            chosen = min(staged, key=lambda s: (s.prompt_remaining, s.order))
        for s in staged:
            if s is not chosen:
                s.passed_over += 1
        chosen.passed_over = 0
        return chosen
