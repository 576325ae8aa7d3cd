"""Tokenizers that are not byte-level BPE (SentencePiece-style BPE with byte fallback),
run from their tokenizer.json by the `tokenizers` library.

Section (manifest["tokenizer"]): {"type": "tokenizers", "json": <tokenizer.json text>,
"added_tokens": [{"id", "content", "special"}], "eos_tokens", "pad_token", "bos_token"}.
`special` decides what decoding skips (as in the byte-level section): markup the model writes as
part of its answer (reasoning and tool-call markers) must be special=False to reach the parsers.

Bytes of a token: `<0xAB>` byte-fallback pieces are that byte, other pieces their text with the
SentencePiece space mark U+2581 as a space; decoding concatenates them (the Replace + ByteFallback +
Fuse decoder of such tokenizers; decoders that also strip a leading space are refused).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from ninfer_core.tokenizer.bpe import TokenizerError, section_specials

SPACE_MARK = "\u2581"
_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _decoder_kinds(dec) -> list[str]:
    if not dec:
        return []
    if dec.get("type") == "Sequence":
        return [k for d in dec.get("decoders", []) for k in _decoder_kinds(d)]
    return [dec.get("type")]


def section_from_tokenizer_json(data: dict, text: str) -> dict:
    """The section of a tokenizer.json this module runs (TokenizerError when it cannot)."""
    model = data.get("model") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        raise TokenizerError(f"unsupported tokenizer model {model.get('type')!r} "
                             "(byte-level BPE, or BPE with byte fallback)")
    if "Strip" in _decoder_kinds(data.get("decoder")):
        raise TokenizerError("tokenizers whose decoder strips a leading space (a SentencePiece dummy prefix) "
                             "are not supported")
    added = [{"id": int(t["id"]), "content": t["content"], "special": bool(t.get("special", False))}
             for t in data.get("added_tokens") or []]
    return {"type": "tokenizers", "json": text, "added_tokens": sorted(added, key=lambda t: t["id"])}


class JsonTokenizer:
    """The `ninfer_core.tokenizer.Tokenizer` interface over a `tokenizers.Tokenizer`."""

    def __init__(self, section: dict):
        try:
            from tokenizers import Tokenizer as HfTokenizer
        except ImportError as exc:  # pragma: no cover - a dependency of ninfer-core
            raise TokenizerError("the tokenizers package is needed for this tokenizer") from exc
        text = section.get("json")
        if not isinstance(text, str):
            raise TokenizerError("tokenizer section has no 'json' text")
        try:
            self._tok = HfTokenizer.from_str(text)
            # a second instance encodes control-token text as plain text (allow_special=False);
            # two instances because the switch is state on the tokenizer, shared across threads
            self._plain = HfTokenizer.from_str(text)
            self._plain.encode_special_tokens = True
        except Exception as exc:  # noqa: BLE001 - the Rust binding raises plain Exceptions
            raise TokenizerError(f"cannot load tokenizer.json: {exc}") from None
        added_tokens = section.get("added_tokens") or []
        self._added = {t["content"]: int(t["id"]) for t in added_tokens}
        self._special_ids = frozenset(int(t["id"]) for t in added_tokens if t.get("special", True))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values()) + 1
        self._bytes: list[bytes] = [b""] * self.vocab_size
        added_ids = {i: s for s, i in self._added.items()}
        for piece, tid in vocab.items():
            if tid in added_ids:
                self._bytes[tid] = added_ids[tid].encode("utf-8")
                continue
            m = _BYTE.match(piece)
            self._bytes[tid] = bytes([int(m.group(1), 16)]) if m else piece.replace(SPACE_MARK, " ").encode("utf-8")
        self.eos_token_ids, self.pad_token, self.bos_token = section_specials(section, self.token_to_id)

    @property
    def added_tokens(self) -> dict[str, int]:
        return dict(self._added)

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        tok = self._tok if allow_special else self._plain
        return list(tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = True) -> bytes:
        n = self.vocab_size
        return b"".join(self._bytes[int(i)] for i in ids
                        if 0 <= int(i) < n and not (skip_special and int(i) in self._special_ids))

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id] if 0 <= token_id < self.vocab_size else b""

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_to_id(self, text: str) -> int | None:
        tid = self._added.get(text)
        if tid is not None:
            return tid
        return self._tok.token_to_id(text.replace(" ", SPACE_MARK))


def load_json(text: str) -> dict:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"tokenizer.json is not valid JSON: {e}") from None
