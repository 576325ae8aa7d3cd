"""Incremental detokenisation and stop strings for one request's output.

Text is published only as complete UTF-8; special tokens produce none. Stop strings apply to all
output text: the text before the first match is published and the rest dropped; a tail that
could still become a stop string is held back until it cannot (or until finish).
"""

from __future__ import annotations

import codecs
from typing import Iterable, Protocol


class TokenBytes(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...

    def is_special(self, token_id: int) -> bool: ...


class StopMatcher:
    """Finds the first of several stop strings in a text stream, holding back possible prefixes."""

    def __init__(self, stops: Iterable[str]):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Return the text that is safe to publish; after a match, `matched` is set and the
        returned text ends right before it (everything later is dropped)."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        first = None
        for stop in self.stops:
            i = buf.find(stop)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, stop)
        if first is not None:
            self._held = ""
            self.matched = first[1]
            return buf[: first[0]]
        keep = self._longest_partial(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held if self.matched is None else ""

    def _longest_partial(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best


class OutputText:
    """Token ids in, publishable text out, for one request."""

    def __init__(self, tokenizer: TokenBytes, stops: Iterable[str] = ()):
        self._tok = tokenizer
        # the codec holds an incomplete UTF-8 tail between tokens and replaces invalid bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = StopMatcher(stops)
        self.decoded_chars = 0  # text decoded so far, before stop strings (offsets for logprob records)
        self.published_chars = 0  # text returned by feed/finish

    @property
    def stopped(self) -> bool:
        return self._stop.matched is not None

    @property
    def matched_stop(self) -> str | None:
        return self._stop.matched

    def feed(self, token_id: int) -> str:
        """Text this token makes publishable (possibly ""); check `stopped` afterwards."""
        if self._tok.is_special(token_id):
            return ""
        decoded = self._utf8.decode(self._tok.token_bytes(token_id))
        self.decoded_chars += len(decoded)
        text = self._stop.feed(decoded)
        self.published_chars += len(text)
        return text

    def finish(self) -> str:
        """Flush at the end of output: an incomplete UTF-8 tail becomes U+FFFD, held text is released."""
        text = self._stop.feed(self._utf8.decode(b"", final=True))
        text += self._stop.flush()
        self.published_chars += len(text)
        return text
