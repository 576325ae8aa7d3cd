"""The checkpoint catalog: exact prefix reuse for hybrid (attention + recurrent) models.

A Gated DeltaNet layer's state cannot be cut at an arbitrary token, so the cache keeps whole
checkpoints (KV pages + StateImage) at chosen frontiers and a request resumes from the deepest one
whose tokens are its own prompt's prefix, token for token (spec "Execution behavior"):

* private continuations (/slots cells, `--max-private-continuations`): each finished conversation's
  endpoint (the executed frontier: the last sampled token is not in the KV yet), the turn closure
  before the assistant opener, and long anchors (endpoint anchors, client markers, automatic
  anchors at message boundaries);
* shared stable prefixes (`--max-shared-prefixes`): a system/tools prefix captured and published on
  its second sighting across conversations.

Captures cost no extra forward: the engine ends a prefill chunk at every planned frontier (splitting
a chunk where needed) and copies the lane's state there, and takes the endpoint at request end.
StateImages live in Device state slots (runner slots past the lanes) or, demoted under pressure,
as Host copies; pages are shared by reference count with the tail page copied on write.

The engine worker calls everything here under its lock; the model calls (state and page copies)
are fast copies, never forwards.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ninfer_core import hookimpl
from ninfer_core.engine.cache_host import HostPagePool
from ninfer_core.engine.cache_planner import (
    HOST_RESUME_COST,
    Extent,
    Item,
    Planner,
    Resume,
    choose_resume,
    combined_likelihood,
    likelihood,
    resume_work,
    state_demotion_cost,
)
from ninfer_core.engine.checkpoints import (
    KIND_SOURCE,
    SOURCES,
    Checkpoint,
    CheckpointHints,
    Continuation,
    Entry,
    hints_from_chat_tokens,
)
from ninfer_core.engine.pages import PagePool, pages_for

if TYPE_CHECKING:
    from ninfer_core.engine.request import Sequence

log = logging.getLogger("ninfer.engine.cache")

DISK_WRITE_BATCH_PAGES = 16  # cache_disk.WRITE_BATCH_PAGES: pages read out per boundary
DISK_WRITE_DEADLINE_S = 20.0  # spec "Disk tier": an evicted owner is written within 20 s
MAX_RESUME_OPTIONS = 4  # resume points admission weighs under pressure: the deepest few and root
ENDPOINT_ANCHOR_MIN_GAP = 1024  # spec: an endpoint anchor fires >= 1024 tokens above deeper anchors
BRANCH_ANCHOR_MIN_GAP = 1024


@dataclass
class CacheCapacities:
    """Resolved context-cache capacities (spec "Server options")."""

    device_state_slots: int
    host_state_slots: int
    host_kv_bytes: int
    max_private_continuations: int
    max_shared_prefixes: int
    max_long_anchors: int
    auto_long_anchors: bool = False
    long_anchor_spacing: int = 1024
    branch_anchors: bool = False
    endpoint_anchors: bool = True
    host_cache_budget_bytes: int | None = None

    @classmethod
    def resolve(cls, options, state_bytes: int) -> CacheCapacities:
        """From EngineOptions; `--host-cache-mib` derives the Host state/KV split.

        Raises ValueError when the state footprint a budget implies exceeds half of it.
        """
        c = options.max_concurrency
        auto = bool(getattr(options, "auto_long_anchors", False))
        anchors = getattr(options, "max_long_anchors_per_continuation", None)
        anchors = (4 if auto else 2) if anchors is None else anchors
        private = getattr(options, "max_private_continuations", None) or 2 * c
        shared = getattr(options, "max_shared_prefixes", None)
        shared = max(c, 7) if shared is None else shared
        dev = getattr(options, "device_state_slots", None)
        dev = c if dev is None else dev
        budget_mib = getattr(options, "host_cache_mib", None)
        host_state = getattr(options, "host_state_slots", None)
        host_kv_mib = getattr(options, "host_kv_mib", None)
        budget = None
        if budget_mib is not None:
            budget = budget_mib * 2**20
            host_state = (2 + anchors) * private + shared
            if auto and anchors and state_bytes:
                # Spend the remaining state headroom (under half the budget) on more anchors.
                while (2 + anchors + 1) * private + shared <= budget // 2 // max(state_bytes, 1) \
                        and anchors < 64:
                    anchors += 1
                host_state = (2 + anchors) * private + shared
            if host_state * state_bytes > budget // 2:
                raise ValueError(
                    f"--host-cache-mib {budget_mib}: {host_state} Host StateImages of "
                    f"{state_bytes} bytes exceed half of the budget")
            host_kv = budget - host_state * state_bytes
        else:
            host_state = 8 if host_state is None else host_state
            host_kv = (8192 if host_kv_mib is None else host_kv_mib) * 2**20
        return cls(dev, host_state, host_kv, private, shared, anchors, auto,
                   int(getattr(options, "long_anchor_spacing", 1024)),
                   bool(getattr(options, "branch_anchors", False)),
                   bool(getattr(options, "endpoint_anchors", True)), budget)


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


class ContextCache:
    """The checkpoint catalog over one engine's page pool and the runner's extra state slots."""

    name = "checkpoint_catalog"

    def __init__(self, runner, pages: PagePool, lanes: int, caps: CacheCapacities, state_bytes: int,
                 page_size: int, kv_bytes_per_token: int = 0):
        self.runner = runner
        self.kv_bytes_per_token = kv_bytes_per_token
        self.disk = None  # ninfer_core.engine.cache_disk.DiskTier with --disk-kv-path
        # cache_lease.PageLeases (set by build_page_leases); own_pages: a resumed continuation's
        # own pages need no reservation at admission (off with --reserve-continuation-pages)
        self.leases = None
        self.own_pages = True
        self._clock = _monotonic
        self.pages = pages
        self.caps = caps
        self.state_bytes = state_bytes
        self.page_size = page_size
        self._device_free = list(range(lanes + caps.device_state_slots - 1, lanes - 1, -1))
        self.device_slots_total = caps.device_state_slots
        self.host_images = 0
        self.page_bytes = page_size * kv_bytes_per_token
        # Host KV tier, in pages of one Device page's bytes (spec: "physical page extents").
        self.host_pages = HostPagePool(caps.host_kv_bytes // self.page_bytes if self.page_bytes else 0,
                                       self.page_bytes)
        self.spiller = None  # cache_spill.SlotSpiller with --auto-save-evicted
        # Evicted continuations still being written to the disk tier, a batch per boundary; they
        # keep their memory (out of the catalog) until read out or abandoned.
        self._spilling: list[tuple[Continuation, Any]] = []
        self._prefix_memo: dict[tuple[int, int], bool] = {}
        self.continuations: list[Continuation | None] = [None] * caps.max_private_continuations
        self.shared: list[Entry] = []
        self._sightings: dict[tuple[int, ...], int] = {}  # stable prefix -> times seen
        self.counters: dict[str, Any] = {
            "reused_prompt_tokens": 0, "computed_prefill_tokens": 0, "checkpoints_captured": 0,
            "captures_in_chunk": 0,
            "selections": dict.fromkeys(SOURCES, 0),
            "pressure": dict.fromkeys(("private_owner_evicted", "shared_owner_evicted",
                                       "private_owner_degraded", "shared_owner_degraded",
                                       "private_owner_demoted", "checkpoint_dropped"), 0),
            "searches": dict.fromkeys(("started", "budget_exhausted", "maximal_fallback", "infeasible"), 0),
            "degraded_admissions": 0, "degraded_tokens": 0,
            "captures_skipped": 0,
            "salvage": dict.fromkeys(("published", "cancelled_prefills", "cancelled_prefills_salvaged"), 0),
            "transfer_bytes": {"state_d2h": 0, "state_h2d": 0, "main_kv_d2h": 0, "main_kv_h2d": 0},
        }

    # -- pools ------------------------------------------------------------------------------------
    @property
    def host_kv_used(self) -> int:
        """Bytes of Host KV pages in use."""
        return self.host_pages.bytes_used

    @property
    def device_slots_used(self) -> int:
        return self.device_slots_total - len(self._device_free)

    def runner_slots(self, lanes: int) -> int:
        return lanes + self.device_slots_total

    def _all_entries(self):
        for c in self.continuations:
            if c is not None:
                for e in c.entries:
                    yield c, e
        for e in self.shared:
            yield None, e

    def _hold(self, ckpt: Checkpoint) -> Checkpoint:
        ckpt.refs += 1
        return ckpt

    def _drop(self, ckpt: Checkpoint) -> None:
        ckpt.refs -= 1
        if ckpt.refs > 0:
            return
        if ckpt.refs < 0:
            raise RuntimeError(f"checkpoint {ckpt.id} released more often than held")
        self.pages.free(ckpt.pages)
        ckpt.pages = []
        if ckpt.host_pages:
            self.host_pages.free(ckpt.host_pages)
            ckpt.host_pages = []
        if ckpt.device_slot is not None:
            self._device_free.append(ckpt.device_slot)
            ckpt.device_slot = None
        if ckpt.image is not None:
            self.host_images -= 1
            ckpt.image = None

    def _shared_pages(self, ckpt: Checkpoint | None) -> int:
        """Full pages a request resuming from `ckpt` shares instead of allocating."""
        if ckpt is None or ckpt.host_pages:
            return 0
        return ckpt.frontier // self.page_size

    # -- admission --------------------------------------------------------------------------------
    def select(self, prompt: list[int], session_id: str | None = None
               ) -> tuple[Checkpoint | None, Continuation | None, str | None]:
        """The deepest retained checkpoint whose tokens prefix the prompt (and leave one to run).

        A Responses replay checkpoint is keyed by its session: only requests of that session use it."""
        best: tuple[Checkpoint | None, Continuation | None, str | None] = (None, None, None)
        for owner, e in self._all_entries():
            if e.kind == "response_replay" and (owner is None or owner.session_id != session_id):
                continue
            c = e.ckpt
            deeper = best[0] is None or c.frontier > best[0].frontier or (
                c.frontier == best[0].frontier and owner is None)  # a tie goes to the shared entry
            if deeper and c.matches(prompt):
                best = (c, owner, e.kind)
        return best

    def candidates(self, prompt: list[int], session_id: str | None = None, limit: int = MAX_RESUME_OPTIONS
                   ) -> list[tuple[Checkpoint, Continuation | None, str]]:
        """Every distinct retained checkpoint the prompt could resume from, deepest first (the first
        is `select`'s choice), at most `limit` of them."""
        found: dict[int, tuple[Checkpoint, Continuation | None, str]] = {}
        for owner, e in self._all_entries():
            if e.kind == "response_replay" and (owner is None or owner.session_id != session_id):
                continue
            c = e.ckpt
            have = found.get(c.id)
            if have is not None and not (owner is None and have[1] is not None):
                continue
            if have is not None or c.matches(prompt):
                found[c.id] = (c, owner, e.kind)
        order = sorted(found.values(), key=lambda t: (-t[0].frontier, t[1] is not None))
        return order[:limit]

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

    def _plan_captures(self, seq: Sequence, plan: ReusePlan) -> dict[int, str]:
        hints: CheckpointHints = seq.hints or CheckpointHints()
        f, n = plan.frontier, seq.prompt_len
        out: dict[int, str] = {}
        if _opted_out(seq):
            return out

        def want(pos, kind):
            if pos is not None and f < pos < n and pos not in out:
                out[pos] = kind

        want(hints.turn_closure, "turn_closure")
        want(getattr(hints, "rolling_closure", None), "turn_closure")
        if _session(seq) is not None:
            want(getattr(hints, "replay", None), "response_replay")
        sp = hints.stable_prefix
        if sp is not None and 0 < sp < n and self.caps.max_shared_prefixes > 0:
            key = tuple(seq.prompt_ids[:sp])
            seen = self._sightings.get(key, 0) + 1
            self._sightings[key] = seen
            if len(self._sightings) > 4 * self.caps.max_shared_prefixes + 16:
                self._sightings.pop(next(iter(self._sightings)))
            published = any(e.ckpt.tokens == key for e in self.shared)
            if seen >= 2 and not published:
                want(sp, "shared")
        anchors = 0
        for pos in sorted(set(hints.markers), reverse=True):
            if anchors < self.caps.max_long_anchors:
                want(pos, "long_anchor")
                anchors += 1
        if self.caps.auto_long_anchors:
            grid = n
            k = 0
            for pos in sorted(set(hints.boundaries), reverse=True):
                if anchors >= self.caps.max_long_anchors:
                    break
                if pos <= f:
                    break
                if self.caps.long_anchor_spacing == 0 or grid - pos >= self.caps.long_anchor_spacing * 2**k:
                    want(pos, "long_anchor")
                    anchors += 1
                    grid, k = pos, k + 1
        if self.caps.branch_anchors and anchors < self.caps.max_long_anchors:
            depth = self._deepest_match(seq.prompt_ids)
            if depth - f >= BRANCH_ANCHOR_MIN_GAP:
                want(depth, "long_anchor")
        return out

    def _deepest_match(self, prompt: list[int]) -> int:
        """How far the prompt agrees token for token with any retained session."""
        best = 0
        for c in self.continuations:
            if c is None:
                continue
            m = min(len(c.session), len(prompt) - 1)
            i = 0
            while i < m and c.session[i] == prompt[i]:
                i += 1
            best = max(best, i)
        return best

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

    # -- capture ------------------------------------------------------------------------------------
    def splits_ahead(self, seq: Sequence) -> list[int]:
        """The planned capture frontiers above the lane's position, in order."""
        plan = getattr(seq, "cache_plan", None)
        if plan is None:
            return []
        return sorted(p for p in plan.captures if p > seq.num_cached)

    def after_chunk(self, seq: Sequence, now: float) -> None:
        """Capture at a planned frontier the prefill chunk just reached."""
        plan = getattr(seq, "cache_plan", None)
        if plan is None:
            return
        kind = plan.captures.pop(seq.num_cached, None)
        if kind is None:
            return
        ckpt = self._capture(seq, seq.prompt_ids[: seq.num_cached], now)
        if ckpt is None:
            return
        if kind == "shared":
            self._publish_shared(ckpt)
            kind = "long_anchor"  # the conversation may also resume from it privately
        plan.captured.append(Entry(kind, ckpt))

    # -- capture inside a prefill chunk (no split forward) -------------------------------------
    def reserve_capture_slot(self, seq: Sequence, frontier: int, now: float) -> int | None:
        """A Device state slot for the planned capture at `frontier`, taken before the prefill
        chunk that crosses it, so the forward can leave the state of that position there
        (`ModelRunner.prefill_with_snapshot`) instead of being split in two. None when no Device
        slot can be had (the chunk is then split at the frontier and captured as before). The slot
        goes to `capture_reserved`, or back with `release_capture_slot` if the forward fails."""
        plan = getattr(seq, "cache_plan", None)
        if plan is None or frontier not in plan.captures:
            return None
        return self._device_slot(now, self._capture_value(seq.prompt_ids[:frontier]))

    def release_capture_slot(self, slot: int) -> None:
        self._device_free.append(slot)

    def capture_reserved(self, seq: Sequence, frontier: int, slot: int, now: float) -> None:
        """Register the capture at `frontier` whose state the forward left in `slot`."""
        plan = seq.cache_plan
        kind = plan.captures.pop(frontier, None)
        if kind is None:  # not planned (any more): nothing holds the slot
            self.release_capture_slot(slot)
            return
        ckpt = self._capture(seq, seq.prompt_ids[:frontier], now, slot=slot)
        if kind == "shared":
            self._publish_shared(ckpt)
            kind = "long_anchor"
        plan.captured.append(Entry(kind, ckpt))
        self.counters["captures_in_chunk"] += 1

    def _capture_value(self, tokens) -> float:
        """What a capture of `tokens` is worth when room must be made for its StateImage: the
        tokens above the deepest retained prefix of it (inf when no room has to be made)."""
        if not self._device_free and self.host_images >= self.caps.host_state_slots:
            base = self.select(list(tokens) + [-1])[0]  # only when room must be made: O(catalog)
            return float(len(tokens) - (base.frontier if base is not None else 0))
        return float("inf")

    def _capture(self, seq: Sequence, tokens: list[int], now: float, slot: int | None = None) -> Checkpoint | None:
        """A checkpoint of the lane's current state and pages (held once, by the caller); with
        `slot`, of the state a forward already left in that reserved Device slot.

        When its StateImage needs room, what the room costs the retained checkpoints is weighed
        against what the capture saves (the tokens above the deepest retained prefix of it); a
        capture worth less is skipped (`captures_skipped`)."""
        ckpt = Checkpoint(tuple(tokens), [], last_used=now)
        value = self._capture_value(tokens) if slot is None else 0.0
        if slot is not None:
            ckpt.device_slot = slot
        elif not self._take_state(ckpt, seq.slot, now, value):
            self.counters["captures_skipped"] += 1
            return None
        ckpt.pages = self.pages.share(seq.pages[: pages_for(ckpt.frontier, self.page_size)])
        ckpt.refs = 1
        self.counters["checkpoints_captured"] += 1
        return ckpt

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

    def _publish_shared(self, ckpt: Checkpoint) -> None:
        if self.caps.max_shared_prefixes <= 0:
            return
        while len(self.shared) >= self.caps.max_shared_prefixes:
            victim = min(self.shared, key=lambda e: e.ckpt.last_used)
            self.shared.remove(victim)
            self.counters["pressure"]["shared_owner_evicted"] += 1
            self._drop(victim.ckpt)
        self.shared.append(Entry("shared", self._hold(ckpt)))

    # -- finish -------------------------------------------------------------------------------------
    def on_finish(self, seq: Sequence, completed: bool, now: float) -> Continuation | None:
        """Publish a finished request as a private continuation (endpoint + what it captured and
        inherited), then let go of everything it held. Cancelled or failed requests publish
        nothing. Returns the continuation, if one was retained."""
        plan: ReusePlan | None = getattr(seq, "cache_plan", None)
        if plan is None:
            return None
        result = None
        try:
            if completed and plan.materialized and self.caps.max_private_continuations > 0 \
                    and not _opted_out(seq):
                result = self._publish(seq, plan, now)
        finally:
            self.release(seq)
        return result

    def on_cancel(self, seq: Sequence, now: float) -> Continuation | None:
        """Salvage a cancelled (or disconnected) request: its live state is published as a
        continuation endpoint at its last committed frontier, so a retry resumes there instead of
        prefilling again; a prefill cancelled before computing anything past its reuse frontier
        publishes nothing. Then every hold is released, as for any ended request."""
        plan: ReusePlan | None = getattr(seq, "cache_plan", None)
        if plan is None:
            return None
        result = None
        salvage = self.counters["salvage"]
        prefill = getattr(getattr(seq, "status", None), "name", "") == "PREFILL"
        try:
            if prefill and plan.materialized:
                salvage["cancelled_prefills"] += 1
            if plan.materialized and self.caps.max_private_continuations > 0 and not _opted_out(seq) \
                    and seq.num_cached > plan.frontier:
                result = self._publish(seq, plan, now)
                if result is not None:
                    salvage["published"] += 1
                    if prefill:
                        salvage["cancelled_prefills_salvaged"] += 1
                    log.info("context cache: cancelled request %s kept at %d tokens (slot %d)",
                             seq.request_id, seq.num_cached, result.slot)
        finally:
            self.release(seq)
        return result

    def _publish(self, seq: Sequence, plan: ReusePlan, now: float) -> Continuation | None:
        executed = seq.prompt_ids + seq.output_ids[:-1] if seq.output_ids else seq.prompt_ids
        executed = executed[: seq.num_cached]
        entries: list[Entry] = []
        end = self._capture(seq, executed, now) if executed and len(executed) == seq.num_cached else None
        if end is not None:
            entries.append(Entry("endpoint", end))
        for e in plan.captured:
            entries.append(Entry(e.kind, self._hold(e.ckpt)))
        for e in plan.inherited:
            if all(x.ckpt is not e.ckpt for x in entries):
                entries.append(Entry(e.kind, self._hold(e.ckpt)))
        if not entries:
            return None
        # Inventory per continuation: endpoint + turn closure + long anchors (deepest kept). The
        # endpoint, this request's turn closure (under preserve_thinking false the one a closed tool
        # loop resumes from) and the session's latest replay checkpoint are kept first; a replay
        # checkpoint takes a long anchor's place, so the Host state inventory stays as sized.
        keep = _protected(seq, entries)
        limit = 2 + self.caps.max_long_anchors
        entries.sort(key=lambda e: (e not in keep, -e.ckpt.frontier))
        for e in entries[limit:]:
            self._drop(e.ckpt)
            self.counters["pressure"]["checkpoint_dropped"] += 1
        entries = entries[:limit]
        # Extending a conversation at its endpoint replaces it; a branch keeps it beside.
        old = plan.owner
        # A store:false Responses child reads the chain's checkpoints but never replaces its endpoint.
        replace = old is not None and plan.kind == "endpoint" and old in self.continuations \
            and getattr(seq.request, "session_store", True)
        if replace:
            idx = old.slot
            self._release_continuation(old)
        else:
            idx = self._free_cell()
        # A prefill cancelled mid-prompt (salvage) retains only what it executed.
        session = tuple(seq.prompt_ids + seq.output_ids) if seq.output_ids else tuple(executed)
        cont = Continuation(idx, session, entries, last_used=now, session_id=_session(seq))
        if replace:  # continuing the conversation keeps its slot-file binding (--auto-save-evicted)
            cont.filename, cont.file_depth = old.filename, old.file_depth
        self.continuations[idx] = cont
        return cont

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

    def _release_continuation(self, cont: Continuation) -> None:
        self.continuations[cont.slot] = None
        self._release_entries(cont)

    def _release_entries(self, cont: Continuation) -> None:
        for e in cont.entries:
            self._drop(e.ckpt)
        cont.entries = []

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

    # -- pressure -----------------------------------------------------------------------------------
    def free_pages(self, need: int, keep: Checkpoint | None = None) -> bool:
        """Free `need` more Device pages by demoting or evicting inactive checkpoints, the plan that
        costs the retained work least (cache_planner); False when no plan frees enough."""
        target = self.pages.num_free + need
        if need > 0:
            self._relieve(need_pages=need, keep=keep)
            if self._spilling:  # a synchronous caller (slot restore) needs the pages now
                self.drain_spills(DISK_WRITE_DEADLINE_S)
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

    def _is_prefix(self, p: Checkpoint, c: Checkpoint) -> bool:
        """True when p's tokens are a prefix of c's (memoised: checkpoints never change tokens)."""
        if p.frontier > c.frontier:
            return False
        key = (p.id, c.id)
        hit = self._prefix_memo.get(key)
        if hit is None:
            if len(self._prefix_memo) > 200_000:
                self._prefix_memo.clear()
            hit = self._prefix_memo[key] = c.tokens[: p.frontier] == p.tokens
        return hit

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

    def clear(self) -> None:
        """Release every retained owner (nothing active may hold a checkpoint then)."""
        if self._spilling:
            self.drain_spills(DISK_WRITE_DEADLINE_S)
        for c in list(self.continuations):
            if c is not None:
                self._release_continuation(c)
        for e in self.shared:
            self._drop(e.ckpt)
        self.shared = []
        self._sightings.clear()

    def audit(self, lanes: list[Sequence] = ()) -> None:
        """Check the pools against the holders: every page's reference count equals the checkpoints
        and lanes holding it, and every Device slot and Host image belongs to a live checkpoint.
        Raises AssertionError naming the first difference (tests and invariant checks)."""
        ckpts: dict[int, Checkpoint] = {}
        refs: dict[int, int] = {}
        for _, e in self._all_entries():
            ckpts[id(e.ckpt)] = e.ckpt
            refs[id(e.ckpt)] = refs.get(id(e.ckpt), 0) + 1
        for cont, _ in self._spilling:  # evicted, still being written to the disk tier
            for e in cont.entries:
                ckpts[id(e.ckpt)] = e.ckpt
                refs[id(e.ckpt)] = refs.get(id(e.ckpt), 0) + 1
        for seq in lanes:
            plan = getattr(seq, "cache_plan", None)
            if plan is None:
                continue
            for e in plan.captured + plan.inherited + ([Entry("", plan.ckpt)] if plan.ckpt else []):
                ckpts[id(e.ckpt)] = e.ckpt
                refs[id(e.ckpt)] = refs.get(id(e.ckpt), 0) + 1
        for key, c in ckpts.items():
            assert c.refs == refs[key], f"checkpoint {c.id}: refs {c.refs}, holders {refs[key]}"
        holders: dict[int, int] = {}
        host_holders: dict[int, int] = {}
        for c in ckpts.values():
            n = pages_for(c.frontier, self.page_size)
            if c.host_pages:
                assert not c.pages, f"checkpoint {c.id} holds pages and Host KV"
                assert len(c.host_pages) == n, f"checkpoint {c.id} Host pages"
                for p in c.host_pages:
                    host_holders[p] = host_holders.get(p, 0) + 1
            else:
                assert len(c.pages) == n, f"checkpoint {c.id} pages"
        assert self.host_pages.num_used == len(host_holders), "Host KV pages in use differ from holders"
        for p, n in host_holders.items():
            assert self.host_pages.refcount(p) == n, f"Host page {p}: refcount {self.host_pages.refcount(p)}, holders {n}"
        assert self.host_kv_used <= self.caps.host_kv_bytes
        for c in ckpts.values():
            for p in c.pages:
                holders[p] = holders.get(p, 0) + 1
        for seq in lanes:
            for p in seq.pages:
                holders[p] = holders.get(p, 0) + 1
        used = {p for p in range(self.pages.num_pages) if self.pages.refcount(p)}
        assert used == set(holders), f"pages in use {sorted(used ^ set(holders))} differ from holders"
        for p, n in holders.items():
            assert self.pages.refcount(p) == n, f"page {p}: refcount {self.pages.refcount(p)}, holders {n}"
        dev = [c.device_slot for c in ckpts.values() if c.device_slot is not None]
        assert len(dev) == len(set(dev)) == self.device_slots_used, f"device slots {dev}"
        assert sum(c.image is not None for c in ckpts.values()) == self.host_images, "host images"
        assert all((c.device_slot is None) != (c.image is None) for c in ckpts.values()), "state tier"

    # -- reports ------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        return {
            "device_state_slots": self.device_slots_total,
            "device_state_slots_used": self.device_slots_used,
            "host_state_slots": self.caps.host_state_slots,
            "host_state_slots_used": self.host_images,
            "host_kv_bytes": self.caps.host_kv_bytes,
            "host_kv_bytes_used": self.host_kv_used,
            "host_kv_pages": self.host_pages.capacity,
            "host_kv_pages_used": self.host_pages.num_used,
            "state_image_bytes": self.state_bytes,
            "private_continuations": sum(c is not None for c in self.continuations),
            "max_private_continuations": self.caps.max_private_continuations,
            "shared_prefixes": len(self.shared),
            "checkpoints": len({id(e.ckpt) for _, e in self._all_entries()}),
            "reused_prompt_tokens": self.counters["reused_prompt_tokens"],
            "computed_prefill_tokens": self.counters["computed_prefill_tokens"],
            "checkpoints_captured": self.counters["checkpoints_captured"],
            "captures_in_chunk": self.counters["captures_in_chunk"],
            "selections": dict(self.counters["selections"]),
            "pressure": dict(self.counters["pressure"]),
            "transfer_bytes": dict(self.counters["transfer_bytes"]),
            "searches": dict(self.counters["searches"]),
            "captures_skipped": self.counters["captures_skipped"],
            "degraded_admissions": self.counters["degraded_admissions"],
            "degraded_tokens": self.counters["degraded_tokens"],
            "disk_writes_staged": len(self._spilling),
            "salvage": dict(self.counters["salvage"]),
            "disk": self.disk.snapshot() if self.disk is not None else None,
            "auto_save": self.spiller.snapshot() if self.spiller is not None else None,
        }

    def slots_report(self, n_ctx: int, active: list[Sequence]) -> list[dict]:
        """GET /slots: one row per private continuation cell."""
        rows = []
        for i, c in enumerate(self.continuations):
            row: dict[str, Any] = {"id": i, "is_processing": False, "retained": c is not None,
                                   "n_ctx": n_ctx, "speculative": False}
            if c is not None:
                row.update(session_digest=c.digest, n_prompt_tokens=len(c.session),
                           n_prompt_tokens_cache=len(c.session),
                           checkpoints=[{"frontier": e.ckpt.frontier, "kind": e.kind,
                                         "session_digest": e.ckpt.digest}
                                        for e in sorted(c.entries, key=lambda e: e.ckpt.frontier)])
                for s in active:
                    plan = getattr(s, "cache_plan", None)
                    if plan is not None and plan.owner is c:
                        row.update(is_processing=True, n_prompt_tokens=s.prompt_len,
                                   n_prompt_tokens_cache=plan.frontier)
            else:
                row.update(n_prompt_tokens=0, n_prompt_tokens_cache=0, checkpoints=[])
            rows.append(row)
        return rows


def build_context_cache(runner, pages: PagePool, options, state_bytes: int, page_size: int
                        ) -> ContextCache | None:
    """The default prefix cache for an engine, or None (root-only) with --no-prefix-reuse or a
    runner that cannot copy state and pages."""
    if not getattr(options, "prefix_reuse", True):
        return None
    if not runner.supports_context_cache:
        log.info("context cache off: the model runner cannot capture state")
        return None
    caps = CacheCapacities.resolve(options, state_bytes)
    spec = runner.cache_spec()
    cache = ContextCache(runner, pages, options.max_concurrency, caps, state_bytes, page_size,
                         spec.kv_bytes_per_token)
    disk_path = getattr(options, "disk_kv_path", None)
    if disk_path:
        from ninfer_core.engine.cache_disk import DiskTier

        info = runner.info
        compat = {"architecture": info.architecture, "vocab": info.vocab_size, "hidden": info.hidden_size,
                  "n_params": info.n_params, "kv_dtype": getattr(options, "kv_dtype", "bf16"),
                  "page_size": page_size, "kv_bytes_per_token": spec.kv_bytes_per_token,
                  "state_bytes": spec.state_bytes, "model": getattr(options, "disk_kv_model", "")}
        cache.disk = DiskTier(disk_path, int(getattr(options, "disk_kv_gib", 64) * 2**30), compat,
                              bool(getattr(options, "disk_kv_restore", False)))
    slot_dir = getattr(options, "slot_save_path", None)
    if slot_dir and getattr(options, "auto_save_evicted", False):
        from ninfer_core.engine.cache_spill import SlotSpiller

        os.makedirs(slot_dir, exist_ok=True)
        cache.spiller = SlotSpiller(slot_dir)
    return cache


def _opted_out(seq) -> bool:
    """llama.cpp's cache_prompt: false keeps a request out of the context cache."""
    return not getattr(getattr(seq, "request", None), "cache_prompt", True)


def _session(seq) -> str | None:
    return getattr(getattr(seq, "request", None), "session_id", None)


def _protected(seq, entries: list[Entry]) -> list[Entry]:
    """Entries a published continuation keeps before any anchor: the endpoint, the checkpoint at the
    request's turn closure, and the deepest replay checkpoint (older replays of the session go)."""
    hints = getattr(seq, "hints", None)
    closure = getattr(hints, "turn_closure", None)
    keep = [e for e in entries if e.kind == "endpoint"
            or (e.kind == "turn_closure" and e.ckpt.frontier == closure)]
    replays = [e for e in entries if e.kind == "response_replay"]
    if replays:
        deepest = max(replays, key=lambda e: e.ckpt.frontier)
        keep.append(deepest)
        for e in replays:
            if e is not deepest:
                e.kind = "long_anchor"
    return keep


def _monotonic() -> float:
    import time

    return time.monotonic()


def derive_hints(tokenizer, prompt: list[int], preserve_thinking: bool | None = None) -> CheckpointHints:
    """Hints for a request that brought none: message starts at the turn opener of the tokenizer's
    chat format (`ChatFormat.turn_opener`), when it states one and the tokenizer has it.

    preserve_thinking (spec "Execution behavior") selects the turn closure: true, the current
    response's opener, since every past reasoning block is rendered again as it ran; false or
    unknown (the template default), the first assistant opener after the last user query, because
    closing a tool loop re-renders its assistant turns without their reasoning. In an open tool loop
    the current opener is kept as well (`rolling_closure`) for the loop's next step."""
    from ninfer_core.tokenizer.chat_format import chat_format_of, token_id

    fmt = chat_format_of(tokenizer)
    opener = token_id(tokenizer, fmt.turn_opener)
    if opener is None:
        return CheckpointHints()
    system = tokenizer.encode(fmt.system_role, allow_special=False) if hasattr(tokenizer, "encode") else []
    system_first = bool(system) and prompt[:1] == [opener] and prompt[1: 1 + len(system)] == system
    hints = hints_from_chat_tokens(prompt, opener, system_first)
    if not preserve_thinking and hints.turn_closure is not None:
        first = _open_turn_opener(tokenizer, fmt, prompt, opener)
        if first is not None and first < hints.turn_closure:
            hints.rolling_closure, hints.turn_closure = hints.turn_closure, first
    return hints


ROLE_WINDOW = 24  # tokens after the turn opener: enough to read a role and a tool result's opening


def _open_turn_opener(tokenizer, fmt, prompt: list[int], opener: int) -> int | None:
    """The position of the first assistant opener after the last user query (a user turn that is
    not a tool result), or None when the roles cannot be read."""
    decode = getattr(tokenizer, "decode", None)
    if not callable(decode):
        return None
    last_query = None
    openers: list[int] = []
    user = fmt.user_role
    for i, t in enumerate(prompt):
        if t != opener:
            continue
        try:
            head = decode(prompt[i + 1: i + 1 + ROLE_WINDOW], skip_special=False)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot decode gives no hint
            return None
        if head.startswith(fmt.assistant_role):
            openers.append(i)
        elif head.startswith(user) and not (
                fmt.tool_result_open and head[len(user):].lstrip("\n").startswith(fmt.tool_result_open)):
            last_query = i
    if last_query is None:
        return None
    return next((i for i in openers if i > last_query), None)


@hookimpl
def ninfer_register_prefix_caches(register):
    register("checkpoint_catalog", "ninfer_core.engine.cache:build_context_cache")
    register("none", None)
