"""Tier moves of the checkpoint catalog: the one part that calls the model runner.

Owns every copy between the tiers a checkpoint lives in: a Device state slot, a Host StateImage,
Device KV pages, Host KV pages, and the disk tier. A resumed request's state and tail page are
copied into its lane (`materialize`); a capture's state is copied out of the lane (`_take_state`);
under pressure a StateImage is demoted to Host (`_device_slot`, cheapest first by
`_demotion_order`) and KV pages are copied to Host (`_pages_to_host`); an evicted continuation is
written to its slot file and staged for the disk tier, read out a batch per boundary
(`between_rounds`, `drain_spills`), and everything resident is written at shutdown; a prompt with
no resident prefix is seeded from disk (`_restore_from_disk`, --disk-kv-restore).

The slot files (cache_slots) and the disk tier (cache_disk) copy through this module too
(`state_copy`, `kv_copy`, `write_kv`, `install_state`, `state_layout`).

DISK_WRITE_BATCH_PAGES and DISK_WRITE_DEADLINE_S are read from this module by every part of the
catalog.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ninfer_core.engine.cache_planner import (
    HOST_RESUME_COST,
    combined_likelihood,
    likelihood,
    state_demotion_cost,
)

if TYPE_CHECKING:
    from ninfer_core.engine.cache_admission import ReusePlan
    from ninfer_core.engine.checkpoints import Checkpoint, Continuation
    from ninfer_core.engine.model_api import StateImage
    from ninfer_core.engine.request import Sequence

log = logging.getLogger("ninfer.engine.cache")

DISK_WRITE_BATCH_PAGES = 16  # cache_disk.WRITE_BATCH_PAGES: pages read out per boundary
DISK_WRITE_DEADLINE_S = 20.0  # spec "Disk tier": an evicted owner is written within 20 s


class TierMoves:
    """Mixin of the catalog (cache_catalog.CheckpointCatalog): the copies between tiers."""

    def materialize(self, seq: Sequence) -> None:
        """After admission, on the worker: copy the checkpoint's state into the lane's slot and the
        partly filled tail page into the lane's own page (copy-on-write); or reset for root."""
        plan: ReusePlan = seq.cache_plan
        ckpt = plan.ckpt
        if ckpt is None:
            self.runner.reset_slot(seq.slot)
        else:
            if ckpt.device_slot is not None:
                self.runner.copy_slot(ckpt.device_slot, seq.slot)
            else:
                self.runner.restore_state(ckpt.image, seq.slot)
                self.counters["transfer_bytes"]["state_h2d"] += ckpt.image.nbytes
            if ckpt.host_pages:
                # Host KV: the request gets its own copy of every page of the prefix.
                n = len(ckpt.host_pages)
                self.runner.write_pages(seq.pages[:n], self.host_pages.gather(ckpt.host_pages))
                self.counters["transfer_bytes"]["main_kv_h2d"] += n * self.page_bytes
            else:
                tail = ckpt.frontier // self.page_size
                if ckpt.frontier % self.page_size:
                    self.runner.copy_page(ckpt.pages[tail], seq.pages[tail])
                    self._rehome_tail(seq, ckpt, tail)
                    if self.leases is not None:
                        self.leases.settle(seq)
            ckpt.pins -= 1
        plan.materialized = True

    def _rehome_tail(self, seq: Sequence, ckpt: Checkpoint, tail: int) -> None:
        """Point every checkpoint whose last page is `ckpt`'s tail page, and whose frontier does not
        pass ckpt's, at the request's copy of that page: positions below their frontiers are the
        same in both, so the original page is released to the request's lease (cache_lease)."""
        old, new = ckpt.pages[tail], seq.pages[tail]
        plan: ReusePlan = seq.cache_plan
        seen: dict[int, Checkpoint] = {c.id: c for c in [ckpt] + [e.ckpt for e in plan.inherited]}
        for _, e in self._all_entries():
            seen.setdefault(e.ckpt.id, e.ckpt)
        for c in seen.values():
            if c.frontier <= ckpt.frontier and len(c.pages) == tail + 1 and c.pages[tail] == old:
                c.pages[tail] = self.pages.share([new])[0]
                self.pages.free([old])

    def _take_state(self, ckpt: Checkpoint, lane: int, now: float, value: float) -> bool:
        """Copy lane `lane`'s state into a Device state slot for `ckpt`, else into a Host
        StateImage; False when neither has room worth `value` (the capture is then skipped)."""
        if (slot := self._device_slot(now, value)) is not None:
            self.runner.copy_slot(lane, slot)
            ckpt.device_slot = slot
        elif self._host_room(now, limit=value):
            ckpt.image = self.runner.capture_state(lane)
            self.host_images += 1
            self.counters["transfer_bytes"]["state_d2h"] += ckpt.image.nbytes
        else:
            return False
        return True

    def _device_slot(self, now: float, limit: float = float("inf")) -> int | None:
        """A free Device state slot, demoting to Host the inactive image whose demotion costs least:
        its reuse likelihood (all holders') times the cheaper of the copy back and rebuilding it
        from the next shallower retained checkpoint (cache_planner.state_demotion_cost)."""
        if self._device_free:
            return self._device_free.pop()
        for c in self._demotion_order(now):
            if self._host_room(now, keep=c, limit=limit):
                c.image = self.runner.capture_state(c.device_slot)
                self.host_images += 1
                self.counters["transfer_bytes"]["state_d2h"] += c.image.nbytes
                private = any(o is not None for o, e in self._all_entries() if e.ckpt is c)
                if private:
                    self.counters["pressure"]["private_owner_degraded"] += 1
                    self.counters["pressure"]["private_owner_demoted"] += 1
                else:
                    self.counters["pressure"]["shared_owner_degraded"] += 1
                slot, c.device_slot = c.device_slot, None
                return slot
        return None

    def _demotion_order(self, now: float) -> list[Checkpoint]:
        """Inactive Device-resident StateImages, cheapest to demote first (ties: least recent)."""
        holders: dict[int, list[float]] = {}
        every: dict[int, Checkpoint] = {}
        for owner, e in self._all_entries():
            every[e.ckpt.id] = e.ckpt
            last = max(e.ckpt.last_used, owner.last_used) if owner is not None else e.ckpt.last_used
            holders.setdefault(e.ckpt.id, []).append(likelihood(last, now))
        victims = [c for c in every.values() if c.device_slot is not None and c.pins == 0]
        if not victims:
            return []
        copy_back = self.state_bytes * HOST_RESUME_COST / max(1, self.kv_bytes_per_token)

        def cost(c: Checkpoint) -> float:
            floor = max((p.frontier for p in every.values()
                         if p is not c and p.frontier < c.frontier and self._is_prefix(p, c)), default=0)
            return state_demotion_cost(combined_likelihood(holders[c.id]), copy_back, c.frontier - floor)

        return sorted(victims, key=lambda c: (cost(c), c.last_used))

    def _host_room(self, now: float, keep: Checkpoint | None = None, limit: float = float("inf")) -> bool:
        """A free Host StateImage slot, dropping the Host images cheapest to rebuild when full."""
        if self.host_images < self.caps.host_state_slots:
            return True
        if self.caps.host_state_slots == 0:
            return False
        self._relieve(need_host_images=self.host_images - self.caps.host_state_slots + 1, keep=keep,
                      limit=limit)
        return self.host_images < self.caps.host_state_slots

    def _pages_to_host(self, demote: list[Checkpoint]) -> None:
        """Move the demoted checkpoints' KV pages to Host copies (a page shared by several of them
        is copied once) and give their Device pages back."""
        distinct = list(dict.fromkeys(p for c in demote for p in c.pages))
        hids = self.host_pages.store(self.runner.read_pages(distinct))
        where = dict(zip(distinct, hids))
        for c in demote:
            c.host_pages = self.host_pages.share([where[p] for p in c.pages])
            self.pages.free(c.pages)
            c.pages = []
        self.host_pages.free(hids)
        self.counters["transfer_bytes"]["main_kv_d2h"] += len(distinct) * self.page_bytes

    def _evict(self, cont: Continuation) -> None:
        """An involuntary eviction: (--auto-save-evicted) the slot file it is bound to is written
        back, then the continuation leaves the catalog. With a disk tier its write is staged and it
        keeps its memory until the write is read out (`between_rounds`, at most 20 s)."""
        if self.spiller is not None and cont.filename:
            self.spiller.spill(self, cont)
        self.continuations[cont.slot] = None
        job = None
        if self.disk is not None:
            try:
                job = self.disk.begin_write(self, cont, self._clock() + DISK_WRITE_DEADLINE_S)
            except Exception:
                log.exception("disk tier: staging an evicted continuation failed")
        if job is None:
            self._release_entries(cont)
        else:
            self._spilling.append((cont, job))

    def between_rounds(self) -> None:
        """At a boundary between decode rounds: read one batch of the staged disk writes out of the
        engine; a write past its deadline is abandoned. Either way a finished job frees its memory."""
        if not self._spilling:
            return
        now = self._clock()
        budget = DISK_WRITE_BATCH_PAGES
        for cont, job in list(self._spilling):
            if budget > 0 and now < job.deadline:
                try:
                    budget -= self.disk.pump(self, job, budget)
                except Exception:
                    log.exception("disk tier: reading an evicted continuation failed")
                    self.disk.abandon(job)
            elif now >= job.deadline:
                self.disk.abandon(job)
            if job.done:
                self._spilling.remove((cont, job))
                self._release_entries(cont)

    def has_background_work(self) -> bool:
        return bool(self._spilling)

    def drain_spills(self, deadline_s: float | None = None) -> None:
        """Read every staged disk write out now (a restore, shutdown, clear), abandoning what is
        left past `deadline_s`."""
        end = None if deadline_s is None else self._clock() + deadline_s
        for cont, job in list(self._spilling):
            try:
                while not job.done:
                    if end is not None and self._clock() > end:
                        self.disk.abandon(job)
                        break
                    self.disk.pump(self, job, DISK_WRITE_BATCH_PAGES)
            except Exception:
                log.exception("disk tier: reading an evicted continuation failed")
                self.disk.abandon(job)
            self._release_entries(cont)
        self._spilling = []

    def _spill_pending_pages(self) -> int:
        """Device pages the staged disk writes will free once read out."""
        if not self._spilling:
            return 0
        held: dict[int, int] = {}
        for cont, _ in self._spilling:
            for c in {id(e.ckpt): e.ckpt for e in cont.entries}.values():
                if c.refs != sum(1 for e in cont.entries if e.ckpt is c):
                    continue  # a running request holds it too
                for p in c.pages:
                    held[p] = held.get(p, 0) + 1
        return sum(1 for p, n in held.items() if self.pages.refcount(p) == n)

    def on_shutdown(self) -> None:
        """Write every resident continuation to the disk tier (no forward runs any more) and wait
        for the writers: the disk tier at most 60 s, pending slot-file spills likewise."""
        if self.disk is not None:
            self.drain_spills(60)
            for c in list(self.continuations):
                if c is not None:
                    try:
                        self.disk.write_continuation(self, c)
                    except Exception:
                        log.exception("disk tier: writing a resident continuation failed")
            self.disk.close(timeout=60)
        if self.spiller is not None:
            self.spiller.close(timeout=60)

    def _restore_from_disk(self, seq: Sequence, now: float) -> None:
        """--disk-kv-restore: a request with no resident prefix seeds it from the disk tier."""
        if getattr(seq, "disk_checked", False) or self.caps.max_private_continuations == 0:
            return
        seq.disk_checked = True
        self.drain_spills(DISK_WRITE_DEADLINE_S)  # what is being written may be what it needs
        image = self.disk.lookup(seq.prompt_ids, now)
        if image is None:
            return
        from ninfer_core.engine import cache_slots

        idx = self._free_cell()
        if self._spilling:  # the cell's evicted owner: its memory is what the install may need
            self.drain_spills(DISK_WRITE_DEADLINE_S)
        try:
            cache_slots.install(self, idx, image, None, now)
        except Exception as e:  # noqa: BLE001 - a restore that fails recomputes the prompt
            log.warning("disk tier: restoring a %d-token session failed: %s", len(image.session), e)

    # -- copies for the slot files and the disk tier -------------------------------------------
    def state_copy(self, ckpt: Checkpoint) -> StateImage:
        """A Host copy of a checkpoint's StateImage: its Host image, or a copy of its Device slot."""
        return ckpt.image if ckpt.image is not None else self.runner.capture_state(ckpt.device_slot)

    def kv_copy(self, ckpt: Checkpoint, idx: list[int] | None = None) -> dict[str, Any]:
        """Host copies of a checkpoint's KV pages (all, or those at page indices `idx`), from its
        Host KV pages or its Device pages."""
        if ckpt.host_pages:
            return self.host_pages.gather(ckpt.host_pages if idx is None else [ckpt.host_pages[i] for i in idx])
        return self.runner.read_pages(ckpt.pages if idx is None else [ckpt.pages[i] for i in idx])

    def write_kv(self, pages: list[int], kv: dict[str, Any]) -> None:
        """Write Host copies of KV pages into Device pages (a restored slot file)."""
        self.runner.write_pages(pages, kv)

    def install_state(self, ckpt: Checkpoint, state: StateImage, now: float) -> bool:
        """Give a restored checkpoint its StateImage: copied into a Device state slot, else kept as a
        Host image; False when neither has room."""
        slot_id = self._device_slot(now)
        if slot_id is not None:
            ckpt.device_slot = slot_id
            self.runner.restore_state(state, slot_id)
        elif self._host_room(now):
            ckpt.image = state
            self.host_images += 1
        else:
            return False
        return True

    def state_layout(self) -> dict[str, Any]:
        """This model's StateImage tensors (a read-only copy of lane slot 0's), to check a restored
        image against."""
        return self.runner.capture_state(0).tensors
