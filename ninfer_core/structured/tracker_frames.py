"""The tracker's state: the schema plan it navigates and its frames (strings and containers)."""

from __future__ import annotations

_WS = b" \t\r\n"
_CONTINUATION = bytes(range(0x80, 0xC0))  # UTF-8 continuation bytes (deleted to count scalars)
_LIT = frozenset(b"0123456789+-.eEtrufalsn")
_SHORT = {
    ord('"'): 0x22,
    ord("\\"): 0x5C,
    ord("/"): 0x2F,
    ord("b"): 8,
    ord("f"): 12,
    ord("n"): 10,
    ord("r"): 13,
    ord("t"): 9,
}


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
    if node.get("uniqueItems") or (
        node.get("properties") and node.get("additionalProperties", True) is not False
    ):
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
