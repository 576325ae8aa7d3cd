"""A tokenizer for the HTTP row of `ninfer bench` when the model's weights are random.

A random-weight model samples ids uniformly over its whole vocabulary (about 250k for the
registered shapes), but the tokenizer it is built with has a few hundred tokens, so almost every
id decodes to nothing and the engine, which emits a delta only when there is text, sends almost no
per-token events: the HTTP figure would measure only per-request cost. `covering_section(V,
controls)` is a byte-level BPE section in which every id below V is one distinct printable token
(single ASCII characters, then 2-, 3-, 4-character alphanumeric strings), except the few control
tokens the chat template needs (`template_controls`: the artifact's added tokens its template
writes, and its end tokens). Sampling, the forward and the detokeniser run exactly as with a real
tokenizer; only the text that comes out differs.
"""

from __future__ import annotations

import base64
import itertools
import string

_ALNUM = string.ascii_letters + string.digits
# Only the control tokens the chat template renders are kept; each one is an id the model may
# sample that decodes to nothing (special), so the list is kept short.
MAX_CONTROLS = 16
_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def template_controls(section: dict, rendered: str) -> dict:
    """{"tokens": [...], "eos": [...], "pad": ...} of an artifact's tokenizer `section`: the
    end-of-sequence tokens and the added tokens the `rendered` prompt text spells (the markup the
    chat template writes for the bench's prompts), at most MAX_CONTROLS, end tokens first."""
    eos = [t for t in section.get("eos_tokens") or [] if isinstance(t, str)]
    added = [t.get("content") for t in section.get("added_tokens") or []]
    spelled = [c for c in added if isinstance(c, str) and c and c in rendered and c not in eos]
    tokens = list(dict.fromkeys(eos + spelled))[:MAX_CONTROLS]
    return {"tokens": tokens, "eos": [t for t in eos if t in tokens],
            "pad": section.get("pad_token") if section.get("pad_token") in tokens else None}


def covering_section(vocab_size: int, controls: dict) -> dict:
    """A tokenizer section with exactly `vocab_size` ids, each a distinct printable token or one
    of the control tokens `controls` names (ids 0..n-1; `template_controls`)."""
    control = list(controls["tokens"])
    singles = [chr(c) for c in range(0x20, 0x7F)] + ["\n", "\t"]
    need = vocab_size - len(control)
    if need < len(singles):
        raise ValueError(f"vocabulary {vocab_size} is too small for a covering tokenizer")
    lines, rank = [], len(control)

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
    added = [{"id": i, "content": c, "special": True} for i, c in enumerate(control)]
    return {"type": "bpe", "ranks": "\n".join(lines) + "\n", "pattern": _PATTERN, "added_tokens": added,
            "eos_tokens": list(controls.get("eos") or []), "pad_token": controls.get("pad"),
            "bos_token": None}


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
