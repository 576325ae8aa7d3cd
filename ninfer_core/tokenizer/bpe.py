"""Byte-level BPE tokenizer built from an artifact's tokenizer section (tiktoken does the BPE)."""

from __future__ import annotations

import base64
import threading
import unicodedata
from collections import OrderedDict
from typing import Iterable

import tiktoken

# The split pattern of a section that names none (format-2 artifacts predate the "pattern" key and
# were all written with this one).
DEFAULT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_CACHE_SIZE = 2
_cache: OrderedDict[tuple, tiktoken.Encoding] = OrderedDict()
_cache_lock = threading.Lock()


class TokenizerError(ValueError):
    """The tokenizer section is malformed."""


def parse_ranks(text: str) -> dict[bytes, int]:
    """Parse tiktoken rank file text (one 'base64(bytes) rank' line per token)."""
    ranks: dict[bytes, int] = {}
    try:
        for line in text.splitlines():
            if not line:
                continue
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    except ValueError as exc:
        raise TokenizerError(f"malformed BPE ranks line {line[:80]!r}: {exc}") from None
    return ranks


def section_specials(section: dict, token_to_id) -> tuple[tuple[int, ...], str | None, str | None]:
    """(eos ids in section order without repeats, pad token, bos token) of a tokenizer section."""
    eos: list[int] = []
    for text in section.get("eos_tokens") or []:
        tid = token_to_id(text)
        if tid is not None and tid not in eos:
            eos.append(tid)
    return tuple(eos), section.get("pad_token"), section.get("bos_token")


def _build_encoding(ranks_text: str, pattern: str, added: tuple[tuple[str, int], ...]) -> tiktoken.Encoding:
    # Sections from the same artifact (or a packaged one) are loaded repeatedly by tests
    # and by the server; parsing 248k ranks costs ~0.3 s, so the built Encoding is shared.
    key = (ranks_text, pattern, added)
    with _cache_lock:
        enc = _cache.get(key)
        if enc is not None:
            _cache.move_to_end(key)
            return enc
    ranks = parse_ranks(ranks_text)
    try:
        enc = tiktoken.Encoding(
            "ninfer", pat_str=pattern, mergeable_ranks=ranks, special_tokens=dict(added)
        )
    except Exception as exc:  # tiktoken raises plain ValueError/BaseException subclasses from Rust
        raise TokenizerError(f"cannot build BPE encoding: {exc}") from None
    with _cache_lock:
        _cache[key] = enc
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return enc


class Tokenizer:
    """Byte-level BPE tokenizer; added tokens are matched as whole strings before BPE.

    Ids with no token (a model vocabulary padded past the tokenizer's) decode to nothing.
    """

    def __init__(self, section: dict):
        if section.get("type", "bpe") != "bpe":
            raise TokenizerError(f"unsupported tokenizer type {section.get('type')!r}")
        ranks_text = section.get("ranks")
        if not isinstance(ranks_text, str):
            raise TokenizerError("tokenizer section has no 'ranks' text")
        pattern = section.get("pattern") or DEFAULT_PATTERN
        added_tokens = section.get("added_tokens") or []
        added = tuple((t["content"], int(t["id"])) for t in added_tokens)
        self._enc = _build_encoding(ranks_text, pattern, added)
        self._added: dict[str, int] = dict(added)
        self._added_text: dict[int, str] = {i: s for s, i in added}
        self._special_ids = frozenset(int(t["id"]) for t in added_tokens if t.get("special", True))
        self._normalizer = section.get("normalizer")
        if self._normalizer not in (None, "NFC"):
            raise TokenizerError(f"unsupported normalizer {self._normalizer!r}")
        self.vocab_size: int = self._enc.max_token_value + 1
        self.eos_token_ids, self.pad_token, self.bos_token = section_specials(section, self.token_to_id)

    @classmethod
    def from_section(cls, section: dict) -> "Tokenizer":
        if section.get("type") == "tokenizers":  # not byte-level BPE: ninfer_core.tokenizer.hf_json
            from ninfer_core.tokenizer.hf_json import JsonTokenizer

            return JsonTokenizer(section)
        return cls(section)

    @property
    def added_tokens(self) -> dict[str, int]:
        """Added-token text -> id (control tokens and the markup the model writes as text)."""
        return dict(self._added)

    def _normalize(self, text: str) -> str:
        if self._normalizer == "NFC" and not unicodedata.is_normalized("NFC", text):
            return unicodedata.normalize("NFC", text)
        return text

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Encode text; with allow_special, added-token text becomes its id, else it is plain text."""
        text = self._normalize(text)
        if allow_special:
            return self._enc.encode(text, allowed_special="all", disallowed_special=())
        return self._enc.encode_ordinary(text)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Decode ids; special=True added tokens are omitted unless skip_special is false."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = True) -> bytes:
        """The raw bytes of ids (may end inside a UTF-8 sequence)."""
        n = self.vocab_size
        keep = [
            int(i)
            for i in ids
            if 0 <= int(i) < n and not (skip_special and int(i) in self._special_ids)
        ]
        try:
            return self._enc.decode_bytes(keep)
        except KeyError:
            return b"".join(self.token_bytes(i) for i in keep)

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token; an added token gives its UTF-8 text, an unknown id b""."""
        text = self._added_text.get(token_id)
        if text is not None:
            return text.encode("utf-8")
        try:
            return self._enc.decode_single_token_bytes(token_id)
        except (KeyError, ValueError, OverflowError):
            return b""

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_to_id(self, text: str) -> int | None:
        tid = self._added.get(text)
        if tid is not None:
            return tid
        try:
            return self._enc.encode_single_token(text.encode("utf-8"))
        except KeyError:
            return None
