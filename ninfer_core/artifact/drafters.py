"""Drafter companions of an artifact: `ninfer convert SRC OUT --dflash DIR` / `--dflash2 DIR`.

DIR is a published drafter checkpoint (config.json and *.safetensors, the z-lab/dflash layout:
`fc.weight`, `hidden_norm.weight`, `layers.N.*`, `norm.weight`, no embeddings or LM head of its
own). Its tensors are stored as `<kind>.<checkpoint name>` in component `<kind>` and its config.json
as `manifest["drafters"][kind]`; the speculative backend of that name reads both back. A leading
`model.` of the checkpoint's names is dropped (a drafter saved inside a wrapper module).
"""

from __future__ import annotations

import contextlib
import os

from ninfer_core.artifact.format import ArtifactError

DRAFTER_KINDS = ("dflash", "dflash2")


def _target_hidden(config: dict) -> int | None:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    v = text.get("hidden_size")
    return v if isinstance(v, int) else None


def drafter_specs(kind: str, path: str, target_config: dict, stack: contextlib.ExitStack):
    """(the drafter's config, TensorSpecs named `<kind>.*`) of the checkpoint at `path`."""
    from ninfer_core.artifact.convert import _read_json, hf_tensor_specs
    from ninfer_core.artifact.writer import TensorSpec

    if kind not in DRAFTER_KINDS:
        raise ArtifactError(f"unknown drafter kind {kind!r}")
    flag = f"--{kind}"
    if not os.path.isdir(path):
        raise ArtifactError(f"{flag} {path}: not a directory (a drafter checkpoint: config.json and *.safetensors)")
    config = _read_json(path, "config.json", required=True)
    if not isinstance(config, dict):
        raise ArtifactError(f"{flag} {path}: config.json is not a JSON object")
    specs = hf_tensor_specs(path, stack)
    renamed = []
    for s in specs:
        name = s.name.removeprefix("model.")
        renamed.append(TensorSpec(f"{kind}.{name}", s.dtype, s.shape, s.load))
    names = {s.name for s in renamed}
    missing = [n for n in ("fc.weight", "hidden_norm.weight", "norm.weight") if f"{kind}.{n}" not in names]
    if missing:
        raise ArtifactError(f"{flag} {path}: not a {kind} drafter checkpoint (it lacks {', '.join(missing)})")
    if kind == "dflash2" and f"{kind}.candidate_selector.successor_codebook" not in names:
        raise ArtifactError(f"{flag} {path}: a DFlash2 drafter has a candidate selector "
                            "(candidate_selector.*); this checkpoint has none (convert it with --dflash)")
    extra = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    if "mask_token_id" not in extra and "mask_token_id" not in config:
        raise ArtifactError(f"{flag} {path}: config.json has no dflash_config.mask_token_id")
    want, got = _target_hidden(target_config), config.get("hidden_size")
    if want is not None and got != want:
        raise ArtifactError(f"{flag} {path}: the drafter's hidden_size {got} is not the model's {want} "
                            "(a drafter for another model?)")
    return config, renamed


def add_drafters(manifest: dict, specs: list, drafters: dict, stack: contextlib.ExitStack) -> list:
    """Add each {kind: path} drafter to `specs` and the manifest (replacing one already stored)."""
    for kind, path in drafters.items():
        config, extra = drafter_specs(kind, path, manifest.get("config") or {}, stack)
        specs = [s for s in specs if not s.name.startswith(kind + ".")]
        table = manifest.setdefault("tensors", {})
        for n in [n for n in table if n.startswith(kind + ".")]:
            del table[n]
        for s in extra:
            table[s.name] = {"component": kind}
        manifest.setdefault("drafters", {})[kind] = config
        specs += extra
    return specs
