"""Capture planning and publishing for the checkpoint catalog.

Owns where a request's checkpoints are taken (`_plan_captures`: turn closures, replay points,
shared stable prefixes on their second sighting, client markers, automatic and branch anchors),
the captures themselves at the end of a prefill chunk (`after_chunk`) or inside one
(`reserve_capture_slot` / `capture_reserved`), whether a capture is worth the room it needs
(`_capture_value`), and what a finished or cancelled request leaves behind (`on_finish`,
`on_cancel`, `_publish`: a private continuation; `_publish_shared`: a shared prefix). The state
copies are cache_tiers' (`_take_state`, `_device_slot`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ninfer_core.engine.cache_catalog import _opted_out, _session
from ninfer_core.engine.checkpoints import Checkpoint, CheckpointHints, Continuation, Entry
from ninfer_core.engine.pages import pages_for

if TYPE_CHECKING:
    from ninfer_core.engine.cache_admission import ReusePlan
    from ninfer_core.engine.request import Sequence

log = logging.getLogger("ninfer.engine.cache")

ENDPOINT_ANCHOR_MIN_GAP = 1024  # spec: an endpoint anchor fires >= 1024 tokens above deeper anchors
BRANCH_ANCHOR_MIN_GAP = 1024


class Capture:
    """Mixin of the catalog (cache_catalog.CheckpointCatalog): captures, and what ended requests
    publish."""

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

    def _publish_shared(self, ckpt: Checkpoint) -> None:
        if self.caps.max_shared_prefixes <= 0:
            return
        while len(self.shared) >= self.caps.max_shared_prefixes:
            victim = min(self.shared, key=lambda e: e.ckpt.last_used)
            self.shared.remove(victim)
            self.counters["pressure"]["shared_owner_evicted"] += 1
            self._drop(victim.ckpt)
        self.shared.append(Entry("shared", self._hold(ckpt)))

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
