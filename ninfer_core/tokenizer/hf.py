"""Build the artifact tokenizer section from a Hugging Face tokenizer directory.

Section keys (docs/dev/CONTRACTS.md): type, ranks, pattern, added_tokens, eos_tokens, pad_token,
bos_token, plus "normalizer" ("NFC" or null; absent means none), for tokenizers that NFC-normalise
text before splitting. A family plugin may build its section another way (from a tokenizer
package) and store that.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from ninfer_core.tokenizer.bpe import DEFAULT_PATTERN, TokenizerError

# GPT-2's split pattern: what a ByteLevel pre-tokenizer with use_regex=true applies.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""



def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    # The mapping is a fixed public convention; written out here because tokenizers does not
    # expose it as a function.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _ranks_text(ranks: dict[bytes, int]) -> str:
    return "".join(
        f"{base64.b64encode(tok).decode('ascii')} {rank}\n"
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    )


def _token_text(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


def _split_pattern(pre: dict | None) -> str:
    """The regex the pre-tokenizer splits with; the default pattern when none is given."""
    if not pre:
        return DEFAULT_PATTERN
    kind = pre.get("type")
    if kind == "Sequence":
        for sub in pre.get("pretokenizers", []):
            if sub.get("type") == "Split" or (sub.get("type") == "ByteLevel" and sub.get("use_regex", True)):
                return _split_pattern(sub)
        return DEFAULT_PATTERN
    if kind == "Split":
        # tiktoken keeps only regex matches, as an "Isolated" split does when the pattern covers all
        # text (the GPT-2 and default patterns do: they end in \s+ and cover letters, digits and the rest).
        if pre.get("behavior", "Isolated") != "Isolated" or pre.get("invert", False):
            raise TokenizerError(f"unsupported Split pre-tokenizer behavior {pre.get('behavior')!r}")
        pat = pre.get("pattern", {})
        if "Regex" in pat:
            return pat["Regex"]
        raise TokenizerError(f"unsupported Split pre-tokenizer pattern {pat!r} (only Regex)")
    if kind == "ByteLevel":
        return GPT2_PATTERN if pre.get("use_regex", True) else DEFAULT_PATTERN
    raise TokenizerError(f"unsupported pre-tokenizer {kind!r}")


def _normalizer(norm: dict | None) -> str | None:
    if not norm:
        return None
    kind = norm.get("type")
    if kind == "NFC":
        return "NFC"
    if kind == "Sequence" and not norm.get("normalizers"):
        return None
    raise TokenizerError(f"unsupported normalizer {kind!r} (only NFC)")


def _check_merge_order(vocab: dict[str, int], merges: list) -> None:
    """tiktoken merges the pair whose *result* has the lowest rank (= id); Hugging Face BPE merges
    the pair listed first in "merges". The two agree when each merge's result token has a higher id
    than both its parts and merge results first appear in increasing id order; byte-level BPE
    vocabularies built by training (GPT-2 and most since) satisfy this: ids are assigned in merge order.
    """
    last = -1
    seen: set[int] = set()
    for i, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        try:
            a, b, ab = vocab[left], vocab[right], vocab[left + right]
        except KeyError as exc:
            raise TokenizerError(
                f"merge {i} ({left!r}, {right!r}) names a token not in the vocab: {exc}"
            ) from None
        if ab in seen:
            continue
        seen.add(ab)
        if ab <= a or ab <= b or ab < last:
            raise TokenizerError(
                f"merge {i} ({left!r} + {right!r} -> id {ab}) is out of id order; "
                "ranks by id would tokenize differently from the merge list"
            )
        last = ab


def tokenizer_section_from_hf_dir(path) -> dict:
    """Read tokenizer.json (+ tokenizer_config.json, generation_config.json) of a byte-level BPE model.

    Ranks are the vocab ids (see _check_merge_order for why that reproduces the merge list). Added
    tokens keep their "special" flag; their lstrip/rstrip/normalized options are not supported.
    """
    path = Path(path)
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise TokenizerError(f"{tok_file} not found")
    text = tok_file.read_text(encoding="utf-8")
    data = json.loads(text)
    model = data.get("model") or {}
    if model.get("type", "BPE") == "BPE" and model.get("byte_fallback"):  # SentencePiece-style
        from ninfer_core.tokenizer.hf_json import section_from_tokenizer_json

        return _with_specials(section_from_tokenizer_json(data, text), path)
    if model.get("type", "BPE") != "BPE":
        raise TokenizerError(f"unsupported tokenizer model {model.get('type')!r} (only byte-level BPE)")
    vocab: dict[str, int] = model.get("vocab") or {}
    added_tokens = [
        {"id": int(t["id"]), "content": t["content"], "special": bool(t.get("special", False))}
        for t in data.get("added_tokens") or []
    ]
    added_ids = {t["id"] for t in added_tokens}
    added_contents = {t["content"] for t in added_tokens}

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    ranks: dict[bytes, int] = {}
    for token, tid in vocab.items():
        if tid in added_ids or token in added_contents:
            continue
        try:
            raw = bytes(byte_of[c] for c in token)
        except KeyError:
            raise TokenizerError(f"vocab token {token!r} is not byte-level encoded") from None
        ranks[raw] = int(tid)
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"byte-level vocab lacks single-byte tokens for {len(missing)} bytes")
    _check_merge_order(vocab, model.get("merges") or [])

    return _with_specials({
        "type": "bpe",
        "ranks": _ranks_text(ranks),
        "pattern": _split_pattern(data.get("pre_tokenizer")),
        "normalizer": _normalizer(data.get("normalizer")),
        "added_tokens": sorted(added_tokens, key=lambda t: t["id"]),
    }, path)


def _with_specials(section: dict, path: Path) -> dict:
    """Add eos_tokens, pad_token and bos_token from tokenizer_config.json and generation_config.json."""
    config: dict = {}
    cfg_file = path / "tokenizer_config.json"
    if cfg_file.is_file():
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    by_id = {t["id"]: t["content"] for t in section["added_tokens"]}
    eos_tokens: list[str] = []
    eos = _token_text(config.get("eos_token"))
    if eos:
        eos_tokens.append(eos)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        gen_eos = json.loads(gen_file.read_text(encoding="utf-8")).get("eos_token_id")
        for tid in gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []:
            text = by_id.get(int(tid))
            if text and text not in eos_tokens:
                eos_tokens.append(text)

    return {**section, "eos_tokens": eos_tokens, "pad_token": _token_text(config.get("pad_token")),
            "bos_token": _token_text(config.get("bos_token"))}
