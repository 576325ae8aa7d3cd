"""`ninfer convert HF_DIR OUT`: a Hugging Face checkpoint directory to a .ninfer v3 artifact."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
from collections import Counter

from ninfer_core.artifact.format import BY_SAFETENSORS, ArtifactError
from ninfer_core.artifact.progress import human_bytes
from ninfer_core.artifact.writer import TensorSpec, write_artifact


def run_convert(args, check_manifest=None) -> int:
    """CLI entry: returns 0, or 1 with `error: ...` on stderr. `check_manifest(manifest)` (the CLI's
    model-family check) may complete the manifest of a Hugging Face directory or raise ArtifactError
    before any tensor is written."""
    head = getattr(args, "mtp_proposal_head", None)
    corpus = getattr(args, "mtp_proposal_corpus", None)
    drafters = {k: getattr(args, k) for k in ("dflash", "dflash2") if getattr(args, k, None)}
    progress = not getattr(args, "no_progress", False)
    try:
        if head is not None and not corpus:
            raise ArtifactError("--mtp-proposal-head needs --mtp-proposal-corpus FILE (UTF-8 text whose token "
                                "counts pick the rows; ninfer-tiny's: python -m ninfer_tiny.corpus > corpus.txt)")
        if corpus and head is None:
            raise ArtifactError("--mtp-proposal-corpus is used with --mtp-proposal-head N")
        if os.path.isfile(args.hf_dir) and args.hf_dir.endswith(".ninfer"):
            manifest = convert_artifact(args.hf_dir, args.out, name=args.name, progress=progress,
                                        proposal_head=head, corpus=corpus, drafters=drafters)
        else:
            manifest = convert_hf_dir(args.hf_dir, args.out, name=args.name, progress=progress,
                                      proposal_head=head, corpus=corpus, check_manifest=check_manifest,
                                      drafters=drafters)
    except ArtifactError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tensors = manifest["tensors"]
    per = Counter(t["component"] for t in tensors.values())
    parts = ", ".join(f"{c} {per[c]}" for c in manifest["components"])
    size = os.path.getsize(args.out)
    print(
        f"wrote {args.out}: {manifest['architecture']}, {len(tensors)} tensors ({parts}), {human_bytes(size)}"
    )
    return 0


def convert_hf_dir(hf_dir, out, name: str | None = None, progress: bool = False, proposal_head: int | None = None,
                   corpus: str | None = None, check_manifest=None, drafters: dict | None = None) -> dict:
    """Convert `hf_dir` into the artifact `out`; returns the manifest written. ArtifactError on bad input.

    `proposal_head` N (with `corpus`): also store an optimised proposal head of N rows
    (`ninfer_core.artifact.proposal`). `drafters` {kind: checkpoint dir}: drafter companions
    (`ninfer_core.artifact.drafters`)."""
    hf_dir = os.fspath(hf_dir)
    out = os.fspath(out)
    if not os.path.isdir(hf_dir):
        raise ArtifactError(f"{hf_dir} is not a directory")
    out_dir = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise ArtifactError(f"output {out} is a directory; give a file path such as {out}/model.ninfer")
    if not os.path.isdir(out_dir):
        raise ArtifactError(f"output directory {out_dir} does not exist")
    # Cheap checks first, so a directory without weights fails before the tokenizer is read.
    _read_json(hf_dir, "config.json", required=True)
    _weight_files(hf_dir)
    manifest = hf_manifest(hf_dir, name=name)
    if check_manifest is not None:
        check_manifest(manifest)
    with contextlib.ExitStack() as stack:
        specs = hf_tensor_specs(hf_dir, stack)
        if proposal_head is not None:
            from ninfer_core.artifact.proposal import proposal_specs

            loaders = {sp.name: sp.load for sp in specs}
            specs += proposal_specs(manifest, loaders, lambda n: loaders[n](), proposal_head, corpus, progress)
        if drafters:
            from ninfer_core.artifact.drafters import add_drafters

            specs = add_drafters(manifest, specs, drafters, stack)
        write_artifact(out, manifest, specs, progress=progress)
    return manifest


def convert_artifact(src, out, name: str | None = None, progress: bool = False, proposal_head: int | None = None,
                     corpus: str | None = None, drafters: dict | None = None) -> dict:
    """Re-write the artifact `src` as `out` (same tensors and manifest), adding or replacing its
    proposal head when `proposal_head` is given and its drafter companions in `drafters`."""
    from ninfer_core.artifact.proposal import TOKEN_IDS, WEIGHT, proposal_specs
    from ninfer_core.artifact.reader import Artifact

    if os.path.abspath(src) == os.path.abspath(out):
        raise ArtifactError("the output must be another file than the source artifact")
    art = Artifact.open(src)
    try:
        manifest = {k: v for k, v in art.manifest.items() if k not in ("format_version", "tensors", "components")}
        if name:
            manifest["name"] = name
        names = [n for n in art.tensor_names() if n not in (WEIGHT, TOKEN_IDS)]
        manifest["tensors"] = {n: {"component": art.tensor_component(n)} for n in names}
        specs = []
        for n in names:
            t = art.get_tensor(n)
            specs.append(TensorSpec(n, t.dtype, tuple(t.shape), lambda n=n: art.get_tensor(n)))
        if proposal_head is not None:
            specs += proposal_specs(manifest, names, art.get_tensor, proposal_head, corpus, progress)
        with contextlib.ExitStack() as stack:
            if drafters:
                from ninfer_core.artifact.drafters import add_drafters

                specs = add_drafters(manifest, specs, drafters, stack)
            write_artifact(out, manifest, specs, progress=progress)
    finally:
        art.close()
    return manifest


def hf_manifest(hf_dir: str, name: str | None = None) -> dict:
    """The manifest fields read from a HF directory (everything but the tensors table)."""
    config = _read_json(hf_dir, "config.json", required=True)
    arch = config.get("model_type")
    if not isinstance(arch, str) or not arch:
        raise ArtifactError(f"{os.path.join(hf_dir, 'config.json')} has no model_type")
    name = name or os.path.basename(os.path.abspath(hf_dir))
    return {
        "name": name,
        "architecture": arch,
        "identity": {"model_id": name},
        "config": config,
        "tokenizer": _tokenizer_section(hf_dir),
        "chat_template": read_chat_template(hf_dir),
        "generation": _read_json(hf_dir, "generation_config.json", required=False) or {},
    }


def hf_tensor_specs(hf_dir: str, stack: contextlib.ExitStack) -> list[TensorSpec]:
    """TensorSpecs for every checkpoint tensor, names unchanged, dtypes as stored.

    The shards stay open (in `stack`) until the caller has written them; each spec's `load`
    reads one tensor from its memory-mapped shard.
    """
    from safetensors import safe_open

    shards, wanted = _weight_files(hf_dir)
    specs: list[TensorSpec] = []
    where: dict[str, str] = {}
    for label, shard in shards:
        try:
            handle = stack.enter_context(safe_open(shard, framework="pt"))
        except Exception as e:  # SafetensorError from the Rust binding
            raise ArtifactError(f"cannot read weights {shard}: {e}") from None
        for tname in sorted(handle.keys()):
            if wanted is not None and wanted.get(tname) != label:
                continue
            if tname in where:
                raise ArtifactError(f"tensor {tname!r} is in both {where[tname]} and {shard}")
            where[tname] = shard
            sl = handle.get_slice(tname)
            st_dtype = sl.get_dtype()
            if st_dtype not in BY_SAFETENSORS:
                raise ArtifactError(
                    f"tensor {tname!r} in {shard} has dtype {st_dtype}, which .ninfer cannot store"
                )
            specs.append(
                TensorSpec(
                    tname,
                    BY_SAFETENSORS[st_dtype].torch,
                    tuple(sl.get_shape()),
                    lambda h=handle, n=tname: h.get_tensor(n),
                )
            )
    if wanted is not None:
        missing = sorted(set(wanted) - set(where))
        if missing:
            raise ArtifactError(
                f"the weight index in {hf_dir} lists {len(missing)} tensor(s) its shards lack "
                f"(e.g. {missing[0]!r} in {wanted[missing[0]]})"
            )
    if not specs:
        raise ArtifactError(f"the weights in {hf_dir} contain no tensors")
    return specs


def _weight_files(hf_dir: str) -> tuple[list[tuple[str, str]], dict[str, str] | None]:
    """(name as the index writes it, path) per shard, and the index's tensor -> shard map if any."""
    indexes = sorted(glob.glob(os.path.join(glob.escape(hf_dir), "*.safetensors.index.json")))
    preferred = os.path.join(hf_dir, "model.safetensors.index.json")
    if preferred in indexes:
        indexes = [preferred]
    if len(indexes) > 1:
        names = ", ".join(os.path.basename(i) for i in indexes)
        raise ArtifactError(f"{hf_dir} has several weight indexes ({names}); keep one")
    if indexes:
        index = _read_json(hf_dir, os.path.basename(indexes[0]), required=True)
        wmap = index.get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise ArtifactError(f"{indexes[0]} has no weight_map")
        shards = []
        for shard in sorted(set(wmap.values())):
            p = os.path.join(hf_dir, shard)
            if not os.path.isfile(p):
                raise ArtifactError(f"the weight index {indexes[0]} names {shard}, which is missing")
            shards.append((shard, p))
        return shards, wmap
    shards = sorted(glob.glob(os.path.join(glob.escape(hf_dir), "*.safetensors")))
    if not shards:
        raise ArtifactError(
            f"{hf_dir} has no weights: expected *.safetensors files (or model.safetensors.index.json)"
        )
    return [(os.path.basename(p), p) for p in shards], None


def _read_json(hf_dir: str, name: str, required: bool):
    p = os.path.join(hf_dir, name)
    if not os.path.isfile(p):
        if required:
            raise ArtifactError(f"{hf_dir} has no {name}; is it a Hugging Face checkpoint directory?")
        return None
    try:
        with open(p, encoding="utf-8") as f:
            value = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ArtifactError(f"{p} is not a JSON object")
    return value


def _tokenizer_section(hf_dir: str) -> dict:
    if not os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        raise ArtifactError(f"{hf_dir} has no tokenizer.json")
    from ninfer_core.tokenizer.hf import tokenizer_section_from_hf_dir

    try:
        return tokenizer_section_from_hf_dir(hf_dir)
    except Exception as e:  # the tokenizer reader's own errors; converting stops here either way
        raise ArtifactError(f"cannot read the tokenizer in {hf_dir}: {e}") from e


def read_chat_template(hf_dir: str) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's chat_template, else chat_template.json."""
    jinja = os.path.join(hf_dir, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    for fname in ("tokenizer_config.json", "chat_template.json"):
        cfg = _read_json(hf_dir, fname, required=False) or {}
        tmpl = cfg.get("chat_template")
        if isinstance(tmpl, list):  # older format: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            tmpl = named.get("default") or next(iter(named.values()), None)
        if isinstance(tmpl, str) and tmpl:
            return tmpl
    return None
