"""Admission and pressure for the checkpoint catalog.

Owns what admission decides for a request: which retained checkpoint it resumes from (or root),
the pages it gets (shared prefix pages, fresh pages, an own-pages lease), its reuse plan
(`ReusePlan`, kept on the Sequence as `seq.cache_plan`) and the holds it takes and gives back
(`release`). Under pressure it builds the planner's view of the catalog (`_pressure_view`), weighs
the resume points against the room each needs (cache_planner.choose_resume), and carries out the
plan (`_apply`: drops, evictions, demotions), and picks the continuation cell to evict when a cell
is needed (`_free_cell`). The copies a plan needs are cache_tiers' (`_pages_to_host`, `_evict`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ninfer_core.engine import cache_tiers as tiers
from ninfer_core.engine.cache_catalog import MAX_RESUME_OPTIONS, _opted_out, _session
from ninfer_core.engine.cache_planner import (
    Extent,
    Item,
    Planner,
    Resume,
    choose_resume,
    likelihood,
    resume_work,
)
from ninfer_core.engine.checkpoints import KIND_SOURCE, Checkpoint, Continuation, Entry
from ninfer_core.engine.pages import pages_for

if TYPE_CHECKING:
    from ninfer_core.engine.request import Sequence

log = logging.getLogger("ninfer.engine.cache")


@dataclass
class ReusePlan:
    """What admission decided for one request (kept on the Sequence as `seq.cache_plan`)."""

    source: str = "root"
    ckpt: Checkpoint | None = None
    owner: Continuation | None = None  # the continuation the checkpoint came from, if private
    kind: str | None = None
    captures: dict[int, str] = field(default_factory=dict)  # frontier -> kind, during prefill
    inherited: list[Entry] = field(default_factory=list)  # entries (each pinned) the request keeps
    captured: list[Entry] = field(default_factory=list)  # checkpoints this request captured
    materialized: bool = False

    @property
    def frontier(self) -> int:
        return self.ckpt.frontier if self.ckpt is not None else 0


class Admission:
    """Mixin of the catalog (cache_catalog.CheckpointCatalog): admission of a request, and the
    pressure plans that make its room."""

    def make_room(self, seq: Sequence) -> bool:
        """Plan the head request's reuse and free pages (evicting inactive owners) until its
        entitlement fits; False when it must wait.

        Without pressure the request resumes from the deepest checkpoint. Under pressure the
        resume points (the deepest few and root) are weighed: the request's own work from each plus
        the plan that makes its room (cache_planner.choose_resume), so a request may resume from a
        shallower checkpoint rather than evict a conversation dearer to rebuild than what it loses.
        Active requests' pages are never victims. The decision is kept on the request
        (`seq.cache_choice`) for `admit` and its completion report."""
        seq.cache_choice = None
        t_plan = time.monotonic_ns()
        deepest = None
        if not _opted_out(seq):  # cache_prompt false: prefilled from root, nothing shared
            deepest = self.select(seq.prompt_ids, _session(seq))
            if deepest[0] is None and self.disk is not None and self.disk.restore:
                self._restore_from_disk(seq, self._clock())
                deepest = self.select(seq.prompt_ids, _session(seq))
            if deepest[0] is None:
                deepest = None
        need = seq.entitlement_pages - self._shared_pages(deepest[0] if deepest else None) - self.pages.num_free
        summary = {"resume_tokens": deepest[0].frontier if deepest else 0,
                   "best_reuse_prompt_tokens": deepest[0].frontier if deepest else 0,
                   "degradation_tokens": 0, "targets_evaluated": 1 if deepest else 0, "search_work": 0,
                   "predicted_cost_tokens": 0.0, "budget_exhausted": False, "maximal_fallback": False,
                   "stop_reason": "no_pressure"}
        if need <= 0:
            summary["planning_elapsed_ns"] = time.monotonic_ns() - t_plan
            seq.cache_choice = {"resume": deepest, "summary": summary}
            return True
        offer = self._own_pages(seq, deepest)  # the continuation's own pages need no reservation
        if offer is not None and need <= offer.pages:
            summary["planning_elapsed_ns"] = time.monotonic_ns() - t_plan
            summary["lease_pages"] = need
            seq.cache_choice = {"resume": deepest, "summary": summary, "offer": offer}
            return True
        pending = self._spill_pending_pages()
        if pending >= need:
            return False  # evicted owners are being written out a batch at a time; their pages follow
        # Under pressure only: every resume point the prompt has (a catalog scan).
        cands = self.candidates(seq.prompt_ids, _session(seq)) if deepest is not None else []
        return self._admission_plan(seq, cands, summary, pending, t_plan)

    def _admission_plan(self, seq: Sequence, cands: list, summary: dict, pending: int = 0,
                        t_plan: int | None = None) -> bool:
        now, now_ns = self._clock(), time.monotonic_ns()
        items, extents, entries, ckpts = self._pressure_view(None, now)
        planner = Planner(items, extents, self.host_pages.num_free)
        options: list[Resume] = []
        by_key: dict[Any, Any] = {}
        free = self.pages.num_free + pending
        offers: dict[Any, Any] = {}
        for cand in list(cands[: MAX_RESUME_OPTIONS - 1]) + [None]:
            ckpt = cand[0] if cand is not None else None
            f = ckpt.frontier if ckpt is not None else 0
            key = ckpt.id if ckpt is not None else "root"
            by_key[key] = cand
            keep = (ckpt.id,) if ckpt is not None and ckpt.id in planner.items else ()
            offer = offers[key] = self._own_pages(seq, cand)
            borrow = offer.pages if offer is not None else 0
            if offer is not None:  # the lease stays where it is: the plan must not take it
                keep += tuple(c.id for c in offer.ckpts if c.id in planner.items)
            options.append(Resume(key, f, resume_work(seq.prompt_len, f, bool(ckpt is not None and ckpt.host_pages)),
                                  seq.entitlement_pages - self._shared_pages(ckpt) - free - borrow, keep))
        choice = choose_resume(planner, options)
        summary["planning_elapsed_ns"] = time.monotonic_ns() - (t_plan if t_plan is not None else now_ns)
        if choice is not None and choice.budget_exhausted:
            self.counters["searches"]["budget_exhausted"] += 1
        if choice is None:  # nothing frees enough: the head waits for running requests
            self.counters["searches"]["infeasible"] += 1
            return False
        plan = choice.plan
        summary.update(resume_tokens=choice.resume.frontier, degradation_tokens=choice.degradation,
                       targets_evaluated=choice.evaluated, search_work=choice.work,
                       predicted_cost_tokens=round(choice.total, 1), budget_exhausted=choice.budget_exhausted,
                       maximal_fallback=plan.maximal_fallback,
                       stop_reason="work_budget" if choice.budget_exhausted else "queue_exhausted")
        if plan.drop or plan.demote:
            log.debug("context cache: admission resumes at %d of %d tokens; plan drops %d and demotes %d "
                      "checkpoints (cost %.0f tokens)", choice.resume.frontier, choice.deepest.frontier,
                      len(plan.drop), len(plan.demote), plan.cost)
            self.counters["searches"]["started"] += 1  # spec: plans accepted into a resource transaction
            if plan.maximal_fallback:
                self.counters["searches"]["maximal_fallback"] += 1
            self._apply(plan, entries, ckpts)
        resume = by_key[choice.resume.key]
        offer = offers.get(choice.resume.key)
        borrow = offer.pages if offer is not None else 0
        if self.pages.num_free < seq.entitlement_pages - self._shared_pages(resume[0] if resume else None) - borrow:
            return False
        seq.cache_choice = {"resume": resume, "summary": summary, "offer": offer}
        return True

    def _own_pages(self, seq: Sequence, cand) -> Any:
        """The own-pages offer (cache_lease) for resuming `cand`, when it leaves room for the prompt
        and its first output token in the pages admission does reserve."""
        if self.leases is None or not self.own_pages or cand is None:
            return None
        ckpt, owner, _ = cand
        offer = self.leases.offer(self, ckpt, owner, self._shared_pages(ckpt))
        if offer is None:
            return None
        offer.pages = min(offer.pages, seq.entitlement_pages - pages_for(seq.prompt_len + 1, self.page_size))
        return offer if offer.pages > 0 else None

    def admit(self, seq: Sequence, now: float) -> None:
        """Give an admitted request its pages (shared prefix + fresh) and its reuse plan."""
        choice = getattr(seq, "cache_choice", None)
        if _opted_out(seq):
            ckpt, owner, kind = None, None, None
        elif choice is not None and (choice["resume"] is None or choice["resume"][0].refs > 0):
            ckpt, owner, kind = choice["resume"] or (None, None, None)  # make_room's decision
        else:
            ckpt, owner, kind = self.select(seq.prompt_ids, _session(seq))
        if choice is not None:
            summary = choice["summary"]
            seq.cache_materialization = summary
            if summary["degradation_tokens"] > 0:
                self.counters["degraded_admissions"] += 1
                self.counters["degraded_tokens"] += summary["degradation_tokens"]
        plan = ReusePlan()
        if ckpt is not None:
            plan.ckpt, plan.owner, plan.kind = self._hold(ckpt), owner, kind
            plan.source = "shared_stable_prefix" if owner is None else KIND_SOURCE[kind]
            ckpt.last_used = now
            if owner is not None:
                owner.last_used = now
                owner.busy += 1
                plan.inherited = self._inherit(owner, ckpt)
        f = plan.frontier
        n_shared = self._shared_pages(ckpt)
        want = seq.entitlement_pages - n_shared
        offer = choice.get("offer") if choice is not None else None
        debt = 0
        if offer is not None and choice["resume"] is not None and ckpt is choice["resume"][0]:
            debt = max(0, want - self.pages.num_free)  # covered by the lease (make_room checked)
        fresh = self.pages.allocate(want - debt)
        if debt:
            self.leases.take(seq, offer, debt)
        seq.pages = (self.pages.share(ckpt.pages[:n_shared]) if n_shared else []) + fresh
        if ckpt is not None:
            ckpt.pins += 1  # materialize copies from it: it may not be demoted before then
        seq.num_cached = f
        seq.cache_n = f
        seq.cache_plan = plan
        seq.cache_source = plan.source
        plan.captures = self._plan_captures(seq, plan)
        self.counters["selections"][plan.source] += 1
        self.counters["reused_prompt_tokens"] += f
        self.counters["computed_prefill_tokens"] += seq.prompt_len - f

    def _inherit(self, owner: Continuation, ckpt: Checkpoint) -> list[Entry]:
        """The owner's entries at or below the reuse frontier that the new session keeps (pinned);
        the endpoint it extends becomes an endpoint anchor."""
        keep = []
        for e in owner.entries:
            if e.ckpt.frontier > ckpt.frontier:
                continue
            kind = e.kind
            if kind == "endpoint":
                if not self.caps.endpoint_anchors:
                    continue
                kind = "long_anchor"
            keep.append(Entry(kind, self._hold(e.ckpt)))
        return keep

    def release(self, seq: Sequence) -> None:
        """Drop every hold a request took at admission (cancel, failure or after publishing)."""
        if self.leases is not None:
            self.leases.release(seq)
        plan: ReusePlan | None = getattr(seq, "cache_plan", None)
        if plan is None:
            return
        seq.cache_plan = None
        if plan.owner is not None:
            plan.owner.busy = max(0, plan.owner.busy - 1)
        for e in plan.captured + plan.inherited:
            self._drop(e.ckpt)
        if plan.ckpt is not None:
            if not plan.materialized:
                plan.ckpt.pins -= 1
            self._drop(plan.ckpt)
        plan.captured, plan.inherited, plan.ckpt = [], [], None

    def free_pages(self, need: int, keep: Checkpoint | None = None) -> bool:
        """Free `need` more Device pages by demoting or evicting inactive checkpoints, the plan that
        costs the retained work least (cache_planner); False when no plan frees enough."""
        target = self.pages.num_free + need
        if need > 0:
            self._relieve(need_pages=need, keep=keep)
            if self._spilling:  # a synchronous caller (slot restore) needs the pages now
                self.drain_spills(tiers.DISK_WRITE_DEADLINE_S)
        return self.pages.num_free >= target

    def _relieve(self, need_pages: int = 0, need_host_images: int = 0, keep: Checkpoint | None = None,
                 limit: float = float("inf")) -> bool:
        now = self._clock()
        items, extents, entries, ckpts = self._pressure_view(keep, now)
        planner = Planner(items, extents, self.host_pages.num_free)
        plan = planner.plan(need_pages, need_host_images, limit)
        if planner.last.budget_exhausted:
            self.counters["searches"]["budget_exhausted"] += 1
        if plan is None:
            self.counters["searches"]["infeasible"] += 1
            return False
        self.counters["searches"]["started"] += 1
        if plan.maximal_fallback:
            self.counters["searches"]["maximal_fallback"] += 1
        log.debug("context cache: pressure plan drops %d and demotes %d checkpoints (cost %.0f tokens)",
                  len(plan.drop), len(plan.demote), plan.cost)
        self._apply(plan, entries, ckpts)
        return True

    def _pressure_view(self, keep: Checkpoint | None, now: float):
        """The catalog as the planner sees it: one Item per checkpoint only catalog entries hold
        (not a running request's, not one a request is about to materialize, not `keep`), and the
        Device and Host page extents they hold."""
        entries: dict[int, list] = {}
        ckpts: dict[int, Checkpoint] = {}
        owner_key: dict[int, Any] = {}
        for owner, e in self._all_entries():
            entries.setdefault(e.ckpt.id, []).append((owner, e))
            ckpts[e.ckpt.id] = e.ckpt
            owner_key.setdefault(e.ckpt.id, ("private", owner.slot) if owner is not None else ("shared", e.ckpt.id))
        victims = {k: c for k, c in ckpts.items()
                   if c.refs == len(entries[k]) and c.pins == 0 and c is not keep}
        others = [c for c in ckpts.values() if c.id not in victims] + ([keep] if keep is not None else [])
        items = []
        for k, c in victims.items():
            parents = tuple((p.id, p.frontier) for p in victims.values() if p is not c and self._is_prefix(p, c))
            floor = max((p.frontier for p in others if self._is_prefix(p, c)), default=0)
            items.append(Item(k, c.frontier, likelihood(c.last_used, now), parents, floor, bool(c.pages),
                              c.image is not None, owner_key[k]))
        dev: dict[int, set] = {}
        host: dict[int, set] = {}
        for k, c in victims.items():
            for p in c.pages:
                dev.setdefault(p, set()).add(k)
            for p in c.host_pages:
                host.setdefault(p, set()).add(k)
        counts: dict[tuple, int] = {}
        for pages, pool, is_host in ((dev, self.pages, False), (host, self.host_pages, True)):
            for p, holders in pages.items():
                key = (frozenset(holders), is_host, pool.refcount(p) > len(holders))
                counts[key] = counts.get(key, 0) + 1
        extents = [Extent(h, n, is_host, pinned) for (h, is_host, pinned), n in counts.items()]
        return items, extents, entries, ckpts

    def _apply(self, plan, entries: dict[int, list], ckpts: dict[int, Checkpoint]) -> None:
        """Carry out a pressure plan: the drops (a continuation that loses every checkpoint is evicted,
        written to the disk tier and its bound slot file first), then Host copies of the demoted
        checkpoints' pages (a page shared by several of them is copied once)."""
        touched: dict[Any, str] = {}
        dropped = set(plan.drop)
        for c in [c for c in self.continuations if c is not None]:
            gone = [e for e in c.entries if e.ckpt.id in dropped]
            if not gone:
                continue
            if len(gone) == len(c.entries):
                self.counters["pressure"]["private_owner_evicted"] += 1
                touched.pop(id(c), None)
                self._evict(c)
                continue
            touched[id(c)] = "private_degraded"
            for e in gone:
                c.entries.remove(e)
                self._drop(e.ckpt)
                self.counters["pressure"]["checkpoint_dropped"] += 1
        for e in [e for e in self.shared if e.ckpt.id in dropped]:
            self.shared.remove(e)
            self.counters["pressure"]["shared_owner_evicted"] += 1
            self._drop(e.ckpt)
            touched.pop(("shared", e.ckpt.id), None)
        # Demotions after the drops: Host pages the drops free may be what the copies need.
        demote = [ckpts[k] for k in plan.demote]
        if demote:
            self._pages_to_host(demote)
            for c in demote:
                for owner, _ in entries[c.id]:
                    touched[id(owner) if owner is not None else ("shared", c.id)] = \
                        "private_demoted" if owner is not None else "shared_degraded"
        for what in touched.values():
            if what == "shared_degraded":
                self.counters["pressure"]["shared_owner_degraded"] += 1
            else:
                self.counters["pressure"]["private_owner_degraded"] += 1
                if what == "private_demoted":
                    self.counters["pressure"]["private_owner_demoted"] += 1

    def _free_cell(self) -> int:
        for i, c in enumerate(self.continuations):
            if c is None:
                return i
        victims = [c for c in self.continuations if c is not None and not c.busy] or \
            [c for c in self.continuations if c is not None]
        victim = self._cheapest_owner(victims)
        self.counters["pressure"]["private_owner_evicted"] += 1
        self._evict(victim)
        return victim.slot

    def _cheapest_owner(self, conts: list[Continuation]) -> Continuation:
        """The continuation whose eviction costs the least to rebuild (ties: least recently used)."""
        if len(conts) == 1:
            return conts[0]
        now = self._clock()
        view = self._pressure_view(None, now)
        planner = Planner(view[0], view[1])

        def cost(c: Continuation) -> float:
            keys = frozenset(e.ckpt.id for e in c.entries if e.ckpt.id in planner.items)
            return planner.cost(keys, frozenset())

        return min(conts, key=lambda c: (cost(c), c.last_used))
