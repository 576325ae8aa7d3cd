"""Train the byte-level BPE of ninfer-tiny and export it as a NInfer tokenizer section.

The `tokenizers` BPE trainer learns merges on the training text split by Qwen3.5's own
pre-tokenizer regex (NFC-normalised, as Qwen does), over the 256 byte symbols. Ids are
assigned in merge order, so ranks = ids reproduces the merge list under tiktoken; this is
checked with the same rule the Hugging Face import uses (`ninfer_core.tokenizer.hf`). Qwen3.5's
added tokens (control tokens, reasoning and tool markup, vision markers), taken from
`qwen35_tokenizer_section()`, follow the BPE vocabulary in Qwen's order with their special flags.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable

from ninfer_qwen35.chat import EOS_TOKENS as QWEN35_EOS_TOKENS
from ninfer_qwen35.chat import QWEN35_PATTERN

from ninfer_core.tokenizer.hf import _check_merge_order, bytes_to_unicode


def qwen35_added_tokens() -> list[dict]:
    """Qwen3.5's added tokens in id order: [{content, special}]."""
    from ninfer_qwen35.chat import qwen35_tokenizer_section

    added = sorted(qwen35_tokenizer_section()["added_tokens"], key=lambda t: t["id"])
    return [{"content": t["content"], "special": bool(t["special"])} for t in added]


def strip_control(text: str, added: Iterable[str]) -> str:
    """Training text for the BPE: control tokens are not learned as byte sequences."""
    for tok in sorted(added, key=len, reverse=True):
        text = text.replace(tok, "\n")
    return text


def train_section(texts: Iterable[str], vocab_size: int = 8192, added: list[dict] | None = None) -> dict:
    """Train a byte-level BPE of `vocab_size` ids (bytes included) and return the section.

    Added tokens take ids vocab_size, vocab_size + 1, ... in the order given (Qwen3.5's by default).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    added = added if added is not None else qwen35_added_tokens()
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False, special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    contents = [t["content"] for t in added]
    tok.train_from_iterator((strip_control(t, contents) for t in texts), trainer=trainer)
    model = tok.to_str()
    import json

    data = json.loads(model)["model"]
    vocab: dict[str, int] = data["vocab"]
    _check_merge_order(vocab, data["merges"])
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    ranks = sorted(((bytes(byte_of[c] for c in s), i) for s, i in vocab.items()), key=lambda kv: kv[1])
    if sorted(i for _, i in ranks) != list(range(len(ranks))):
        raise ValueError("trained vocabulary ids are not contiguous")
    n = len(ranks)
    return {
        "type": "bpe",
        "ranks": "".join(f"{base64.b64encode(b).decode('ascii')} {i}\n" for b, i in ranks),
        "pattern": QWEN35_PATTERN,
        "normalizer": "NFC",
        "added_tokens": [{"id": n + k, "content": t["content"], "special": t["special"]} for k, t in enumerate(added)],
        "eos_tokens": list(QWEN35_EOS_TOKENS),
        "pad_token": "<|endoftext|>",
        "bos_token": None,
    }
