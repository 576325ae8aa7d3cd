"""A tokenizer for the HTTP row of `ninfer bench` when the model's weights are random.

A random-weight model samples ids uniformly over its whole vocabulary (248k for the Qwen3.5
shapes), but the tokenizer it is built with has a few hundred tokens, so almost every id decodes
to nothing and the engine, which emits a delta only when there is text, sends almost no per-token
events: the HTTP figure would measure only per-request cost. `covering_section(V)` is a byte-level
BPE section in which every id below V is one distinct printable token (single ASCII characters,
then 2-, 3-, 4-character alphanumeric strings), except the few control tokens the chat template
needs. Sampling, the forward and the detokeniser run exactly as with a real tokenizer; only the
text that comes out differs.
"""

from __future__ import annotations

import base64
import itertools
import string

_ALNUM = string.ascii_letters + string.digits
# Only the control tokens the Qwen chat template renders; each one is an id the model may sample
# that decodes to nothing (special), so the list is kept short.
_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def covering_section(vocab_size: int) -> dict:
    """A tokenizer section with exactly `vocab_size` ids, each a distinct printable token or one
    of the five control tokens (ids 0..4)."""
    singles = [chr(c) for c in range(0x20, 0x7F)] + ["\n", "\t"]
    need = vocab_size - len(_CONTROL)
    if need < len(singles):
        raise ValueError(f"vocabulary {vocab_size} is too small for a covering tokenizer")
    lines, rank = [], len(_CONTROL)

    def add(text: str):
        nonlocal rank
        lines.append(f"{base64.b64encode(text.encode()).decode()} {rank}")
        rank += 1

    for s in singles:
        add(s)
    for n in itertools.count(2):
        for combo in itertools.product(_ALNUM, repeat=n):
            if rank >= vocab_size:
                break
            add("".join(combo))
        if rank >= vocab_size:
            break
    added = [{"id": i, "content": c, "special": True} for i, c in enumerate(_CONTROL)]
    return {"type": "bpe", "ranks": "\n".join(lines) + "\n", "pattern": _PATTERN, "added_tokens": added,
            "eos_tokens": ["<|im_end|>", "<|endoftext|>"], "pad_token": "<|endoftext|>", "bos_token": None}


def text_coverage(tok, vocab_size: int) -> float:
    """Fraction of ids below `vocab_size` that decode, alone, to non-empty valid UTF-8 text."""
    ok = 0
    for i in range(vocab_size):
        if tok.is_special(i):
            continue
        b = tok.token_bytes(i)
        if b:
            try:
                b.decode("utf-8")
            except UnicodeDecodeError:
                continue
            ok += 1
    return ok / max(1, vocab_size)
