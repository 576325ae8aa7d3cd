"""Per-tokenizer vocabulary facts for the masks: xgrammar's token list and the static token tables
the semantic layer (tracker.py) uses to restrict masks without looking at every token.

Special tokens (the tokenizer's special=True added tokens: turn ends, vision markers, ...) get
empty bytes, which xgrammar treats as special: the grammar never produces them, the stop tokens
end it. Text markers (reasoning and tool-call markers written as answer text) keep their text, so a
grammar can require them.
Ids past the tokenizer (a vocabulary padded to the model's logits width) are empty as well.
"""

from __future__ import annotations

import threading

import numpy as np

QUOTE, BACKSLASH = 0x22, 0x5C


def words(size: int) -> int:
    return (size + 31) // 32


def pack(flags: np.ndarray) -> np.ndarray:
    """A bool vector over the vocabulary -> uint32 bitmask words (bit i of word i // 32)."""
    n = words(flags.shape[0]) * 32
    padded = np.zeros(n, dtype=bool)
    padded[: flags.shape[0]] = flags
    return np.packbits(padded, bitorder="little").view(np.uint32)


def _surrogate_bad(data: bytes, in_string: bool) -> bool:
    """Whether a token spells a lone surrogate or a broken escape on its own (from the given state).

    A high surrogate escape at the token's end is not judged here: its pair may follow."""
    i, n = 0, len(data)
    pending_high = False
    while i < n:
        b = data[i]
        if not in_string:
            if b == QUOTE:
                in_string = True
            i += 1
            continue
        if b == QUOTE:
            if pending_high:
                return True
            in_string = False
            i += 1
        elif b == BACKSLASH:
            if i + 1 >= n:
                return False  # the escape continues in the next token
            e = data[i + 1]
            if e == ord("u"):
                hexd = data[i + 2 : i + 6]
                if len(hexd) < 4:
                    return False
                try:
                    cp = int(hexd, 16)
                except ValueError:
                    return True
                if 0xD800 <= cp <= 0xDBFF:
                    if pending_high:
                        return True
                    pending_high = True
                elif 0xDC00 <= cp <= 0xDFFF:
                    if not pending_high:
                        return True
                    pending_high = False
                elif pending_high:
                    return True
                i += 6
            else:
                if pending_high:
                    return True
                i += 2
        else:
            if pending_high:
                return True
            i += 1
    return False


class VocabTables:
    """Token bytes over the logits width, and the lazily built static tables."""

    def __init__(self, tokenizer, vocab_size: int):
        self.size = int(vocab_size)
        n_tok = int(getattr(tokenizer, "vocab_size", 0) or 0)
        self.token_bytes: list[bytes] = []
        for i in range(self.size):
            if i >= n_tok or tokenizer.is_special(i):
                self.token_bytes.append(b"")
            else:
                self.token_bytes.append(tokenizer.token_bytes(i))
        self.eos_ids = tuple(sorted(set(getattr(tokenizer, "eos_token_ids", ()) or ())))
        # the token a tool call opens with in the model's chat format (the tools grammar's first word)
        from ninfer_core.tokenizer.chat_format import chat_format_of, token_id

        syntax = chat_format_of(tokenizer).tools
        self.tool_open_id = (token_id(tokenizer, syntax.markers[0])
                             if syntax is not None and syntax.markers else None)
        self._lock = threading.Lock()
        self._tables = None

    def close_whitespace_words(self) -> np.ndarray:
        """The tokens that may follow a generated reasoning close: the format newlines ("\\n\\n" or "\\n")."""
        ok = np.zeros(self.size, dtype=bool)
        for i, b in enumerate(self.token_bytes):
            if b in (b"\n\n", b"\n"):
                ok[i] = True
        if not ok.any():  # a tokenizer without them: any whitespace-only token
            for i, b in enumerate(self.token_bytes):
                if b and not b.strip():
                    ok[i] = True
        return pack(ok)

    @property
    def tables(self) -> "StaticTables":
        with self._lock:
            if self._tables is None:
                self._tables = StaticTables(self.token_bytes)
            return self._tables


class StaticTables:
    """What each token does to a JSON string, precomputed once (about 1 s for 248k tokens)."""

    def __init__(self, token_bytes: list[bytes]):
        n = len(token_bytes)
        self.n_lead = np.zeros(n, dtype=np.int32)  # UTF-8 lead bytes: decoded scalars of a plain token
        complex_ = np.zeros(n, dtype=bool)
        quote_or_comma = np.zeros(n, dtype=bool)
        first_comma = np.zeros(n, dtype=bool)  # first non-whitespace byte is a comma
        bad_in = np.zeros(n, dtype=bool)
        bad_out = np.zeros(n, dtype=bool)
        for i, b in enumerate(token_bytes):
            if not b:
                continue
            self.n_lead[i] = sum(1 for x in b if x & 0xC0 != 0x80)
            q, s = QUOTE in b, BACKSLASH in b
            if q or s:
                complex_[i] = True
                if s:
                    bad_in[i] = _surrogate_bad(b, True)
                    bad_out[i] = _surrogate_bad(b, False)
            if q or 0x2C in b:
                quote_or_comma[i] = True
            stripped = b.lstrip(b" \t\r\n")
            if stripped[:1] == b",":
                first_comma[i] = True
        # One quote and no backslash: inside a string it closes it after `pre` and leaves only
        # structure behind (no string opens in its tail): checked against the string's rules by
        # lookups instead of running the tracker over it.
        self.simple_close = np.zeros(n, dtype=bool)
        self.n_pre = np.zeros(n, dtype=np.int32)
        self.close_by_pre: dict[bytes, np.ndarray] = {}
        by_pre: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_bytes):
            if b.count(b'"') == 1 and BACKSLASH not in b:
                pre = b[: b.index(b'"')]
                self.simple_close[i] = True
                self.n_pre[i] = sum(1 for x in pre if x & 0xC0 != 0x80)
                by_pre.setdefault(pre, []).append(i)
        self.close_by_pre = {k: np.asarray(v, dtype=np.int64) for k, v in by_pre.items()}
        self.plain = ~complex_
        self.complex_ids = np.flatnonzero(complex_)
        self.hard_ids = np.flatnonzero(complex_ & ~self.simple_close)  # backslashes or several quotes
        self.quote_or_comma_ids = np.flatnonzero(quote_or_comma)
        self.first_comma_words = pack(first_comma)
        self.bad_in_words = pack(bad_in)
        self.bad_out_words = pack(bad_out)
