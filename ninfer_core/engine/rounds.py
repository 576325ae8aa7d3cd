"""Decode rounds: one batched forward over every decode-ready lane, plain or speculative.

A plain round is a decode of one token per lane. A speculative round (a backend with `--spec`,
n-gram copy drafting, or both) first gathers drafts for every lane that may draft (n-gram copies
first; the model drafter for the others), verifies all lanes' drafts in one forward (lane i runs
its last token and k_i drafts, k_i + 1 rows, logits of every row), picks each row's token with the
request's sampler (greedy argmax, or the coupled rejection test of `sampler.pick_tokens`), accepts
the longest prefix of drafts equal to the picks, commits those tokens and the pick after them one
by one (a stop, the thinking switch or a budget close truncates the round there), then commits the
runner: the lane's recurrent state ends after exactly the tokens it kept.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ninfer_core.engine.media_side import segment_side
from ninfer_core.engine.model_api import DECODE, LOGITS_ALL, VERIFY, ForwardBatch, LaneSegment
from ninfer_core.engine.ngram import LaneDrafter, NgramArchive, NgramOptions
from ninfer_core.engine.pages import pages_for
from ninfer_core.engine.sampler import pick_tokens, token_logprobs
from ninfer_core.engine.spec import DraftLane, Proposal, RoundReport, SpecStats

if TYPE_CHECKING:
    from ninfer_core.engine.engine import Engine
    from ninfer_core.engine.request import Sequence

log = logging.getLogger("ninfer.engine")


class RoundDriver:
    def __init__(self, engine: "Engine", backend=None, ngram: NgramOptions | None = None):
        self.engine = engine
        self.backend = backend
        self.ngram = ngram or NgramOptions()
        self.archive = (NgramArchive(self.ngram.archive_bytes, self.ngram.session_bytes, self.ngram.min_match)
                        if self.ngram.archive_bytes > 0 and self.ngram.draft_tokens > 0 else None)
        self.groups = engine.cache_spec.group_names
        # hidden layers every target forward returns for the backend (DFlash's context features)
        self.target_layers = tuple(getattr(backend, "target_layers", ()) or ()) if backend is not None else ()
        self.max_drafts = max(self.ngram.draft_tokens, self.ngram.lookup_drafts if self.ngram.lookup else 0,
                              backend.draft_tokens if backend is not None else 0)

    @property
    def speculative(self) -> bool:
        return self.backend is not None or self.ngram.enabled

    def describe(self) -> dict | None:
        """The speculative setup (snapshot, server_start, /props, slot-file compatibility), or None."""
        if not self.speculative:
            return None
        n = self.ngram
        return {"backend": self.backend.describe() if self.backend is not None else None,
                "draft_window": self.max_drafts,
                "ngram": {"draft_tokens": n.draft_tokens, "min_match": n.min_match, "lookup": n.lookup,
                          "archive_bytes": n.archive_bytes if self.archive is not None else 0,
                          "session_bytes": n.session_bytes}}

    def _tables(self, s: "Sequence", end: int) -> dict:
        pages = s.pages[: pages_for(end, self.engine.page_size)]
        return {g: pages for g in self.groups}

    # -- one round ---------------------------------------------------------------------------------
    def run(self, batch: list["Sequence"]) -> None:
        eng = self.engine
        t0 = time.monotonic()
        drafts: list[list[int]] = [[] for _ in batch]
        sources = [""] * len(batch)
        forced = [s.thinking.next_forced() for s in batch]  # an early close commits unsampled
        try:
            if self.speculative:
                self._gather_drafts(batch, forced, drafts, sources)
            verify = any(drafts)
            segs = [LaneSegment(s.slot, self._tables(s, s.num_cached + 1 + len(d)), s.num_cached,
                                [s.last_token, *d], VERIFY if verify else DECODE,
                                LOGITS_ALL if verify else "last", self.target_layers,
                                side=None if s.request.media is None else
                                segment_side(s.request.media, s.num_cached, 1 + len(d), None))
                    for s, d in zip(batch, drafts)]
            outs = eng.runner.forward(ForwardBatch(segs))
            eng._launches += 1
            if eng._flush_after_launch:
                eng._flush()  # the previous round's events, while the device computes this one
            drafted = [len(d) for d in drafts]  # before a grammar cuts them: a cut draft was rejected
            refused = self._masks(batch, outs, drafts)
            plans = [self._accept(s, o.logits, d, f) for s, o, d, f in zip(batch, outs, drafts, forced)]
        except Exception as exc:
            log.exception("decode failed for %d requests", len(batch))
            for s in batch:
                eng._fail(s, exc)
            return
        results = []
        for i, (s, d, (tokens, records, n_acc)) in enumerate(zip(batch, drafts, plans)):
            if i in refused and forced[i] is None:  # its grammar mask failed: only this request fails
                results.append((1, "", ("error", refused[i], None)))
                continue
            results.append(self._take_tokens(s, tokens, records))
        if verify:
            try:
                eng.runner.commit([(s.slot, max(1, kept)) for s, (kept, _, _) in zip(batch, results)])
            except Exception as exc:
                log.exception("commit failed for %d requests", len(batch))
                for s in batch:
                    eng._fail(s, exc)
                return
        committed = 0
        seconds = time.monotonic() - t0
        report = RoundReport(width=1 + max(drafted, default=0), batch=len(batch), seconds=seconds)
        if self.target_layers:
            for s, o, (kept, _, _) in zip(batch, outs, results):
                self.observed(s, s.num_cached, o.hidden, max(1, kept))
        for s, d, src, (tokens, records, n_acc), (kept, text, fin) in zip(batch, drafted, sources, plans, results):
            s.num_cached += kept
            committed += kept
            if self.speculative:
                accepted = min(n_acc, max(0, kept - 1))
                stats: SpecStats = s.spec
                stats.record(src, d, accepted)
                if src == "model":
                    report.lanes.append((s.request_id, d, accepted))
                if s.drafter is not None and fin is None:
                    s.drafter.extend(s.output_ids[len(s.output_ids) - kept:])
            eng._settle(s, text, fin)
        with eng._cv:  # /v1/load counters: rounds, rows and the tokens they committed
            for key, n in (("decode_rounds", 1), ("decode_row_rounds", len(batch)),
                           ("committed_decode_tokens", committed), ("decode_seconds", seconds)):
                eng.counters[key] = eng.counters.get(key, 0) + n
        if verify and self.backend is not None and report.lanes:
            self.backend.observe_round(report)
        if not eng._flush_after_launch:
            eng._flush()

    def observed(self, s: "Sequence", start: int, hidden: dict, rows: int | None = None) -> None:
        """Hand the backend the target layer outputs of a lane's committed positions start.. (the
        first `rows` rows of a forward's segment; all of them by default)."""
        if not self.target_layers or not hidden:
            return
        got = {layer: (h if rows is None else h[:rows]) for layer, h in hidden.items() if layer in self.target_layers}
        try:
            self.backend.observe_target(s.request_id, start, got)
        except Exception:  # a drafter's bookkeeping never fails a request: it only drafts worse
            log.exception("speculative backend %s failed to record the target's hidden states",
                          self.backend.name)

    def _masks(self, batch, outs, drafts) -> dict:
        """Structured output: each constrained lane's verify rows masked by its grammar in place, one
        mask per draft position (computed on a host thread while the forward ran); a lane's drafts
        are cut to its usable rows. {row: EngineError} where a mask failed (that request alone fails)."""
        refused = {}
        for i, (s, o) in enumerate(zip(batch, outs)):
            if getattr(s.request, "constraint", None) is None:
                continue
            rows = o.logits if o.logits.dim() == 2 else o.logits.unsqueeze(0)
            n, err = self.engine._masks.apply_rows(rows, s, drafts[i])
            if err is not None:
                refused[i] = err
            del drafts[i][max(0, n - 1):]
        return refused

    # -- drafts --------------------------------------------------------------------------------------
    def _allowed(self, s: "Sequence") -> int:
        """Drafts the lane may verify now: the round commits drafts + 1 tokens at most, inside the
        request's output limit (and so its page entitlement and the context)."""
        return max(0, min(self.max_drafts, s.max_tokens - len(s.output_ids) - 1))

    def _gather_drafts(self, batch, forced, drafts, sources) -> None:
        lanes, idx = [], []
        for i, s in enumerate(batch):
            # a forced thinking close, or a constrained request whose masks cost more than 4 ms,
            # decodes without drafts
            costly = not self.engine._masks.drafting_allowed(s)
            allowed = 0 if forced[i] is not None or s.thinking.pending or costly else self._allowed(s)
            if allowed <= 0:
                continue
            if self.ngram.enabled:
                if s.drafter is None:
                    s.drafter = LaneDrafter(self.ngram, self.archive, getattr(s.request, "draft_session", None))
                    s.drafter.extend(s.prompt_ids + s.output_ids)
                got, src = s.drafter.propose(allowed)
                if got and s.request.media is not None:  # a copy may run into media identity ids
                    vocab = self.engine.runner.info.vocab_size
                    got = got[: next((k for k, t in enumerate(got) if t >= vocab), len(got))]
                if got:
                    drafts[i], sources[i] = got, src
                    continue
            if self.backend is not None:
                lanes.append(DraftLane(s.request_id, s.slot, self._tables(s, s.num_cached + 1 + allowed),
                                       s.num_cached, s.last_token, min(allowed, self.backend.draft_tokens),
                                       _History(s)))
                idx.append(i)
        if lanes:
            proposals: list[Proposal] = self.backend.propose(lanes)
            width = self.backend.round_width(lanes, proposals)
            for i, lane, p in zip(idx, lanes, proposals):
                got = [int(t) for t in p.tokens[: lane.max_drafts]]
                if width is not None:
                    got = got[:width]
                if got:
                    drafts[i], sources[i] = got, "model"
        for i, s in enumerate(batch):  # a constrained lane verifies only the drafts its grammar admits
            if drafts[i] and getattr(s.request, "constraint", None) is not None:
                del drafts[i][self.engine._masks.admitted(s, drafts[i]):]
                self.engine._masks.prefetch_rows(s, drafts[i])  # their masks, while the forward runs

    # -- acceptance ----------------------------------------------------------------------------------
    def _accept(self, s: "Sequence", logits, drafts: list[int], forced: int | None):
        """(tokens to commit in order, their logprob records, accepted drafts) for one lane."""
        if logits.dim() == 1:
            logits = logits.unsqueeze(0)
        sampler = s.sampler
        if forced is not None:
            return [forced], [None], 0
        n = len(drafts) + 1
        counts = [sampler.counts_with(drafts[:j]) for j in range(n)] if sampler.has_penalties else None
        uniforms = [None] * n if sampler.greedy else sampler.uniforms().peek(n)
        picks = pick_tokens(logits[:n], [sampler] * n, uniforms, counts)
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == picks[accepted]:
            accepted += 1
        tokens = picks[: accepted + 1]
        records = [None] * len(tokens)
        if s.request.logprobs is not None:
            records = token_logprobs(logits[: len(tokens)], [sampler] * len(tokens), tokens,
                                     [s.request.logprobs] * len(tokens),
                                     None if counts is None else counts[: len(tokens)])
        return tokens, records, accepted

    def _take_tokens(self, s: "Sequence", tokens: list[int], records: list):
        """Commit tokens one by one until one ends the request or changes how the next is chosen.
        Returns (tokens kept, text to publish, finish or None)."""
        eng = self.engine
        text, kept, fin = "", 0, None
        for token, record in zip(tokens, records):
            sampler = s.sampler
            piece, fin = eng._take(s, token, record)
            if not sampler.greedy:
                sampler.uniforms().take(1)
            text += piece
            kept += 1
            # a finish, the post-thinking switch or a budget close queued: the rest was chosen for
            # another situation and is dropped (the next round re-decides from here)
            if fin is not None or s.sampler is not sampler or s.thinking.pending:
                break
        return kept, text, fin

    # -- ends --------------------------------------------------------------------------------------
    def published(self, s: "Sequence") -> None:
        """A request completed: its prompt and output become copy sources of its draft session."""
        if self.archive is not None and getattr(s.request, "draft_session", None) and s.output_ids:
            self.archive.publish(s.request.draft_session, s.prompt_ids + s.output_ids)
            s.archive_published = True

    def released(self, s: "Sequence") -> None:
        """A request ended in any way: the backend forgets it."""
        s.drafter = None
        if self.backend is not None:
            self.backend.lane_finished(s.request_id)

    def facts(self, s: "Sequence") -> dict | None:
        """request_done.speculative (spec "Structured request log"), or None without speculation."""
        if not self.speculative:
            return None
        st: SpecStats = s.spec
        out = {"backend": self.backend.name if self.backend is not None else None,
               "draft_window": self.max_drafts, "rounds": st.rounds, "drafted_tokens": st.drafted,
               "accepted_tokens": st.accepted, "fallback_steps": st.fallback_steps,
               "accepted_per_position": list(st.accepted_per_position),
               "model_rounds": st.model_rounds, "model_drafted_tokens": st.model_drafted,
               "model_accepted_tokens": st.model_accepted,
               "ngram_rounds": st.ngram_rounds, "ngram_drafted_tokens": st.ngram_drafted,
               "ngram_accepted_tokens": st.ngram_accepted,
               "ngram_archive_rounds": st.archive_rounds, "ngram_archive_drafted_tokens": st.archive_drafted,
               "ngram_archive_accepted_tokens": st.archive_accepted}
        session = getattr(s.request, "draft_session", None)
        archive = {"enabled": self.archive is not None, "bound": bool(session and self.archive is not None),
                   "published": bool(getattr(s, "archive_published", False)),
                   "sampling_seed": s.sampler.seed if session else None}
        if self.archive is not None:
            archive.update(self.archive.session_facts(session))
        out["ngram_archive"] = archive
        if self.backend is not None:
            out.update(self.backend.request_facts(s.request_id))
        return out


class _History:
    """A lane's prompt + output ids as one read-only sequence, without copying them."""

    def __init__(self, s: "Sequence"):
        self._p, self._o = s.prompt_ids, s.output_ids

    def __len__(self) -> int:
        return len(self._p) + len(self._o)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        return self._p[i] if i < len(self._p) else self._o[i - len(self._p)]
