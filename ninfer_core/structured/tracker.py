"""The semantic layer beside the grammar: what xgrammar cannot (or should not) enforce itself.

A `Tracker` follows the generated JSON byte by byte along the normalised schema and refuses
- string lengths outside minLength/maxLength, counted in decoded Unicode scalars whatever the
  escape spelling (in a schema without anyOf these bounds are taken out of the grammar: xgrammar
  0.2.9 counts characters only in strings without escapes, refusing `\\n` or `\\"` in them);
- a repeated item of a uniqueItems array of strings (compared decoded), a finite enum domain
  continued past exhaustion;
- an additional-property key that spells a declared property name with escapes (an alias that
  would overwrite the declared, typed value);
- lone surrogate escapes in any string.
Inside an anyOf the tracker cannot know the branch: it follows the structure without checks
there (schema_check rejects the uniqueItems it could not enforce).

`restrict(row)` clears, in a grammar-filled bitmask row, the tokens the tracker refuses: plain
tokens (no quote, no backslash) through vectorised tables, the others by running a copy of the
tracker over them (few survive the grammar mask at any position).
"""

from __future__ import annotations

import numpy as np

from ninfer_core.structured.vocab import StaticTables, VocabTables, pack

_WS = b" \t\r\n"
_CONTINUATION = bytes(range(0x80, 0xC0))  # UTF-8 continuation bytes (deleted to count scalars)
_LIT = frozenset(b"0123456789+-.eEtrufalsn")
_SHORT = {ord('"'): 0x22, ord("\\"): 0x5C, ord("/"): 0x2F, ord("b"): 8, ord("f"): 12, ord("n"): 10,
          ord("r"): 13, ord("t"): 9}


def _viable_hex(digits: str, pending_high: bool) -> bool:
    """Whether a partial \\u escape can still complete without a lone surrogate."""
    d = digits.lower()
    if any(c not in "0123456789abcdef" for c in d):
        return False
    if d[0] != "d" or len(d) < 2:
        return not pending_high or d[0] == "d"
    if d[1] in "89ab":  # a high surrogate: fine unless one is already waiting for its pair
        return not pending_high
    if d[1] in "cdef":  # a low surrogate needs the high one before it
        return pending_high
    return not pending_high


class Plan:
    """The normalised schema the tracker navigates, with its $ref resolver."""

    def __init__(self, root, strict: bool):
        self.root, self.strict = root, strict
        self.watches = _has_watches(root)

    def resolve(self, node):
        seen = 0
        while isinstance(node, dict) and "$ref" in node and seen < 64:
            ref = node["$ref"]
            target = self.root
            if ref != "#":
                for seg in ref[2:].split("/"):
                    target = target[int(seg)] if isinstance(target, list) else target[seg]
            node = target
            seen += 1
        if not isinstance(node, dict) or "anyOf" in node:
            return None
        return node

    def child(self, node, key=None, index=None):
        node = self.resolve(node)
        if node is None:
            return None
        if key is not None:
            props = node.get("properties") or {}
            if key in props:
                return props[key]
            extra = node.get("additionalProperties", False if self.strict else {})
            return extra if isinstance(extra, dict) else None
        prefix = node.get("prefixItems") or []
        if index < len(prefix):
            return prefix[index]
        items = node.get("items", False if (self.strict and prefix) else {})
        return items if isinstance(items, dict) else None


def _has_watches(node) -> bool:
    """Whether any node needs the tracker beyond the surrogate check (bounds, uniqueness, aliases)."""
    if isinstance(node, list):
        return any(_has_watches(v) for v in node)
    if not isinstance(node, dict):
        return False
    if ("minLength" in node or "maxLength" in node) and "pattern" not in node:
        return True
    if node.get("uniqueItems") or (node.get("properties") and node.get("additionalProperties", True) is not False):
        return True
    for key in ("items", "additionalProperties"):
        if _has_watches(node.get(key)):
            return True
    for key in ("properties", "$defs", "definitions"):
        if isinstance(node.get(key), dict) and any(_has_watches(v) for v in node[key].values()):
            return True
    return _has_watches(node.get("prefixItems")) or _has_watches(node.get("anyOf"))


class _Str:
    __slots__ = ("node", "key", "count", "decoded", "esc", "hexd", "high", "escaped", "lo", "hi", "domain")

    def __init__(self, node, key: bool, lo, hi, domain):
        self.node, self.key = node, key
        self.count, self.decoded = 0, bytearray()
        self.esc, self.hexd, self.high, self.escaped = 0, "", None, False
        self.lo, self.hi, self.domain = lo, hi, domain  # domain: frozenset of bytes values, or None

    def copy(self) -> "_Str":
        c = _Str.__new__(_Str)
        for k in _Str.__slots__:
            setattr(c, k, getattr(self, k))
        c.decoded = bytearray(self.decoded)
        return c


class _Container:
    __slots__ = ("kind", "node", "state", "key", "index", "seen", "domain", "declared", "open")

    def copy(self) -> "_Container":
        c = _Container.__new__(_Container)
        for k in _Container.__slots__:
            setattr(c, k, getattr(self, k))
        if self.seen is not None:
            c.seen = set(self.seen)
        return c


class Tracker:
    """Follows the generated JSON; `feed` returns False when the bytes break a semantic rule."""

    def __init__(self, plan: Plan, vocab: VocabTables):
        self.plan, self.vocab = plan, vocab
        self.stack: list = [("value", plan.root)]
        self.done = False

    def copy(self) -> "Tracker":
        t = Tracker.__new__(Tracker)
        t.plan, t.vocab, t.done = self.plan, self.vocab, self.done
        t.stack = [f.copy() if not isinstance(f, tuple) else f for f in self.stack]
        return t

    # -- feeding ------------------------------------------------------------------------------
    def feed(self, data: bytes) -> bool:
        for b in data:
            if not self._byte(b):
                return False
        top = self.stack[-1] if self.stack else None
        if isinstance(top, _Str) and top.domain is not None and top.esc == 0 and top.high is None:
            d = bytes(top.decoded)
            if not any(v.startswith(d) for v in top.domain):
                return False
        return True

    def _byte(self, b: int) -> bool:
        if not self.stack:
            return b in _WS
        top = self.stack[-1]
        if isinstance(top, _Str):
            return self._str_byte(top, b)
        if isinstance(top, tuple):
            kind = top[0]
            if kind == "lit":
                if b in _LIT:
                    return True
                self.stack.pop()
                self._value_done(None)
                return self._byte(b)
            # ("value", node): a value starts here
            if b in _WS:
                return True
            node = top[1]
            self.stack.pop()
            if b == ord("{"):
                self.stack.append(self._container("obj", node))
            elif b == ord("["):
                self.stack.append(self._container("arr", node))
            elif b == ord('"'):
                self.stack.append(self._string(node, key=False))
            else:
                self.stack.append(("lit",))
            return True
        return self._container_byte(top, b)

    def _container(self, kind: str, node) -> _Container:
        c = _Container()
        c.kind, c.node, c.state, c.key, c.index = kind, node, "start", None, 0
        c.seen, c.domain, c.declared, c.open = None, None, None, False
        res = self.plan.resolve(node)
        if kind == "arr" and res is not None and res.get("uniqueItems"):
            c.seen = set()
            item = self.plan.resolve(res.get("items", {}))
            if item is not None and ("enum" in item or "const" in item):
                values = [item["const"]] if "const" in item else item["enum"]
                c.domain = frozenset(v.encode("utf-8", "surrogatepass") for v in values if isinstance(v, str))
        if kind == "obj" and res is not None and res.get("properties"):
            extra = res.get("additionalProperties", False if self.plan.strict else {})
            if extra is not False:
                c.declared = frozenset(k.encode("utf-8", "surrogatepass") for k in res["properties"])
        return c

    def _string(self, node, key: bool, parent: _Container | None = None) -> _Str:
        res = self.plan.resolve(node) if not key else None
        lo = hi = None
        if res is not None and "pattern" not in res:
            lo, hi = res.get("minLength"), res.get("maxLength")
        domain = None
        if parent is None and len(self.stack) and isinstance(self.stack[-1], _Container):
            arr = self.stack[-1]
            if arr.kind == "arr" and arr.domain is not None:
                domain = arr.domain - arr.seen
        return _Str(node, key, lo, hi, domain)

    def _container_byte(self, c: _Container, b: int) -> bool:
        if b in _WS:
            return True
        if c.kind == "obj":
            if c.state in ("start", "key") and b == ord('"'):
                self.stack.append(self._string(None, key=True))
                return True
            if c.state == "start" and b == ord("}"):
                self.stack.pop()
                self._value_done(None)
                return True
            if c.state == "colon" and b == ord(":"):
                c.state = "value"
                self.stack.append(("value", self.plan.child(c.node, key=c.key)))
                return True
            if c.state == "next":
                if b == ord(","):
                    c.state = "key"
                    return True
                if b == ord("}"):
                    self.stack.pop()
                    self._value_done(None)
                    return True
            return True  # the grammar owns syntax; nothing semantic to refuse
        # array
        if c.state == "start":
            if b == ord("]"):
                self.stack.pop()
                self._value_done(None)
                return True
            c.state = "value"
            self.stack.append(("value", self.plan.child(c.node, index=c.index)))
            return self._byte(b)
        if c.state == "next":
            if b == ord(","):
                if c.domain is not None and not (c.domain - c.seen):
                    return False  # a finite unique domain is exhausted: the array must close
                c.state = "value"
                self.stack.append(("value", self.plan.child(c.node, index=c.index)))
                return True
            if b == ord("]"):
                self.stack.pop()
                self._value_done(None)
                return True
        return True

    def _value_done(self, decoded: bytes | None) -> None:
        if not self.stack:
            self.done = True
            return
        parent = self.stack[-1]
        if isinstance(parent, _Container):
            if parent.kind == "obj":
                parent.state = "next"
            else:
                parent.state = "next"
                parent.index += 1

    def _str_byte(self, s: _Str, b: int) -> bool:
        if s.esc == 1:
            if b == ord("u"):
                s.esc, s.hexd = 2, ""
                return True
            cp = _SHORT.get(b)
            if cp is None or s.high is not None:
                return False
            s.esc = 0
            return self._char(s, cp)
        if s.esc == 2:
            s.hexd += chr(b)
            if len(s.hexd) < 4:
                return _viable_hex(s.hexd, s.high is not None)
            s.esc = 0
            try:
                cp = int(s.hexd, 16)
            except ValueError:
                return False
            if 0xD800 <= cp <= 0xDBFF:
                if s.high is not None:
                    return False
                s.high = cp
                s.count += 1
                return s.hi is None or s.count <= s.hi
            if 0xDC00 <= cp <= 0xDFFF:
                if s.high is None:
                    return False
                full = 0x10000 + ((s.high - 0xD800) << 10) + (cp - 0xDC00)
                s.high = None
                s.decoded += chr(full).encode("utf-8")
                return True
            return self._char(s, cp)
        if b == ord("\\"):
            if s.hi is not None and s.count >= s.hi and s.high is None:
                return False  # every escape spells one more scalar (but the low half of a pair)
            s.esc = 1
            s.escaped = True
            return True
        if s.high is not None:
            return False  # a high surrogate must be followed by its low half
        if b == ord('"'):
            return self._close(s)
        if b & 0xC0 != 0x80:
            s.count += 1
            if s.hi is not None and s.count > s.hi:
                return False
        s.decoded.append(b)
        return True

    def _char(self, s: _Str, cp: int) -> bool:
        s.count += 1
        s.decoded += chr(cp).encode("utf-8", "surrogatepass")
        return s.hi is None or s.count <= s.hi

    def _close(self, s: _Str) -> bool:
        self.stack.pop()
        d = bytes(s.decoded)
        if s.lo is not None and s.count < s.lo:
            return False
        parent = self.stack[-1] if self.stack else None
        if s.key:
            if isinstance(parent, _Container):
                if parent.declared is not None and s.escaped and d in parent.declared:
                    return False  # an escaped alias of a declared property
                parent.key = d.decode("utf-8", "replace")
                parent.state = "colon"
            return True
        if isinstance(parent, _Container) and parent.seen is not None:
            if d in parent.seen:
                return False
            if s.domain is not None and d not in s.domain:
                return False
            parent.seen.add(d)
        self._value_done(d)
        return True

    # -- masks ---------------------------------------------------------------------------------
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
        if isinstance(top, _Container) and top.kind == "arr" and top.state == "next" and top.domain is not None \
                and not (top.domain - top.seen):
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
        ids = [tables.close_by_pre.get(v[len(cur):]) for v in taken if v.startswith(cur)]
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
                    isinstance(parent, _Container) and parent.seen is not None)
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
        after: dict[bytes, Tracker | None] = {}
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
            simple = (isinstance(s2, _Str) and s2.esc == 0 and s2.high is None and s2.domain is None
                      and b'"' not in rest and b"\\" not in rest)
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
