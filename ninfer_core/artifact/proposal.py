"""`ninfer convert --mtp-proposal-head N`: an optimised proposal head for speculative drafting.

The head is the output-head rows of N tokens: every added (special) token of the tokenizer, so
turn ends and reasoning or tool markers can be drafted, then the tokens most frequent in a corpus
the converter is given (UTF-8 text, tokenized with the artifact's own tokenizer), ties by id. It is
stored as `mtp_proposal.weight` [N, hidden] (the rows of `lm_head.weight`, or of the token
embedding when the output head is tied to it) and `mtp_proposal.token_ids` [N] int64, component
"mtp"; `--spec mtp` drafts through it unless `--full-draft-head`.
"""

from __future__ import annotations

import os
from collections import Counter

import torch

from ninfer_core.artifact.format import ArtifactError

WEIGHT = "mtp_proposal.weight"
TOKEN_IDS = "mtp_proposal.token_ids"
CORPUS_MAX_BYTES = 256 << 20
CHUNK_CHARS = 1 << 20


def output_head_name(names) -> str:
    """The tensor whose rows are the output head: lm_head.weight, else the (tied) token embedding."""
    names = list(names)
    if "lm_head.weight" in names:
        return "lm_head.weight"
    emb = [n for n in names if n.endswith("embed_tokens.weight") and "mtp." not in n]
    if len(emb) == 1:
        return emb[0]
    raise ArtifactError("no output head to take proposal rows from (neither lm_head.weight nor one "
                        "*embed_tokens.weight)")


def count_tokens(tokenizer_section: dict, corpus: str, progress: bool = False) -> Counter:
    """Token frequencies of the corpus file, tokenized with the artifact's tokenizer."""
    from ninfer_core.tokenizer import Tokenizer

    if not os.path.isfile(corpus):
        raise ArtifactError(f"the proposal-head corpus {corpus} is not a file")
    size = os.path.getsize(corpus)
    if size == 0:
        raise ArtifactError(f"the proposal-head corpus {corpus} is empty")
    tok = Tokenizer.from_section(tokenizer_section)
    counts: Counter = Counter()
    done = 0
    with open(corpus, encoding="utf-8", errors="replace") as f:
        while done < CORPUS_MAX_BYTES:
            text = f.read(CHUNK_CHARS)
            if not text:
                break
            counts.update(tok.encode(text, allow_special=True))
            done += len(text.encode("utf-8", "replace"))
            if progress:
                print(f"\rcounting proposal-head tokens: {min(done, size) / size:.0%}", end="", flush=True)
    if progress:
        print(flush=True)
    return counts


def choose_ids(tokenizer_section: dict, counts: Counter, n: int, vocab: int) -> list[int]:
    """Added tokens first (by id), then the most frequent, then the lowest unseen ids, n in all."""
    if not 1 <= n <= vocab:
        raise ArtifactError(f"--mtp-proposal-head {n} must be in 1..{vocab} (the vocabulary)")
    chosen: list[int] = []
    seen: set[int] = set()
    added = sorted(int(t["id"]) for t in tokenizer_section.get("added_tokens") or [] if int(t["id"]) < vocab)
    for t in added + [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if t < vocab]:
        if len(chosen) == n:
            break
        if t not in seen:
            seen.add(t)
            chosen.append(t)
    t = 0
    while len(chosen) < n:
        if t not in seen:
            seen.add(t)
            chosen.append(t)
        t += 1
    return chosen


def proposal_specs(manifest: dict, names, get_tensor, n: int, corpus: str, progress: bool = False) -> list:
    """TensorSpecs of the proposal head (and the manifest entries that make them component "mtp")."""
    from ninfer_core.artifact.writer import TensorSpec

    head = output_head_name(names)
    rows_of = get_tensor(head)
    ids = choose_ids(manifest.get("tokenizer") or {}, count_tokens(manifest.get("tokenizer") or {}, corpus, progress),
                     n, int(rows_of.shape[0]))
    index = torch.tensor(ids, dtype=torch.int64)
    tensors = manifest.setdefault("tensors", {})
    tensors[WEIGHT] = {"component": "mtp"}
    tensors[TOKEN_IDS] = {"component": "mtp"}
    manifest["proposal_head"] = {"rows": n, "source": head, "corpus": os.path.basename(corpus)}
    return [TensorSpec(WEIGHT, rows_of.dtype, (n, int(rows_of.shape[1])),
                       lambda: get_tensor(head).index_select(0, index).contiguous()),
            TensorSpec(TOKEN_IDS, torch.int64, (n,), lambda: index.clone())]
