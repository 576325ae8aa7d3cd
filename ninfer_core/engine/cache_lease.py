"""KV pages a request receives after admission: own-pages leases and --kv-lease-growth.

Admission normally reserves a request's whole entitlement (prompt + effective output) before it
starts (spec "Execution behavior"). A client that omits max_tokens gets the remaining context as
its output budget, so on a server whose KV pool equals --max-context the entitlement is the whole
pool, and a request continuing a retained conversation could only be admitted by evicting the very
checkpoint it resumes from. Two ways to reserve less up front, each exact about what it promises:

* Own-pages lease (the default with the context cache). A request resuming a private
  continuation is not made to reserve the pages that continuation holds *above* the resumed
  checkpoint (the endpoint of its previous answer, its output tail): they stay in the catalog,
  pinned to the request as its lease, so no other admission or pressure plan takes them, and the
  request grows into them only if its output reaches that far, dropping the lease checkpoints
  deepest first. The resumed checkpoint's partly filled tail page is re-homed onto the copy the
  request makes of it (positions below a checkpoint's frontier are identical in both), so that
  page needs no reservation either. The request always reaches its full entitlement: its output is
  the one a cold run gives. `--reserve-continuation-pages` turns it off.
* `--kv-lease-growth` (spec). Admission reserves the prompt plus a window of output (4096 tokens,
  or --prefill-chunk when larger); at each decode-round boundary a lane short of pages takes up to
  a window more from the free pages, releasing idle retained owners least recently used first when
  the pool is short; a lane that cannot get a single page finishes with finish_reason "length".

Both run at the engine's boundary (`PageLeases.grow`), under the engine lock, before decode rounds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ninfer_core.engine.pages import PagePool, pages_for

if TYPE_CHECKING:
    from ninfer_core.engine.checkpoints import Checkpoint, Continuation
    from ninfer_core.engine.request import Sequence

log = logging.getLogger("ninfer.engine.cache")

LEASE_WINDOW_TOKENS = 4096  # spec: the --kv-lease-growth window (or --prefill-chunk when larger)
TOKENS_AHEAD = 1  # positions a decode round writes per lane before the next boundary


@dataclass
class OwnPagesOffer:
    """What resuming `ckpt` of `owner` may leave unreserved: `pages` of the owner's deeper
    checkpoints `ckpts` (deepest first), plus the resumed checkpoint's tail page (`tail`)."""

    owner: Any
    ckpts: list = field(default_factory=list)
    pages: int = 0
    tail: bool = False


@dataclass
class Lease:
    """A request's unreserved pages: `debt` pages still to come from the pinned `ckpts`."""

    debt: int
    owner: Any
    ckpts: list = field(default_factory=list)


def target_pages(seq: "Sequence", page_size: int) -> int:
    """Every page the request may come to hold: its prompt plus its effective output limit."""
    return pages_for(seq.prompt_len + seq.max_tokens, page_size)


class PageLeases:
    """Grows lanes' pages at the engine boundary (own-pages leases, --kv-lease-growth)."""

    def __init__(self, pages: PagePool, cache: Any, lease_growth: bool, window_tokens: int):
        self.pages = pages
        self.cache = cache  # ninfer_core.engine.cache.ContextCache or None
        self.lease_growth = lease_growth
        self.window_pages = pages_for(window_tokens, pages.page_size)
        self.counters = {"lease_pages_collected": 0, "lease_growth_pages": 0, "lease_growth_short": 0,
                         "lease_growth_released_owners": 0}

    # -- own-pages offers (called by the context cache at admission) -----------------------------
    @staticmethod
    def offer(cache: Any, ckpt: "Checkpoint | None", owner: "Continuation | None", n_shared: int
              ) -> OwnPagesOffer | None:
        """The pages a request resuming `ckpt` (of private `owner`, or a shared prefix) need not
        reserve, or None.

        Its tail page counts when every holder's frontier stays at or below ckpt's (they re-home
        onto the request's copy at materialization) or is a lease checkpoint; a deeper checkpoint
        of a private owner is a lease checkpoint when only that owner's entries hold it and nothing
        pins it, and its pages count when lease (and re-homing) checkpoints are their only holders."""
        if ckpt is None or ckpt.host_pages or not ckpt.pages:
            return None
        f = ckpt.frontier
        holds: dict[int, int] = {}  # checkpoint id -> catalog entries holding it
        where: dict[int, Any] = {}  # checkpoint id -> the checkpoint
        others: set[int] = set()  # held by an entry of someone other than `owner`
        for o, e in cache._all_entries():
            holds[e.ckpt.id] = holds.get(e.ckpt.id, 0) + 1
            where[e.ckpt.id] = e.ckpt
            if owner is None or o is not owner:
                others.add(e.ckpt.id)
        where.setdefault(ckpt.id, ckpt)
        lease = [c for k, c in where.items() if c.frontier > f and k not in others and c.pins == 0
                 and not c.host_pages and c.refs == holds.get(k, 0)]
        lease.sort(key=lambda c: -c.frontier)
        lease_ids = {c.id for c in lease}
        tail_page = ckpt.pages[n_shared] if f % cache.page_size else None
        holders: dict[int, int] = {}
        rehome: dict[int, int] = {}
        for c in where.values():
            for p in c.pages:
                if c.id in lease_ids:
                    holders[p] = holders.get(p, 0) + 1
                elif p == tail_page and c.frontier <= f:
                    rehome[p] = rehome.get(p, 0) + 1
        shared_prefix = set(ckpt.pages[:n_shared])
        free = [p for p in set(holders) | set(rehome) if p not in shared_prefix
                and cache.pages.refcount(p) == holders.get(p, 0) + rehome.get(p, 0)]
        if not free:
            return None
        return OwnPagesOffer(owner, lease, len(free), tail=tail_page in free)

    def take(self, seq: "Sequence", offer: OwnPagesOffer, debt: int) -> None:
        """Admission gave `seq` `debt` pages fewer than its entitlement: pin the offer as its lease."""
        for c in offer.ckpts:
            c.pins += 1
        seq.lease = Lease(debt, offer.owner, list(offer.ckpts))

    def settle(self, seq: "Sequence") -> None:
        """After materialization re-homed the tail page: pay the debt from the pages it freed."""
        lease = getattr(seq, "lease", None)
        if lease is None:
            return
        n = min(lease.debt, self.pages.num_free)
        if n:
            seq.pages += self.pages.allocate(n)
            lease.debt -= n
        if lease.debt <= 0:
            self.release(seq)

    def release(self, seq: "Sequence") -> None:
        """The request ended (or owes nothing any more): unpin what is left of its lease."""
        lease = getattr(seq, "lease", None)
        if lease is None:
            return
        seq.lease = None
        for c in lease.ckpts:
            c.pins -= 1

    # -- growth at the boundary ------------------------------------------------------------------
    def grow(self, lanes: list["Sequence"], ahead: int = TOKENS_AHEAD) -> list["Sequence"]:
        """Give every decoding lane the pages its next round writes; returns the lanes that could
        not get one page (--kv-lease-growth only: they finish with length)."""
        short = []
        for seq in lanes:
            if seq.status.name != "DECODE":
                continue
            need = min(pages_for(seq.num_cached + ahead, self.pages.page_size),
                       target_pages(seq, self.pages.page_size))
            if len(seq.pages) >= need:
                continue
            if not self._extend(seq, need):
                short.append(seq)
        return short

    def _extend(self, seq: "Sequence", need: int) -> bool:
        lease = getattr(seq, "lease", None)
        if lease is not None:
            while len(seq.pages) < need and lease.debt > 0:
                if self.pages.num_free == 0 and not self._collect(lease):
                    log.warning("request %s: its page lease could not be collected; it ends at %d tokens",
                                seq.request_id, seq.num_cached)
                    return False
                seq.pages += self.pages.allocate(1)
                lease.debt -= 1
            if lease.debt <= 0:
                self.release(seq)
            if len(seq.pages) >= need:
                return True
        if not self.lease_growth:
            return len(seq.pages) >= need
        target = target_pages(seq, self.pages.page_size)
        step = min(max(self.window_pages, need - len(seq.pages)), target - len(seq.pages))
        if self.pages.num_free < step and self.cache is not None:
            self._release_idle(step)
        got = min(step, self.pages.num_free)
        if len(seq.pages) + got < need:
            self.counters["lease_growth_short"] += 1
            return False
        seq.pages += self.pages.allocate(got)
        self.counters["lease_growth_pages"] += got
        return True

    def _collect(self, lease: Lease) -> bool:
        """Drop the deepest checkpoint still in the lease; False when none is left."""
        cache = self.cache
        while lease.ckpts:
            c = lease.ckpts.pop(0)
            c.pins -= 1
            owner = lease.owner
            entry = next((e for e in owner.entries if e.ckpt is c), None) if owner is not None else None
            if entry is None:
                continue  # no longer in the catalog: its pages went with it
            before = self.pages.num_free
            owner.entries.remove(entry)
            cache._drop(c)
            cache.counters["pressure"]["checkpoint_dropped"] += 1
            self.counters["lease_pages_collected"] += self.pages.num_free - before
            if self.pages.num_free > 0:
                return True
        return self.pages.num_free > 0

    def _release_idle(self, want: int) -> None:
        """--kv-lease-growth: release idle retained owners, least recently used first, until
        `want` pages are free or none is left."""
        cache = self.cache
        while self.pages.num_free < want:
            owners = [(c.last_used, 0, c) for c in cache.continuations if c is not None and not c.busy
                      and all(e.ckpt.pins == 0 for e in c.entries)]
            owners += [(e.ckpt.last_used, 1, e) for e in cache.shared if e.ckpt.refs == 1 and e.ckpt.pins == 0]
            if not owners:
                return
            _, kind, victim = min(owners, key=lambda t: (t[0], t[1]))
            if kind == 0:
                cache.counters["pressure"]["private_owner_evicted"] += 1
                cache._evict(victim)
            else:
                cache.shared.remove(victim)
                cache.counters["pressure"]["shared_owner_evicted"] += 1
                cache._drop(victim.ckpt)
            self.counters["lease_growth_released_owners"] += 1


def build_page_leases(pages: PagePool, cache: Any, options: Any) -> PageLeases | None:
    """The engine's PageLeases: own-pages leases with the context cache (unless
    --reserve-continuation-pages), --kv-lease-growth with or without it; None when neither applies."""
    growth = bool(getattr(options, "kv_lease_growth", False))
    own = cache is not None and not getattr(options, "reserve_continuation_pages", False)
    if not growth and not own:
        return None
    leases = PageLeases(pages, cache, growth, lease_window_tokens(options))
    if cache is not None:
        cache.leases = leases
        cache.own_pages = own
    return leases


def lease_window_tokens(options: Any) -> int:
    """The --kv-lease-growth window: 4096 tokens, or --prefill-chunk when larger."""
    return max(LEASE_WINDOW_TOKENS, int(getattr(options, "prefill_chunk", 0) or 0))
