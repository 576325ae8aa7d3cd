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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ninfer_core import hookimpl
from ninfer_core.engine.checkpoints import (
    KIND_SOURCE,
    SOURCES,
    Checkpoint,
    CheckpointHints,
    Continuation,
    Entry,
    HostKV,
    hints_from_chat_tokens,
)
from ninfer_core.engine.pages import PagePool, pages_for

if TYPE_CHECKING:
    from ninfer_core.engine.request import Sequence

log = logging.getLogger("ninfer.engine.cache")

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
        self._clock = _monotonic
        self.pages = pages
        self.caps = caps
        self.state_bytes = state_bytes
        self.page_size = page_size
        self._device_free = list(range(lanes + caps.device_state_slots - 1, lanes - 1, -1))
        self.device_slots_total = caps.device_state_slots
        self.host_images = 0
        self.host_kv_used = 0  # bytes of demoted KV pages in Host memory
        self.continuations: list[Continuation | None] = [None] * caps.max_private_continuations
        self.shared: list[Entry] = []
        self._sightings: dict[tuple[int, ...], int] = {}  # stable prefix -> times seen
        self.counters: dict[str, Any] = {
            "reused_prompt_tokens": 0, "computed_prefill_tokens": 0, "checkpoints_captured": 0,
            "selections": dict.fromkeys(SOURCES, 0),
            "pressure": dict.fromkeys(("private_owner_evicted", "shared_owner_evicted",
                                       "private_owner_degraded", "checkpoint_dropped"), 0),
            "transfer_bytes": {"state_d2h": 0, "state_h2d": 0, "main_kv_d2h": 0, "main_kv_h2d": 0},
        }

    # -- pools ------------------------------------------------------------------------------------
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
        if ckpt.host_kv is not None:
            self._unref_host_kv(ckpt)
        if ckpt.device_slot is not None:
            self._device_free.append(ckpt.device_slot)
            ckpt.device_slot = None
        if ckpt.image is not None:
            self.host_images -= 1
            ckpt.image = None

    def _unref_host_kv(self, ckpt: Checkpoint) -> None:
        hk, ckpt.host_kv = ckpt.host_kv, None
        hk.refs -= 1
        if hk.refs == 0:
            self.host_kv_used -= hk.nbytes

    def _shared_pages(self, ckpt: Checkpoint | None) -> int:
        """Full pages a request resuming from `ckpt` shares instead of allocating."""
        if ckpt is None or ckpt.host_kv is not None:
            return 0
        return ckpt.frontier // self.page_size

    def _demote_one(self, keep: Checkpoint | None) -> bool:
        """Move the KV pages of the least recently used inactive continuation to Host memory
        (one Host copy of its deepest checkpoint's pages serves all of its checkpoints); False when
        none can move or the Host KV capacity cannot take it."""
        conts = [c for c in self.continuations if c is not None and not c.busy
                 and all(e.ckpt is not keep and e.ckpt.pins == 0 for e in c.entries)
                 and any(e.ckpt.pages for e in c.entries)]
        for cont in sorted(conts, key=lambda c: c.last_used):
            movable = [e.ckpt for e in cont.entries if e.ckpt.pages]
            deepest = max(movable, key=lambda c: c.frontier)
            if any(tuple(c.tokens) != deepest.tokens[: c.frontier] for c in movable):
                continue
            nbytes = len(deepest.pages) * self.page_size * self.kv_bytes_per_token
            if self.host_kv_used + nbytes > self.caps.host_kv_bytes:
                continue
            hk = HostKV(self.runner.read_pages(deepest.pages), nbytes)
            self.host_kv_used += nbytes
            self.counters["transfer_bytes"]["main_kv_d2h"] += nbytes
            for c in movable:
                self.pages.free(c.pages)
                c.pages = []
                c.host_kv = hk
                hk.refs += 1
            self.counters["pressure"]["private_owner_degraded"] += 1
            return True
        return False

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

    def make_room(self, seq: Sequence) -> bool:
        """Plan the head request's reuse and free pages (evicting inactive owners) until its
        entitlement fits; False when it must wait."""
        if _opted_out(seq):  # cache_prompt false: prefilled from root, nothing shared
            ckpt = None
        else:
            ckpt = self.select(seq.prompt_ids, _session(seq))[0]
        if ckpt is None and self.disk is not None and self.disk.restore and not _opted_out(seq):
            self._restore_from_disk(seq, self._clock())
            ckpt = self.select(seq.prompt_ids, _session(seq))[0]
        while not self.pages.can_allocate(seq.entitlement_pages - self._shared_pages(ckpt)):
            if self._demote_one(keep=ckpt):
                continue
            if not self._evict_one(keep=ckpt):
                return False
        return True

    def admit(self, seq: Sequence, now: float) -> None:
        """Give an admitted request its pages (shared prefix + fresh) and its reuse plan."""
        ckpt, owner, kind = (None, None, None) if _opted_out(seq) else self.select(seq.prompt_ids, _session(seq))
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
        fresh = self.pages.allocate(seq.entitlement_pages - n_shared)
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
            if ckpt.host_kv is not None:
                # Host KV: the request gets its own copy of every page of the prefix.
                n = pages_for(ckpt.frontier, self.page_size)
                self.runner.write_pages(seq.pages[:n], {k: v[:n] for k, v in ckpt.host_kv.tensors.items()})
                self.counters["transfer_bytes"]["main_kv_h2d"] += n * self.page_size * self.kv_bytes_per_token
            else:
                tail = ckpt.frontier // self.page_size
                if ckpt.frontier % self.page_size:
                    self.runner.copy_page(ckpt.pages[tail], seq.pages[tail])
            ckpt.pins -= 1
        plan.materialized = True

    # -- capture ------------------------------------------------------------------------------------
    def next_split(self, seq: Sequence) -> int | None:
        """The next planned capture frontier above the lane's position, if any."""
        plan = getattr(seq, "cache_plan", None)
        if plan is None:
            return None
        ahead = [p for p in plan.captures if p > seq.num_cached]
        return min(ahead) if ahead else None

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

    def _capture(self, seq: Sequence, tokens: list[int], now: float) -> Checkpoint | None:
        """A checkpoint of the lane's current state and pages (held once, by the caller)."""
        slot = self._device_slot(now)
        ckpt = Checkpoint(tuple(tokens), [], last_used=now)
        if slot is not None:
            self.runner.copy_slot(seq.slot, slot)
            ckpt.device_slot = slot
        elif self._host_room(now):
            ckpt.image = self.runner.capture_state(seq.slot)
            self.host_images += 1
            self.counters["transfer_bytes"]["state_d2h"] += ckpt.image.nbytes
        else:
            return None
        ckpt.pages = self.pages.share(seq.pages[: pages_for(ckpt.frontier, self.page_size)])
        ckpt.refs = 1
        self.counters["checkpoints_captured"] += 1
        return ckpt

    def _device_slot(self, now: float) -> int | None:
        """A free Device state slot, demoting the least recently used inactive image to Host."""
        if self._device_free:
            return self._device_free.pop()
        victims = sorted({id(e.ckpt): e.ckpt for _, e in self._all_entries()
                          if e.ckpt.device_slot is not None}.values(), key=lambda c: c.last_used)
        for c in victims:
            if self._host_room(now, keep=c):
                c.image = self.runner.capture_state(c.device_slot)
                self.host_images += 1
                self.counters["transfer_bytes"]["state_d2h"] += c.image.nbytes
                self.counters["pressure"]["private_owner_degraded"] += 1
                slot, c.device_slot = c.device_slot, None
                return slot
        return None

    def _host_room(self, now: float, keep: Checkpoint | None = None) -> bool:
        while self.host_images >= self.caps.host_state_slots:
            if not self._evict_one(keep=keep, host_only=True):
                return False
        return True

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
        # loop resumes from) and the session's latest replay checkpoint are kept first.
        keep = _protected(seq, entries)
        limit = 2 + self.caps.max_long_anchors + (1 if any(e.kind == "response_replay" for e in keep) else 0)
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
        session = tuple(seq.prompt_ids + seq.output_ids)
        cont = Continuation(idx, session, entries, last_used=now, session_id=_session(seq))
        self.continuations[idx] = cont
        return cont

    def _free_cell(self) -> int:
        for i, c in enumerate(self.continuations):
            if c is None:
                return i
        victims = [c for c in self.continuations if c is not None and not c.busy] or \
            [c for c in self.continuations if c is not None]
        victim = min(victims, key=lambda c: c.last_used)
        self.counters["pressure"]["private_owner_evicted"] += 1
        self._spill(victim)
        self._release_continuation(victim)
        return victim.slot

    def _spill(self, cont: Continuation) -> None:
        """Write an evicted continuation to the disk tier (if any) before its memory goes."""
        if self.disk is None:
            return
        from ninfer_core.engine.cache_slots import snapshot_continuation

        try:
            image = snapshot_continuation(self, cont, self.disk.compat)
        except Exception:
            log.exception("disk tier: reading an evicted continuation failed")
            return
        self.disk.write(image, cont.last_used)

    def on_shutdown(self) -> None:
        """Write every resident continuation to the disk tier (no forward runs any more)."""
        if self.disk is None:
            return
        for c in list(self.continuations):
            if c is not None:
                self._spill(c)

    def _restore_from_disk(self, seq: Sequence, now: float) -> None:
        """--disk-kv-restore: a request with no resident prefix seeds it from the disk tier."""
        if getattr(seq, "disk_checked", False):
            return
        seq.disk_checked = True
        image = self.disk.lookup(seq.prompt_ids, now)
        if image is None:
            return
        from ninfer_core.engine import cache_slots

        idx = self._free_cell()
        try:
            cache_slots.install(self, idx, image, None, now)
        except Exception as e:  # noqa: BLE001 - a restore that fails recomputes the prompt
            log.warning("disk tier: restoring a %d-token session failed: %s", len(image.session), e)

    def _release_continuation(self, cont: Continuation) -> None:
        self.continuations[cont.slot] = None
        for e in cont.entries:
            self._drop(e.ckpt)
        cont.entries = []

    def release(self, seq: Sequence) -> None:
        """Drop every hold a request took at admission (cancel, failure or after publishing)."""
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
    def _evict_one(self, keep: Checkpoint | None = None, host_only: bool = False) -> bool:
        """Evict the least recently used inactive owner (a continuation, else a shared prefix) that
        does not hold `keep`; True when something was released."""
        def holds(entries):
            return keep is not None and any(e.ckpt is keep for e in entries)

        def host(entries):
            return not host_only or any(e.ckpt.image is not None for e in entries)

        conts = [c for c in self.continuations
                 if c is not None and not c.busy and not holds(c.entries) and host(c.entries)]
        if conts:
            victim = min(conts, key=lambda c: c.last_used)
            self.counters["pressure"]["private_owner_evicted"] += 1
            self._spill(victim)
            self._release_continuation(victim)
            return True
        shared = [e for e in self.shared if e.ckpt is not keep and host([e])]
        if shared:
            victim = min(shared, key=lambda e: e.ckpt.last_used)
            self.shared.remove(victim)
            self.counters["pressure"]["shared_owner_evicted"] += 1
            self._drop(victim.ckpt)
            return True
        return False

    def clear(self) -> None:
        """Release every retained owner (nothing active may hold a checkpoint then)."""
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
        host_kv = {}
        for c in ckpts.values():
            if c.host_kv is not None:
                assert not c.pages, f"checkpoint {c.id} holds pages and Host KV"
                assert next(iter(c.host_kv.tensors.values())).shape[0] >= pages_for(c.frontier, self.page_size)
                host_kv.setdefault(id(c.host_kv), [c.host_kv, 0])[1] += 1
            else:
                assert len(c.pages) == pages_for(c.frontier, self.page_size), f"checkpoint {c.id} pages"
        assert all(hk.refs == n for hk, n in host_kv.values()), "Host KV references"
        assert sum(hk.nbytes for hk, _ in host_kv.values()) == self.host_kv_used, "Host KV bytes"
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
            "state_image_bytes": self.state_bytes,
            "private_continuations": sum(c is not None for c in self.continuations),
            "max_private_continuations": self.caps.max_private_continuations,
            "shared_prefixes": len(self.shared),
            "checkpoints": len({id(e.ckpt) for _, e in self._all_entries()}),
            "reused_prompt_tokens": self.counters["reused_prompt_tokens"],
            "computed_prefill_tokens": self.counters["computed_prefill_tokens"],
            "checkpoints_captured": self.counters["checkpoints_captured"],
            "selections": dict(self.counters["selections"]),
            "pressure": dict(self.counters["pressure"]),
            "transfer_bytes": dict(self.counters["transfer_bytes"]),
            "disk": self.disk.snapshot() if self.disk is not None else None,
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
    if not getattr(runner, "supports_context_cache", False):
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
    """Hints for a request that brought none: ChatML message starts, when the tokenizer has them.

    preserve_thinking (spec "Execution behavior") selects the turn closure: true, the current
    response's opener, since every past reasoning block is rendered again as it ran; false or
    unknown (the template default), the first assistant opener after the last user query, because
    closing a tool loop re-renders its assistant turns without their reasoning. In an open tool loop
    the current opener is kept as well (`rolling_closure`) for the loop's next step."""
    to_id = getattr(tokenizer, "token_to_id", None)
    im_start = to_id("<|im_start|>") if callable(to_id) else None
    if im_start is None:
        return CheckpointHints()
    system = tokenizer.encode("system", allow_special=False) if hasattr(tokenizer, "encode") else []
    system_first = bool(system) and prompt[:1] == [im_start] and prompt[1: 1 + len(system)] == system
    hints = hints_from_chat_tokens(prompt, im_start, system_first)
    if not preserve_thinking and hints.turn_closure is not None:
        first = _open_turn_opener(tokenizer, prompt, im_start)
        if first is not None and first < hints.turn_closure:
            hints.rolling_closure, hints.turn_closure = hints.turn_closure, first
    return hints


ROLE_WINDOW = 24  # tokens after <|im_start|> enough to read "user\n<tool_response>" byte by byte


def _open_turn_opener(tokenizer, prompt: list[int], im_start: int) -> int | None:
    """The position of the first assistant opener after the last user query (a user turn that is
    not a tool result), or None when the roles cannot be read."""
    decode = getattr(tokenizer, "decode", None)
    if not callable(decode):
        return None
    last_query = None
    openers: list[int] = []
    for i, t in enumerate(prompt):
        if t != im_start:
            continue
        try:
            head = decode(prompt[i + 1: i + 1 + ROLE_WINDOW], skip_special=False)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot decode gives no hint
            return None
        if head.startswith("assistant"):
            openers.append(i)
        elif head.startswith("user") and not head[4:].lstrip("\n").startswith("<tool_response>"):
            last_query = i
    if last_query is None:
        return None
    return next((i for i in openers if i > last_query), None)


@hookimpl
def ninfer_register_prefix_caches(register):
    register("checkpoint_catalog", "ninfer_core.engine.cache:build_context_cache")
    register("none", None)
