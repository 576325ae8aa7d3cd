"""N-gram copy drafting (spec `--ngram-draft-tokens`, `--ngram-min-match`, `--lookup-ngram`,
`--ngram-archive-mib`, `--ngram-session-mib`): proposals copied from earlier text that the lane's
last tokens match, verified by the target like any draft (so exact).

`NgramIndex` keeps, for one token stream, where each m-gram last ended, with a rolling polynomial
hash per position (O(1) per token; a candidate is confirmed by comparing the tokens, so a hash
collision never proposes a wrong match). Written by hand: no maintained library offers an
incremental m-gram index over a growing token list.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

_MOD = (1 << 61) - 1
_BASE = 1_000_003


class NgramIndex:
    """m-gram end positions of one growing token stream (prompt, then output)."""

    def __init__(self, m: int):
        if m < 1:
            raise ValueError(f"n-gram match length must be >= 1, got {m}")
        self.m = m
        self.tokens: list[int] = []
        self._prefix = [0]  # rolling hash of tokens[:i]
        self._pow_m = pow(_BASE, m, _MOD)
        self._last: dict[int, int] = {}  # m-gram hash -> the latest end index (exclusive) seen
        self._prev_of_tail: int | None = None  # the earlier end of the current tail m-gram

    def _key(self, end: int) -> int:
        return (self._prefix[end] - self._prefix[end - self.m] * self._pow_m) % _MOD

    def extend(self, tokens) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            self._prefix.append((self._prefix[-1] * _BASE + int(t) + 1) % _MOD)
            end = len(self.tokens)
            if end >= self.m:
                key = self._key(end)
                prev = self._last.get(key)
                if prev is not None and self.tokens[prev - self.m: prev] != self.tokens[end - self.m: end]:
                    prev = None  # a hash collision: not a match
                self._prev_of_tail = prev
                self._last[key] = end
            else:
                self._prev_of_tail = None

    def propose(self, n: int) -> list[int]:
        """Up to n tokens that followed the latest earlier occurrence of the stream's last m tokens."""
        prev = self._prev_of_tail
        if prev is None or n <= 0:
            return []
        return self.tokens[prev: min(prev + n, len(self.tokens))]

    def find(self, tail: list[int], n: int) -> list[int]:
        """Up to n tokens following the latest occurrence of `tail` (m tokens) in this stream."""
        if len(tail) != self.m or n <= 0 or len(self.tokens) < self.m:
            return []
        h = 0
        for t in tail:
            h = (h * _BASE + int(t) + 1) % _MOD
        end = self._last.get(h)
        if end is None or self.tokens[end - self.m: end] != list(tail):
            return []
        return self.tokens[end: end + n]

    @property
    def nbytes(self) -> int:
        """A rough size for the archive's budget (ints in lists and the dict)."""
        return 8 * len(self.tokens) * 2 + 40 * len(self._last)


@dataclass
class NgramOptions:
    draft_tokens: int = 0  # --ngram-draft-tokens (0: copy drafting off)
    min_match: int = 12  # --ngram-min-match
    lookup: int = 0  # --lookup-ngram (0: off)
    lookup_drafts: int = 8  # drafts a lookup match proposes (the backend's K when there is one)
    archive_bytes: int = 0  # --ngram-archive-mib (0: request-local)
    session_bytes: int = 128 << 20  # --ngram-session-mib

    @property
    def enabled(self) -> bool:
        return self.draft_tokens > 0 or self.lookup > 0


class LaneDrafter:
    """One request's n-gram drafting state: copy index (min_match), lookup index, archive session."""

    def __init__(self, opts: NgramOptions, archive: "NgramArchive | None" = None, session: str | None = None):
        self.opts = opts
        self.copy = NgramIndex(opts.min_match) if opts.draft_tokens > 0 else None
        self.lookup = NgramIndex(opts.lookup) if opts.lookup > 0 else None
        self.archive = archive if (archive is not None and session) else None
        self.session = session

    def extend(self, tokens) -> None:
        for idx in (self.copy, self.lookup):
            if idx is not None:
                idx.extend(tokens)

    def propose(self, max_drafts: int) -> tuple[list[int], str]:
        """(drafts, source): source "ngram" (own text), "archive" (the session's earlier
        requests) or "" when nothing matched."""
        if max_drafts <= 0:
            return [], ""
        if self.copy is not None:
            got = self.copy.propose(min(self.opts.draft_tokens, max_drafts))
            if got:
                return got, "ngram"
            if self.archive is not None and len(self.copy.tokens) >= self.copy.m:
                got = self.archive.find(self.session, self.copy.tokens[-self.copy.m:],
                                        min(self.opts.draft_tokens, max_drafts))
                if got:
                    return got, "archive"
        if self.lookup is not None:
            got = self.lookup.propose(min(self.opts.lookup_drafts, max_drafts))
            if got:
                return got, "ngram"
        return [], ""


@dataclass
class _Session:
    sources: list[NgramIndex] = field(default_factory=list)
    nbytes: int = 0
    generation: int = 0


class NgramArchive:
    """Finished requests' token streams kept as copy sources for later requests of the same draft
    session (X-NInfer-Draft-Session), least recently used sessions and sources dropped first."""

    def __init__(self, total_bytes: int, session_bytes: int, min_match: int):
        self.total_bytes = total_bytes
        self.session_bytes = min(session_bytes, total_bytes)
        self.min_match = min_match
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0

    def publish(self, session: str, tokens: list[int]) -> None:
        if not session or len(tokens) < self.min_match:
            return
        idx = NgramIndex(self.min_match)
        idx.extend(tokens)
        with self._lock:
            s = self._sessions.setdefault(session, _Session())
            self._sessions.move_to_end(session)
            s.sources.append(idx)
            s.nbytes += idx.nbytes
            s.generation += 1
            self.nbytes += idx.nbytes
            while s.nbytes > self.session_bytes and s.sources:
                old = s.sources.pop(0)
                s.nbytes -= old.nbytes
                self.nbytes -= old.nbytes
            while self.nbytes > self.total_bytes and self._sessions:
                name, victim = next(iter(self._sessions.items()))
                if victim.sources:
                    old = victim.sources.pop(0)
                    victim.nbytes -= old.nbytes
                    self.nbytes -= old.nbytes
                if not victim.sources:
                    del self._sessions[name]

    def find(self, session: str, tail: list[int], n: int) -> list[int]:
        with self._lock:
            s = self._sessions.get(session)
            if s is None:
                return []
            self._sessions.move_to_end(session)
            for src in reversed(s.sources):  # the newest source first
                got = src.find(tail, n)
                if got:
                    return got
        return []

    def session_facts(self, session: str | None) -> dict:
        with self._lock:
            s = self._sessions.get(session) if session else None
            return {"sources": len(s.sources) if s else 0, "session_bytes": s.nbytes if s else 0,
                    "generation": s.generation if s else 0, "total_bytes": self.nbytes}
