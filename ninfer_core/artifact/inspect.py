"""`ninfer inspect ARTIFACT [--json] [--verify]`: what an artifact holds, without loading weights."""

from __future__ import annotations

import copy
import json
import os
import sys
from collections import Counter

from ninfer_core.artifact.format import ArtifactError
from ninfer_core.artifact.progress import human_bytes
from ninfer_core.artifact.reader import Artifact


def run_inspect(args) -> int:
    """CLI entry: prints the summary (or `--json` manifest); 1 with `error: ...` on stderr if unusable."""
    try:
        with Artifact.open(args.artifact) as art:
            if getattr(args, "json", False):
                print(json.dumps(manifest_for_display(art.manifest), indent=2, ensure_ascii=False))
            else:
                print(summary(art))
            if getattr(args, "verify", False):
                n = art.verify(progress=not getattr(args, "no_progress", False))
                # with --json, stdout stays pure JSON
                to = sys.stderr if getattr(args, "json", False) else sys.stdout
                print(f"verify: ok, CRC32 of {n} tensors match", file=to)
    except ArtifactError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def manifest_for_display(manifest: dict) -> dict:
    """The manifest with the tokenizer's rank table (megabytes of base64) replaced by a count."""
    out = copy.deepcopy(manifest)
    tok = out.get("tokenizer")
    if isinstance(tok, dict) and isinstance(tok.get("ranks"), str):
        tok["ranks"] = f"<{_count_ranks(tok['ranks'])} ranks elided>"
    return out


def _count_ranks(ranks: str) -> int:
    return sum(1 for line in ranks.splitlines() if line.strip())


def tokenizer_vocab_size(section: dict) -> int:
    """max token id + 1 over the ranks and the added tokens (0 for an empty section)."""
    top = -1
    for line in (section.get("ranks") or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            top = max(top, int(parts[1]))
    for t in section.get("added_tokens") or []:
        if isinstance(t, dict) and isinstance(t.get("id"), int):
            top = max(top, t["id"])
    return top + 1


def config_value(config: dict, key: str):
    """A config value from the top level or, for multimodal configs, from text_config."""
    if key in config:
        return config[key]
    text = config.get("text_config")
    if isinstance(text, dict):
        return text.get(key)
    return None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def summary(art: Artifact) -> str:
    m = art.manifest
    rows: list[tuple[str, str]] = []
    rows.append(("path", f"{os.path.abspath(art.path)} ({human_bytes(os.path.getsize(art.path))})"))
    rows.append(("format version", str(m.get("format_version"))))
    rows.append(("name", art.name))
    rows.append(("architecture", art.architecture))

    comps = []
    for c in art.components:
        names = art.tensor_names(c)
        nbytes = sum(art.tensor_nbytes(n) for n in names)
        comps.append(f"{c} ({_count(len(names), 'tensor')}, {human_bytes(nbytes)})")
    rows.append(("components", ", ".join(comps) or "none"))
    rows.append(("parameters", f"{art.num_parameters():,}"))
    enc: Counter = Counter()
    size: Counter = Counter()
    table = m.get("tensors") or {}
    for n in art.tensor_names():
        # an encoded weight's scale tensor is counted (and sized) with its weight's encoding
        owner = (table.get(n) or {}).get("scale_of")
        e = art.tensor_encoding(owner) if owner else art.tensor_encoding(n)
        enc[e] += 0 if owner else 1
        size[e] += art.tensor_nbytes(n)
    rows.append(("encodings", ", ".join(f"{e} ({_count(k, 'tensor')}, {human_bytes(size[e])})"
                                         for e, k in enc.most_common())))

    tok = art.tokenizer_section
    if tok:
        added = tok.get("added_tokens") or []
        eos = ", ".join(tok.get("eos_tokens") or []) or "none"
        rows.append(
            (
                "tokenizer",
                f"{tok.get('type', '?')}, vocab {tokenizer_vocab_size(tok)}, "
                f"{_count(len(added), 'added token')}, eos {eos}",
            )
        )
    else:
        rows.append(("tokenizer", "none"))
    tmpl = art.chat_template
    rows.append(("chat template", f"yes ({len(tmpl)} chars)" if tmpl else "no"))
    head = m.get("proposal_head")
    if isinstance(head, dict) and art.has_tensor("mtp_proposal.weight"):
        rows.append(("proposal head", f"{head.get('rows')} rows of {head.get('source')} "
                                      f"(counted on {head.get('corpus')})"))

    cfg = art.config
    parts = []
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "num_experts"):
        v = config_value(cfg, key)
        if v is not None:
            parts.append(f"{key} {v}")
    layer_types = config_value(cfg, "layer_types")
    if isinstance(layer_types, list) and layer_types:
        counts = Counter(map(str, layer_types))
        parts.append("layer types " + ", ".join(f"{t} x{k}" for t, k in counts.items()))
    rows.append(("config", "; ".join(parts) or "(empty)"))
    gen = art.generation
    if gen:
        shown = {k: v for k, v in gen.items() if not k.startswith("_") and k != "transformers_version"}
        rows.append(("generation", ", ".join(f"{k} {v}" for k, v in shown.items())))
    width = max(len(k) for k, _ in rows) + 1
    return "\n".join(f"{(k + ':').ljust(width)} {v}" for k, v in rows)
