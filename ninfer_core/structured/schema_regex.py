"""JSON Schema `pattern` and the temporal `format`s, as regular expressions xgrammar can compile.

A schema pattern is an ECMA-262 regular expression with search semantics (it may match anywhere in
the string unless anchored). xgrammar matches a regex against the string's spelling between the
quotes, with full-match semantics, and does not understand `(?:`. This module validates the
pattern against the supported subset (spec "Structured output": no backreferences, boundary
assertions, inline flags, lookarounds, unknown alphabetic escapes, stacked or lazy quantifiers,
spaced repetition counts, whitespace class escapes beside a range hyphen, anchors away from the
boundaries) and rewrites it: plain groups, '?' as {0,1}, search semantics made explicit, no atom that could
produce a quote, a backslash or a control character raw (those need a JSON escape, which xgrammar's
regex path cannot spell: measured with xgrammar 0.2.9, a literal `"` in a pattern is emitted raw, so
such patterns are refused instead of producing invalid JSON).

Written by hand because no library translates ECMA patterns into xgrammar's regex dialect.
"""

from __future__ import annotations

from ninfer_core.structured.errors import SchemaError

# Characters a JSON string cannot hold unescaped.
_SPECIAL = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
_META = set("\\.^$*+?()[]{}|/-")
# ECMA-262 WhiteSpace and LineTerminator without the control characters (those need escapes).
_WS = [
    (0x20, 0x20),
    (0xA0, 0xA0),
    (0x1680, 0x1680),
    (0x2000, 0x200A),
    (0x2028, 0x2029),
    (0x202F, 0x202F),
    (0x205F, 0x205F),
    (0x3000, 0x3000),
    (0xFEFF, 0xFEFF),
]
_DIGIT = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
# ECMA '.' is every character but the line terminators; the controls are excluded as above.
_DOT_EXCLUDED = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]
_ANY_RAW = '[^"\\\\\\x00-\\x1f]*'  # the search prefix/suffix: any run of raw-spellable characters
MAX_REPEAT = 10_000

_YEAR = "(000[1-9]|00[1-9][0-9]|0[1-9][0-9][0-9]|[1-9][0-9][0-9][0-9])"
_LEAP = "([0-9][0-9](0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    f"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
    f"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)"
)
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9}){0,1}(Z|[+\\-]([01][0-9]|2[0-3]):[0-5][0-9])"
# Gregorian month lengths and leap years, years 0001-9999, RFC 3339 offsets; no leap second.
FORMAT_PATTERNS = {"date": _DATE, "time": _TIME, "date-time": f"{_DATE}T{_TIME}"}


def _bad(message: str, path: tuple) -> SchemaError:
    return SchemaError("json_schema_keyword_not_supported", f"pattern not supported: {message}", path)


def _lit(cp: int) -> str:
    c = chr(cp)
    return "\\" + c if c in _META else c


def _class_text(ranges: list[tuple[int, int]], negated: bool) -> str:
    parts = []
    for lo, hi in ranges:
        if lo == hi:
            parts.append(_class_char(lo))
        else:
            parts.append(f"{_class_char(lo)}-{_class_char(hi)}")
    return ("[^" if negated else "[") + "".join(parts) + "]"


def _class_char(cp: int) -> str:
    if cp < 0x20:
        return f"\\x{cp:02x}"
    c = chr(cp)
    return "\\" + c if c in "\\]^-[" else c


def _minus(ranges: list[tuple[int, int]], cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for lo, hi in ranges:
        pieces = [(lo, hi)]
        for clo, chi in cut:
            nxt = []
            for a, b in pieces:
                if chi < a or clo > b:
                    nxt.append((a, b))
                    continue
                if a < clo:
                    nxt.append((a, clo - 1))
                if chi < b:
                    nxt.append((chi + 1, b))
            pieces = nxt
        out += pieces
    return out


def _set_atom(ranges: list[tuple[int, int]], negated: bool, path: tuple) -> str:
    """A character set as a class that can never produce a character needing a JSON escape."""
    if negated:
        return _class_text(ranges + _SPECIAL, True)
    kept = _minus(ranges, _SPECIAL)
    if not kept:
        raise _bad(
            "a character class that only matches quotes, backslashes or control characters (they "
            "need JSON escapes, which patterns cannot produce)",
            path,
        )
    return _class_text(kept, False)


class _Parser:
    def __init__(self, pattern: str, path: tuple):
        self.p, self.i, self.path = pattern, 0, path

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.p[j] if j < len(self.p) else ""

    def hex(self, n: int) -> int:
        digits = self.p[self.i : self.i + n]
        if len(digits) != n or any(c not in "0123456789abcdefABCDEF" for c in digits):
            raise _bad(f"a malformed \\{'x' if n == 2 else 'u'} escape", self.path)
        self.i += n
        return int(digits, 16)

    def unicode_escape(self) -> int:
        """After '\\u': the scalar value, a valid surrogate pair spelled as two escapes included."""
        if self.peek() == "{":
            raise _bad("\\u{...} escapes need the u flag", self.path)
        cp = self.hex(4)
        if 0xD800 <= cp <= 0xDBFF:
            if self.p[self.i : self.i + 2] == "\\u":
                save = self.i
                self.i += 2
                low = self.hex(4)
                if 0xDC00 <= low <= 0xDFFF:
                    return 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00)
                self.i = save
            raise _bad("a lone surrogate escape (use a valid surrogate pair)", self.path)
        if 0xDC00 <= cp <= 0xDFFF:
            raise _bad("a lone surrogate escape (use a valid surrogate pair)", self.path)
        return cp

    def escape(self, in_class: bool) -> tuple[str, object]:
        """After a backslash: ("set", ranges, negated) | ("char", cp)."""
        c = self.peek()
        if not c:
            raise _bad("a trailing backslash", self.path)
        self.i += 1
        if c in "dDwWsS":
            base = {"d": _DIGIT, "w": _WORD, "s": _WS}[c.lower()]
            return ("set", (base, c.isupper()))
        if c in "bB":
            if in_class and c == "b":
                raise _bad("[\\b] (a backspace, which needs a JSON escape)", self.path)
            raise _bad("boundary assertions (\\b, \\B)", self.path)
        if c.isdigit():
            if c == "0" and not self.peek().isdigit():
                raise _bad("\\0 (a NUL character, which needs a JSON escape)", self.path)
            raise _bad("backreferences", self.path)
        if c == "k":
            raise _bad("named backreferences", self.path)
        if c in "nrtfv":
            return ("char", {"n": 10, "r": 13, "t": 9, "f": 12, "v": 11}[c])
        if c == "x":
            return ("char", self.hex(2))
        if c == "u":
            return ("char", self.unicode_escape())
        if c in "pP":
            raise _bad("Unicode property escapes (\\p, \\P)", self.path)
        if c.isalpha():
            raise _bad(f"the unknown escape \\{c}", self.path)
        return ("char", ord(c))

    def char_atom(self, cp: int) -> str:
        if cp < 0x20 or cp in (0x22, 0x5C):
            raise _bad(
                "a quote, backslash or control character (it needs a JSON escape, which patterns "
                "cannot produce)",
                self.path,
            )
        if 0xD800 <= cp <= 0xDFFF:
            raise _bad("a lone surrogate", self.path)
        return _lit(cp)

    def char_class(self) -> str:
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c = self.peek()
            if not c:
                raise _bad("an unterminated character class", self.path)
            if c == "]":
                self.i += 1
                break
            lo, lo_set = self.class_item()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                hi, hi_set = self.class_item()
                if lo_set is not None or hi_set is not None:
                    raise _bad("a class escape beside a range hyphen", self.path)
                if hi < lo:
                    raise _bad("a character range out of order", self.path)
                ranges.append((lo, hi))
            elif lo_set is not None:
                ranges += lo_set
                if self.peek() == "-" and self.peek(1) not in ("]", ""):
                    raise _bad("a class escape beside a range hyphen", self.path)
            else:
                ranges.append((lo, lo))
            first = False
        if first:
            if negated:  # ECMA [^] is any character
                return _set_atom([], True, self.path)
            raise _bad("an empty character class, which matches nothing", self.path)
        return _set_atom(ranges, negated, self.path)

    def class_item(self) -> tuple[int, list | None]:
        c = self.peek()
        self.i += 1
        if c == "\\":
            kind, value = self.escape(in_class=True)
            if kind == "set":
                base, neg = value
                if neg:
                    raise _bad("negated class escapes (\\D, \\W, \\S) inside a character class", self.path)
                return -1, list(base)
            return value, None
        cp = ord(c)
        if 0xD800 <= cp <= 0xDFFF:
            raise _bad("a lone surrogate", self.path)
        return cp, None

    def quantifier_braces(self) -> str | None:
        """`{n}`, `{n,}` or `{n,m}` at the cursor, or None when the brace is a literal."""
        j = self.p.find("}", self.i)
        if j < 0:
            return None
        body = self.p[self.i + 1 : j]
        if body.replace(",", "").replace(" ", "").isdigit() and " " in body:
            raise _bad("spaced repetition counts", self.path)
        parts = body.split(",")
        if (
            not body
            or len(parts) > 2
            or not parts[0].isdigit()
            or (len(parts) == 2 and parts[1] and not parts[1].isdigit())
        ):
            return None
        lo = int(parts[0])
        hi = int(parts[1]) if len(parts) == 2 and parts[1] else None
        if (hi is not None and hi < lo) or lo > MAX_REPEAT or (hi or 0) > MAX_REPEAT:
            raise _bad(f"a repetition count out of order or above {MAX_REPEAT}", self.path)
        self.i = j + 1
        return "{" + body + "}"

    def body(self) -> tuple[str, bool]:
        """The rewritten body and whether it has a top-level alternation."""
        out: list[str] = []
        depth = 0
        top_alt = False
        atom = False  # the previous item can take a quantifier
        quantified = False
        while self.i < len(self.p):
            c = self.p[self.i]
            if c in "*+?" or (c == "{" and self._is_quantifier()):
                if quantified:
                    raise _bad("stacked or lazy quantifiers", self.path)
                if not atom:
                    raise _bad("a quantifier with nothing to repeat", self.path)
                if c == "{":
                    out.append(self.quantifier_braces())
                else:
                    self.i += 1
                    # xgrammar 0.2.9 reads a '?' after ')' as a literal question mark
                    out.append("{0,1}" if c == "?" else c)
                quantified = True
                continue
            quantified = False
            self.i += 1
            if c == "\\":
                kind, value = self.escape(in_class=False)
                if kind == "set":
                    base, neg = value
                    out.append(_set_atom(list(base), neg, self.path))
                else:
                    out.append(self.char_atom(value))
                atom = True
            elif c == "[":
                out.append(self.char_class())
                atom = True
            elif c == "(":
                if self.peek() == "?":
                    nxt = self.peek(1)
                    if nxt == ":":
                        self.i += 2
                    elif nxt == "<" and self.peek(2) not in ("=", "!"):
                        end = self.p.find(">", self.i)
                        if end < 0:
                            raise _bad("an unterminated group name", self.path)
                        self.i = end + 1
                    elif nxt in ("=", "!") or nxt == "<":
                        raise _bad("lookaround assertions", self.path)
                    else:
                        raise _bad("inline flags and other (?...) groups", self.path)
                depth += 1
                out.append("(")
                atom = False
            elif c == ")":
                depth -= 1
                if depth < 0:
                    raise _bad("an unbalanced ')'", self.path)
                out.append(")")
                atom = True
            elif c == "|":
                if depth == 0:
                    top_alt = True
                out.append("|")
                atom = False
            elif c in "^$":
                raise _bad("anchors away from the pattern boundaries", self.path)
            elif c == ".":
                out.append(_set_atom(_DOT_EXCLUDED, True, self.path))
                atom = True
            elif c in "{}]":
                out.append("\\" + c)
                atom = True
            else:
                out.append(self.char_atom(ord(c)))
                atom = True
        if depth != 0:
            raise _bad("an unbalanced '('", self.path)
        return "".join(out), top_alt

    def _is_quantifier(self) -> bool:
        save = self.i
        try:
            return self.quantifier_braces() is not None
        finally:
            self.i = save


def rewrite_pattern(pattern: str, path: tuple) -> str:
    """The xgrammar regex (full match over the raw spelling) for a schema pattern (search semantics)."""
    start = pattern.startswith("^")
    end = pattern.endswith("$") and not _escaped_at(pattern, len(pattern) - 1)
    core = pattern[1 if start else 0 : len(pattern) - 1 if end else len(pattern)]
    if start and end and len(pattern) == 1:
        core = ""
    body, top_alt = _Parser(core, path).body()
    if top_alt:
        if start or end:
            raise _bad("an anchored top-level alternation needs an explicit group, e.g. ^(a|b)$", path)
        body = f"({body})"
    return ("" if start else _ANY_RAW) + body + ("" if end else _ANY_RAW)


def _escaped_at(text: str, i: int) -> bool:
    n = 0
    j = i - 1
    while j >= 0 and text[j] == "\\":
        n += 1
        j -= 1
    return n % 2 == 1
