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

from ninfer_core.structured.tracker_frames import _LIT, _SHORT, _WS, Plan, _Container, _Str, _viable_hex
from ninfer_core.structured.tracker_masks import MaskRestriction
from ninfer_core.structured.vocab import VocabTables

__all__ = ["Plan", "Tracker"]


class Tracker(MaskRestriction):
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
