"""The checkpoint catalog's data: who holds which checkpoint, and the pools they hold.

Owns the state every other part of the catalog reads and changes: the private continuation cells
(`continuations`), the shared stable prefixes (`shared`), the free Device state slots, the Host
image count and Host KV pages, and the counters; reference counting of checkpoints (`_hold`,
`_drop`), lookup of the deepest checkpoint a prompt can resume from (`select`, `candidates`),
the pool audit and the reports (`snapshot`, `slots_report`). No model calls happen here.

The other parts are mixins over this class, each in its own module: admission and pressure
(`cache_admission`), capture planning and publishing (`cache_capture`), and the moves between
tiers, the only part that calls the model runner (`cache_tiers`). `cache.ContextCache` joins them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ninfer_core.engine import cache_tiers as tiers
from ninfer_core.engine.cache_host import HostPagePool
from ninfer_core.engine.checkpoints import SOURCES, Checkpoint, Continuation, Entry
from ninfer_core.engine.pages import PagePool, pages_for

if TYPE_CHECKING:
    from ninfer_core.engine.cache_options import CacheCapacities
    from ninfer_core.engine.request import Sequence

MAX_RESUME_OPTIONS = 4  # resume points admission weighs under pressure: the deepest few and root


class CheckpointCatalog:
    """The catalog's entries and pools over one engine's page pool and the runner's extra state slots."""

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

    def _release_continuation(self, cont: Continuation) -> None:
        self.continuations[cont.slot] = None
        self._release_entries(cont)

    def _release_entries(self, cont: Continuation) -> None:
        for e in cont.entries:
            self._drop(e.ckpt)
        cont.entries = []

    def clear(self) -> None:
        """Release every retained owner (nothing active may hold a checkpoint then)."""
        if self._spilling:
            self.drain_spills(tiers.DISK_WRITE_DEADLINE_S)
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


def _opted_out(seq) -> bool:
    """llama.cpp's cache_prompt: false keeps a request out of the context cache."""
    return not getattr(getattr(seq, "request", None), "cache_prompt", True)


def _session(seq) -> str | None:
    return getattr(getattr(seq, "request", None), "session_id", None)


def _monotonic() -> float:
    import time

    return time.monotonic()
