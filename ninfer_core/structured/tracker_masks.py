"""Mask restriction for the Tracker (tracker.py): which tokens a grammar-filled row must lose."""

from __future__ import annotations

import numpy as np

from ninfer_core.structured.tracker_frames import _CONTINUATION, _Container, _Str
from ninfer_core.structured.vocab import StaticTables, pack


class MaskRestriction:
    """Mixed into Tracker: needs its `stack`, `plan`, `vocab`, `copy()` and `feed()`."""

    def restrict(self, row: np.ndarray) -> None:
        """Clear the refused tokens in a grammar-filled bitmask row (int32 words, in place)."""
        words = row.view(np.uint32)
        tables: StaticTables = self.vocab.tables
        n = words.shape[0]
        top = self.stack[-1] if self.stack else None
        if isinstance(top, _Str):
            if top.esc or top.high is not None:
                self._mid_escape(words, top)
                return
            words &= ~tables.bad_in_words[:n]
            if top.domain is not None:
                self._simulate(words, None)  # a finite domain: the grammar admits its prefixes only
                return
            if not self.plan.watches:
                return
            c = top.count
            if top.hi is not None or top.lo is not None:
                refused = np.zeros(tables.n_lead.shape[0], dtype=bool)
                if top.hi is not None:
                    refused |= tables.plain & (tables.n_lead > top.hi - c)
                    refused |= tables.simple_close & (tables.n_pre > top.hi - c)
                if top.lo is not None:
                    refused |= tables.simple_close & (tables.n_pre < top.lo - c)
                words &= ~pack(refused)[:n]
            self._refuse_values(words, top, tables)
            self._simulate(words, tables.hard_ids)
            return
        words &= ~tables.bad_out_words[:n]
        if (
            isinstance(top, _Container)
            and top.kind == "arr"
            and top.state == "next"
            and top.domain is not None
            and not (top.domain - top.seen)
        ):
            words &= ~tables.first_comma_words[:n]  # a finite unique domain is exhausted: no next item
        if self.plan.watches:
            self._simulate(words, tables.complex_ids if self._next_string_watched() else tables.hard_ids)

    def _refuse_values(self, words: np.ndarray, top: _Str, tables: StaticTables) -> None:
        """Closing tokens whose decoded value would repeat an item or alias a declared property."""
        parent = self.stack[-2] if len(self.stack) > 1 else None
        if not isinstance(parent, _Container):
            return
        cur = bytes(top.decoded)
        if top.key:
            taken = parent.declared if (parent.declared is not None and top.escaped) else ()
        else:
            taken = parent.seen or ()
        ids = [tables.close_by_pre.get(v[len(cur) :]) for v in taken if v.startswith(cur)]
        ids = [x for x in ids if x is not None]
        if ids:
            r = np.concatenate(ids)
            np.bitwise_and.at(words, r >> 5, ~np.left_shift(np.uint32(1), (r & 31).astype(np.uint32)))

    def _next_string_watched(self) -> bool:
        """Whether a string a token opens here could carry a length bound or a uniqueness rule."""
        top = self.stack[-1] if self.stack else None
        if isinstance(top, tuple):
            if top[0] == "value":
                res = self.plan.resolve(top[1])
                parent = self.stack[-2] if len(self.stack) > 1 else None
                return (res is not None and ("minLength" in res or "maxLength" in res)) or (
                    isinstance(parent, _Container) and parent.seen is not None
                )
            top = self.stack[-2] if len(self.stack) > 1 else None
        if not isinstance(top, _Container):
            return False
        if top.kind == "arr":
            item = self.plan.resolve(self.plan.child(top.node, index=top.index))
            return top.seen is not None or (item is not None and ("minLength" in item or "maxLength" in item))
        if top.state in ("colon", "value"):
            child = self.plan.resolve(self.plan.child(top.node, key=top.key))
            return child is not None and ("minLength" in child or "maxLength" in child)
        return False

    def _mid_escape(self, words: np.ndarray, top: _Str) -> None:
        """Inside an escape (or after a high surrogate): the first bytes of a token finish it, the rest
        is ordinary string content. The finishing prefixes are few, so each is run once; the rest of
        a token is only counted, unless it holds a quote or a backslash (then it is run whole)."""
        ids = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab.size])
        need = (1 if top.esc == 1 else 4 - len(top.hexd)) if top.esc else 0
        after: dict = {}  # finishing prefix -> the tracker after it (None: refused)
        refused = []
        for t in ids.tolist():
            b = self.vocab.token_bytes[t]
            k = need + (4 if top.esc == 1 and b[:1] == b"u" else 0)
            head, rest = b[:k], b[k:]
            if head not in after:
                probe = self.copy()
                after[head] = probe if probe.feed(head) else None
            state = after[head]
            if state is None:
                refused.append(t)
                continue
            if not rest:
                continue
            s2 = state.stack[-1] if state.stack else None
            simple = (
                isinstance(s2, _Str)
                and s2.esc == 0
                and s2.high is None
                and s2.domain is None
                and b'"' not in rest
                and b"\\" not in rest
            )
            if simple:
                if s2.hi is not None and s2.count + len(rest.translate(None, _CONTINUATION)) > s2.hi:
                    refused.append(t)
            elif not state.copy().feed(rest):
                refused.append(t)
        if refused:
            r = np.asarray(refused, dtype=np.int64)
            np.bitwise_and.at(words, r >> 5, ~np.left_shift(np.uint32(1), (r & 31).astype(np.uint32)))

    def _simulate(self, words: np.ndarray, candidates: np.ndarray | None) -> None:
        if candidates is None:
            ids = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab.size])
        else:
            ids = candidates[(words[candidates >> 5] >> (candidates & 31).astype(np.uint32)) & 1 != 0]
        refused = [int(t) for t in ids if not self.copy().feed(self.vocab.token_bytes[int(t)])]
        if refused:
            r = np.asarray(refused, dtype=np.int64)
            np.bitwise_and.at(words, r >> 5, ~np.left_shift(np.uint32(1), (r & 31).astype(np.uint32)))
