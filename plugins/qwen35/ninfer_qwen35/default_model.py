"""The artifact `ninfer serve` runs when none is named: "ninfer-tiny-random".

A Qwen3.5-architecture model (dense, 4 layers, hidden 64, tied embeddings, bf16 storage) with
random weights drawn from a fixed seed, the real Qwen3.5 tokenizer (vocabulary 248320) and the
project's chat template. It answers in noise, but every API path runs end to end on a laptop.
Built once into `cache_dir/ninfer-tiny-random-<digest>.ninfer`; the digest covers everything
the bytes depend on, so a changed recipe gets a new file instead of a stale one.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid

NAME = "ninfer-tiny-random"
SEED = 3517
RECIPE_VERSION = 1
HIDDEN = 64
NUM_LAYERS = 4
VOCAB_SIZE = 248320


def _sha(obj) -> str:
    text = obj if isinstance(obj, str) else json.dumps(obj, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _inputs() -> tuple[dict, str | None]:
    from ninfer_qwen35.chat import QWEN35_TEMPLATE, qwen35_tokenizer_section

    return qwen35_tokenizer_section(), QWEN35_TEMPLATE


def default_artifact_path(cache_dir, section: dict | None = None, template: str | None = None) -> str:
    """Where the default artifact for this recipe lives (it may not exist yet)."""
    from ninfer_core.artifact import FORMAT_VERSION

    if section is None:
        section, template = _inputs()
    recipe = {
        "recipe": RECIPE_VERSION, "format": FORMAT_VERSION, "seed": SEED, "hidden": HIDDEN,
        "layers": NUM_LAYERS, "vocab": VOCAB_SIZE, "dtype": "bf16",
        "tokenizer": _sha(section), "template": _sha(template or ""),
    }  # fmt: skip
    return os.path.join(os.fspath(cache_dir), f"{NAME}-{_sha(recipe)[:12]}.ninfer")


def build_default_artifact(path, section: dict | None = None, template: str | None = None) -> str:
    """Write the default artifact at `path` (deterministic bytes)."""
    import torch

    from ninfer_qwen35.testing import build_tiny_artifact

    if section is None:
        section, template = _inputs()
    return build_tiny_artifact(
        path, kind="dense", seed=SEED, tokenizer_section=section, vocab_size=VOCAB_SIZE,
        num_layers=NUM_LAYERS, hidden=HIDDEN, tie_word_embeddings=True, dtype=torch.bfloat16,
        name=NAME, chat_template=template,
    )  # fmt: skip


def ensure_default_artifact(cache_dir) -> str:
    """The default artifact's path, building it on first use.

    Concurrent first uses are safe: each builder writes its own temporary file and renames it
    over the final name (same bytes either way). A file that no longer opens is rebuilt.
    """
    from ninfer_core.artifact import Artifact, ArtifactError

    section, template = _inputs()
    path = default_artifact_path(cache_dir, section, template)
    if os.path.exists(path):
        try:
            Artifact.open(path).close()
            return path
        except ArtifactError:
            pass
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.part"
    try:
        build_default_artifact(tmp, section, template)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
