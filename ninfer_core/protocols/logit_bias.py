"""`logit_bias` in every wire form llama.cpp and OpenAI accept, as {token id: additive bias}.

Forms (llama.cpp's server README, "logit_bias"; OpenAI's Chat Completions reference):
  - OpenAI's map `{"15043": 1.0}`: keys are token ids written as strings;
  - llama.cpp's pairs `[[15043, 1.0], ["Hello", -0.5]]`: a token id, or a string whose every token
    gets the bias (tokenized as text, special-token text included as text);
  - llama.cpp's map `{"Hello": -0.5}`: a key that is not an integer is such a string.
A bias is a number in -100..100 (OpenAI's range) or `false`, llama.cpp's ban (minus infinity).
llama.cpp skips malformed entries and out-of-range ids silently; NInfer refuses them with the
field path, so a typo never runs as an unbiased request. A token named twice gets the sum of its
biases (llama.cpp adds each entry to the logit). Zero biases are dropped.
"""

from __future__ import annotations

import math
from typing import Any

from ninfer_core.server.errors import bad_request

BIAS_LIMIT = 100.0
BAN = float("-inf")


def parse_logit_bias(value: Any, tokenizer: Any, vocab: int, param: str = "logit_bias") -> dict[int, float]:
    """The request's logit_bias as {token id: bias} (empty for none); 400 with the entry's path
    for a malformed entry. Host work: string pieces are tokenized here."""
    if value is None:
        return {}
    entries: list[tuple[Any, Any, str]] = []  # (token or text, bias, param of the entry)
    if isinstance(value, dict):
        for key, bias in value.items():
            entries.append((_map_key(key), bias, f"{param}.{key}"))
    elif isinstance(value, list):
        for i, pair in enumerate(value):
            if not isinstance(pair, list) or len(pair) != 2:
                raise bad_request("invalid_type", "logit_bias pairs must be [token, bias]: a token id or a "
                                  "string, and a number or false.", f"{param}.{i}")
            token = pair[0]
            if isinstance(token, bool) or not isinstance(token, (int, str)):
                raise bad_request("invalid_type", "A logit_bias token must be a token id or a string.",
                                  f"{param}.{i}.0")
            entries.append((token, pair[1], f"{param}.{i}"))
    else:
        raise bad_request("invalid_type", "logit_bias must be an object {token: bias} or a list of "
                          "[token, bias] pairs.", param)
    out: dict[int, float] = {}
    for token, bias, where in entries:
        b = _bias(bias, where if isinstance(value, dict) else f"{where}.1")
        for tid in _token_ids(token, tokenizer, vocab, where if isinstance(value, dict) else f"{where}.0"):
            out[tid] = out.get(tid, 0.0) + b
    if sum(1 for b in out.values() if b == BAN) >= vocab:
        raise bad_request("invalid_value", "logit_bias bans every token of the vocabulary.", param)
    return {t: b for t, b in out.items() if b != 0}


def _map_key(key: str) -> int | str:
    """An integer key is a token id (OpenAI); any other key is text (llama.cpp)."""
    stripped = key.strip()
    if stripped.lstrip("+-").isdigit():
        return int(stripped)
    return key


def _bias(bias: Any, where: str) -> float:
    if bias is False:
        return BAN
    if isinstance(bias, bool) or not isinstance(bias, (int, float)):
        raise bad_request("invalid_type", "A logit_bias value must be a number or false (a ban).", where)
    if not math.isfinite(bias) or not -BIAS_LIMIT <= bias <= BIAS_LIMIT:
        raise bad_request("invalid_value", f"A logit_bias value must be between -{BIAS_LIMIT:g} and "
                          f"{BIAS_LIMIT:g} (false bans the token), got {bias}.", where)
    return float(bias)


def _token_ids(token: int | str, tokenizer: Any, vocab: int, where: str) -> list[int]:
    if isinstance(token, int):
        if not 0 <= token < vocab:
            raise bad_request("invalid_value", f"logit_bias names token id {token}, outside the vocabulary "
                              f"(0..{vocab - 1}).", where)
        return [token]
    ids = tokenizer.encode(token, allow_special=False) if token else []
    if not ids:
        raise bad_request("invalid_value", "A logit_bias string must encode to at least one token.", where)
    return ids
