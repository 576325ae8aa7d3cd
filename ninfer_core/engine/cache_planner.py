"""Pressure planning for the checkpoint catalog (spec "Execution behavior").

Under pressure, inactive checkpoints are demoted to Host memory or evicted, chosen by the cost to
rebuild them. This module decides *which*; it is pure (no model, no pools) so it is tested on its
own (tests/test_cache_planner.py). `ninfer_core.engine.cache_admission` builds the view and applies
the plan.

The model of cost:

* Dropping checkpoint c costs the tokens a later request that would have resumed from c must
  prefill again: c's frontier minus the frontier of the next shallower checkpoint that survives
  (one whose tokens prefix c's, possibly of another owner), times c's reuse likelihood.
* Demoting c's KV pages to Host memory costs the copy back: `HOST_RESUME_COST` of its frontier,
  times the same likelihood.
* The reuse likelihood halves every `HALF_LIFE_S` seconds a checkpoint goes unused, so recency
  weighs, but a long conversation that was used a little earlier outweighs a short fresh one.

A plan frees what the request needs (Device KV pages, Host StateImage slots) at the least total
cost: a greedy choice by marginal cost per marginal unit freed, over single checkpoints and whole
owners (a page shared by several checkpoints is freed only when all of them go, which no single
choice shows; the holders of such a page, of one owner or several, form a choice of their own),
followed by dropping every choice the others make redundant. Pages held by anything
outside the plan (a running request, a checkpoint that is not a candidate) are never counted as
freed, so the plan never evicts something that frees nothing.

The search is bounded (`SEARCH_WORK` plan evaluations and `SEARCH_SECONDS` of wall time, whichever
runs out first). When the budget runs out before the greedy search covers the need, the plan falls
back to the maximal one: every evictable checkpoint dropped (`Search.budget_exhausted`,
`Search.maximal_fallback`; spec ninfer:context_pressure_searches_total{result}).

Admission weighs the room against the request's own work (`choose_resume`): each reusable resume
point (the deepest, shallower ones, root) costs the prompt tokens still to prefill above it plus the
Host copy-back of a demoted one, plus the plan that makes its room; the cheapest total wins, so a
request may resume from a shallower checkpoint (a degradation) instead of evicting a conversation
that costs more to rebuild than the degradation costs the request.

A StateImage moved from a Device state slot to Host (`state_demotion_cost`) is chosen by its reuse
likelihood (every holder's, so a prefix several conversations resume from weighs more) times the
cheaper of its copy back and rebuilding it from the next shallower retained checkpoint.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

HALF_LIFE_S = 600.0
HOST_RESUME_COST = 0.02  # a Host resume costs this share of re-prefilling the same tokens
SEARCH_WORK = 4096  # plan evaluations one search may spend
SEARCH_SECONDS = 0.05  # and wall time


def likelihood(last_used: float, now: float, half_life: float = HALF_LIFE_S) -> float:
    """Chance-like weight that a checkpoint is resumed again, halving per half life unused."""
    return 0.5 ** (max(0.0, now - last_used) / half_life)


@dataclass
class Item:
    """One inactive checkpoint the planner may demote or drop."""

    key: Hashable
    frontier: int
    weight: float = 1.0  # reuse likelihood
    # Candidate checkpoints whose tokens prefix this one's (key, frontier); equal frontiers count.
    parents: tuple[tuple[Hashable, int], ...] = ()
    floor: int = 0  # frontier of the deepest prefix checkpoint that always survives (0: root)
    on_device: bool = True  # its KV pages are in Device memory (it may be demoted)
    host_image: bool = False  # its StateImage is a Host copy (dropping it frees a Host state slot)
    owner: Hashable | None = None  # items of one owner may be evicted together


@dataclass
class Extent:
    """Pages with the same holders: `count` pages held by exactly the candidates in `holders`;
    `pinned` when something else holds them too (they are never freed)."""

    holders: frozenset
    count: int
    host: bool = False  # Host KV pages (freed by drops; demotion needs Device pages' copies)
    pinned: bool = False


@dataclass
class Plan:
    drop: list = field(default_factory=list)
    demote: list = field(default_factory=list)
    cost: float = 0.0
    freed_pages: int = 0
    freed_host_images: int = 0
    host_pages_needed: int = 0
    maximal_fallback: bool = False


@dataclass
class Search:
    """What the last `Planner.plan` call spent (kept on the planner as `last`)."""

    work: int = 0
    budget_exhausted: bool = False
    maximal_fallback: bool = False
    stop_reason: str = "no_pressure"  # no_pressure | queue_exhausted | work_budget | time_budget


class Planner:
    """Plans over one view of the catalog (items and page extents)."""

    def __init__(self, items: Iterable[Item], extents: Iterable[Extent], host_free_pages: int = 0,
                 work: int | None = None, seconds: float | None = None):
        self.work_budget = SEARCH_WORK if work is None else work
        self.seconds = SEARCH_SECONDS if seconds is None else seconds
        self.last = Search()
        self.items = {it.key: it for it in items}
        self.extents = [e for e in extents if e.count > 0 and e.holders]
        self.host_free = host_free_pages
        self._by_key: dict[Hashable, list[int]] = {}
        for i, e in enumerate(self.extents):
            for k in e.holders:
                self._by_key.setdefault(k, []).append(i)

    # -- measures ---------------------------------------------------------------------------------
    def cost(self, drop: frozenset, demote: frozenset) -> float:
        total = 0.0
        for k in drop:
            it = self.items[k]
            base = it.floor
            for pk, pf in it.parents:
                if pk not in drop and pf > base:
                    base = pf
            total += max(0, it.frontier - base) * it.weight
        for k in demote:
            it = self.items[k]
            total += it.frontier * HOST_RESUME_COST * it.weight
        return total

    def freed_pages(self, drop: frozenset, demote: frozenset) -> int:
        gone = drop | demote
        return sum(e.count for e in self.extents if not e.host and not e.pinned and e.holders <= gone)

    def evictable(self, keep: frozenset = frozenset()) -> frozenset:
        return frozenset(k for k in self.items if k not in keep)

    def host_pages_needed(self, demote: frozenset) -> int:
        return sum(e.count for e in self.extents if not e.host and e.holders & demote)

    def host_pages_freed(self, drop: frozenset) -> int:
        return sum(e.count for e in self.extents if e.host and not e.pinned and e.holders <= drop)

    def freed_host_images(self, drop: frozenset) -> int:
        return sum(1 for k in drop if self.items[k].host_image)

    def feasible(self, drop: frozenset, demote: frozenset) -> bool:
        return self.host_pages_needed(demote) <= self.host_free + self.host_pages_freed(drop)

    # -- search -----------------------------------------------------------------------------------
    def plan(self, need_pages: int = 0, need_host_images: int = 0, limit: float = math.inf,
             keep: Iterable[Hashable] = (), deadline: float | None = None) -> Plan | None:
        """The cheapest plan found that frees `need_pages` Device pages and `need_host_images` Host
        state slots, or None when none does (or every one costs more than `limit`). Items in `keep`
        (a resume point the request will copy from) are neither dropped nor demoted. The search
        spends at most the planner's work and time budget; past it the maximal plan (every other
        item dropped) stands in when it covers the need (`self.last` says which happened).
        `deadline` (monotonic) replaces the planner's own time budget, for several searches that
        share one."""
        need_pages, need_host_images = max(0, need_pages), max(0, need_host_images)
        keep = frozenset(keep)
        self.last = search = Search()
        if deadline is None:
            deadline = time.monotonic() + self.seconds

        def progress(drop, demote) -> float:
            p = min(self.freed_pages(drop, demote), need_pages) / need_pages if need_pages else 0.0
            h = min(self.freed_host_images(drop), need_host_images) / need_host_images if need_host_images else 0.0
            return p + h

        target = (1.0 if need_pages else 0.0) + (1.0 if need_host_images else 0.0)
        drop: frozenset = frozenset()
        demote: frozenset = frozenset()
        if target == 0:
            return Plan()
        search.stop_reason = "queue_exhausted"
        if progress(self.evictable(keep), frozenset()) < target - 1e-9:
            return None  # even every evictable checkpoint would not do: no search
        actions = [(kind, keys) for kind, keys in self._actions(need_pages > 0) if not keys & keep]
        done = progress(drop, demote)
        cost = 0.0
        while done < target - 1e-9:
            best = None
            for kind, keys in actions:
                search.work += 1
                if search.work > self.work_budget or (search.work % 64 == 0 and time.monotonic() > deadline):
                    search.stop_reason = "work_budget" if search.work > self.work_budget else "time_budget"
                    search.budget_exhausted = True
                    return self._maximal(progress, target, limit, keep)
                if kind == "drop":
                    nd, nm = drop | keys, demote - keys
                else:
                    nm = demote | (keys - drop)
                    nd = drop
                if nd == drop and nm == demote:
                    continue
                gain = progress(nd, nm) - done
                if gain <= 1e-12:
                    continue
                if not self.feasible(nd, nm):
                    # A demotion blocked by a full Host KV tier may drop Host-resident checkpoints
                    # to make room, their rebuild cost counted in.
                    room = self._host_relief(nd, nm, keep) if kind == "demote" else None
                    if room is None:
                        continue
                    nd = nd | room
                delta = self.cost(nd, nm) - cost
                score = (delta / gain, -gain)
                if best is None or score < best[0]:
                    best = (score, nd, nm)
            if best is None:
                # Every evictable checkpoint together covers the need (checked above) but no
                # action adds to what the plan frees: fall back to the maximal plan rather than
                # leave the request waiting for pages that retained checkpoints hold forever.
                return self._maximal(progress, target, limit, keep)
            _, drop, demote = best
            cost = self.cost(drop, demote)
            done = progress(drop, demote)
        # Drop choices the others made redundant, the most expensive first.
        for k in sorted(drop | demote, key=lambda k: -self._alone(k, drop, demote)):
            nd, nm = drop - {k}, demote - {k}
            if progress(nd, nm) >= target - 1e-9 and self.feasible(nd, nm) and self.cost(nd, nm) <= cost:
                drop, demote = nd, nm
                cost = self.cost(drop, demote)
        # The greedy ratio can walk past one choice that alone covers the need more cheaply.
        for kind, keys in actions:
            search.work += 1
            nd, nm = (keys, frozenset()) if kind == "drop" else (frozenset(), keys)
            if progress(nd, nm) >= target - 1e-9 and self.feasible(nd, nm):
                c = self.cost(nd, nm)
                if c < cost - 1e-9:
                    drop, demote, cost = nd, nm, c
        if cost > limit:
            return None
        return self._result(drop, demote, cost)

    def _result(self, drop: frozenset, demote: frozenset, cost: float, maximal: bool = False) -> Plan:
        order = sorted(self.items, key=str)
        return Plan(drop=[k for k in order if k in drop], demote=[k for k in order if k in demote],
                    cost=cost, freed_pages=self.freed_pages(drop, demote),
                    freed_host_images=self.freed_host_images(drop),
                    host_pages_needed=self.host_pages_needed(demote), maximal_fallback=maximal)

    def _maximal(self, progress, target: float, limit: float, keep: frozenset) -> Plan | None:
        """The budget ran out: every evictable item dropped, if that covers the need."""
        drop = self.evictable(keep)
        if progress(drop, frozenset()) < target - 1e-9:
            return None
        cost = self.cost(drop, frozenset())
        if cost > limit:
            return None
        self.last.maximal_fallback = True
        return self._result(drop, frozenset(), cost, maximal=True)

    def _host_relief(self, drop: frozenset, demote: frozenset, keep: frozenset = frozenset()
                     ) -> frozenset | None:
        """Host-resident checkpoints to drop so the demotions fit the Host KV tier (cheapest per
        Host page freed first), or None when they cannot."""
        added: frozenset = frozenset()
        while not self.feasible(drop | added, demote):
            base_cost = self.cost(drop | added, demote)
            base_freed = self.host_pages_freed(drop | added)
            best = None
            for k, it in self.items.items():
                if it.on_device or k in drop or k in added or k in demote or k in keep:
                    continue
                trial = drop | added | {k}
                freed = self.host_pages_freed(trial) - base_freed
                if freed <= 0:
                    continue
                score = (self.cost(trial, demote) - base_cost) / freed
                if best is None or score < best[0]:
                    best = (score, k)
            if best is None:
                return None
            added = added | {best[1]}
        return added

    def _alone(self, k, drop, demote) -> float:
        return self.cost(drop, demote) - self.cost(drop - {k}, demote - {k})

    def _actions(self, pages: bool) -> list[tuple[str, frozenset]]:
        acts: list[tuple[str, frozenset]] = []
        owners: dict[Hashable, set] = {}
        for k, it in self.items.items():
            acts.append(("drop", frozenset((k,))))
            if pages and it.on_device:
                acts.append(("demote", frozenset((k,))))
            if it.owner is not None:
                owners.setdefault(it.owner, set()).add(k)
        groups = [frozenset(keys) for keys in owners.values() if len(keys) > 1]
        if pages:
            # A Device page held by checkpoints of several owners (a conversation that resumed from
            # another's turn closure shares its tail page) is freed only when all of them go, which
            # neither a single checkpoint nor one owner's group shows: its holders form a choice.
            for e in self.extents:
                keys = frozenset(k for k in e.holders if k in self.items)
                if not e.host and not e.pinned and len(keys) > 1 and keys == e.holders:
                    groups.append(keys)
        for keys in dict.fromkeys(groups):
            acts.append(("drop", keys))
            dev = frozenset(k for k in keys if self.items[k].on_device)
            if pages and len(dev) > 1:
                acts.append(("demote", dev))
        return acts


@dataclass
class Resume:
    """One resume point admission may give a request: `work` is what the request itself spends
    from it (prompt tokens to prefill, plus a demoted checkpoint's copy back), `need_pages` the
    Device pages still missing for its entitlement, `keep` the planner item it copies from."""

    key: Hashable
    frontier: int
    work: float
    need_pages: int
    keep: tuple = ()


@dataclass
class Choice:
    resume: Resume
    plan: Plan | None
    total: float
    deepest: Resume
    evaluated: int = 0
    work: int = 0
    budget_exhausted: bool = False

    @property
    def degradation(self) -> int:
        """Prompt tokens of reuse given up against the deepest resume point."""
        return self.deepest.frontier - self.resume.frontier


def resume_work(prompt_len: int, frontier: int, host_kv: bool) -> float:
    """What a request spends resuming at `frontier`: the prefill above it, plus a Host copy back."""
    return max(0, prompt_len - frontier) + (frontier * HOST_RESUME_COST if host_kv else 0.0)


def choose_resume(planner: Planner, options: list[Resume]) -> Choice | None:
    """The resume point whose own work plus the plan making its room costs least (deepest first on
    ties); None when no option can be given room. `options` are deepest first; the first needs no
    room ends the comparison early only when it is the deepest (no pressure, no search)."""
    if not options:
        return None
    deepest = options[0]
    deadline = time.monotonic() + planner.seconds  # one time budget for every option's search
    best: Choice | None = None
    work = 0
    exhausted = False
    for n, r in enumerate(options, 1):
        if r.need_pages <= 0:
            plan: Plan | None = Plan()
        else:
            plan = planner.plan(need_pages=r.need_pages, keep=r.keep, deadline=deadline)
            work += planner.last.work
            exhausted = exhausted or planner.last.budget_exhausted
        if plan is None:
            continue
        total = r.work + plan.cost
        if best is None or total < best.total - 1e-9:
            best = Choice(r, plan, total, deepest)
        if r.need_pages <= 0 and n == 1:
            break
    if best is not None:
        best.evaluated, best.work, best.budget_exhausted = len(options), work, exhausted
    return best


def state_demotion_cost(weight: float, copy_back: float, rebuild: float) -> float:
    """Expected cost of moving a StateImage to Host: its reuse likelihood times the cheaper of the
    copy back and rebuilding it (tokens above the next shallower retained checkpoint)."""
    return weight * min(copy_back, max(0.0, rebuild))


def combined_likelihood(weights: Iterable[float]) -> float:
    """Chance that any of several holders resumes a checkpoint (independent holders)."""
    miss = 1.0
    for w in weights:
        miss *= 1.0 - min(1.0, max(0.0, w))
    return 1.0 - miss


def lru_choice(items: Iterable[tuple[Hashable, float]]) -> Hashable | None:
    """What a least-recently-used policy would evict first (the comparison the tests draw)."""
    items = list(items)
    return min(items, key=lambda kv: kv[1])[0] if items else None
