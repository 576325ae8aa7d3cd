"""Streaming .ninfer writer: header from the specs first, then one tensor in memory at a time."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ninfer_core.artifact.format import (
    CRC_PLACEHOLDER,
    FORMAT_VERSION,
    HEADER_ALIGN,
    HEADER_CRC_KEY,
    MANIFEST_KEY,
    ArtifactError,
    component_of,
    crc32,
    crc_hex,
    dtype_info,
    header_crc_field,
    itemsize,
    ordered_components,
    stored_encoding,
)
from ninfer_core.artifact.progress import ByteProgress

# Large tensors are written (and CRC'd) in slices so the progress bar moves inside them.
_WRITE_CHUNK = 64 << 20
_KEY_ORDER = ("format_version", "name", "architecture", "identity", "components", "chat_template",
              "generation", "config")


@dataclass
class TensorSpec:
    """A tensor to write: its header facts up front, its data only when `load()` is called.

    `load` must return a tensor of exactly `dtype` and `shape` (any device; it is copied to the
    CPU); the writer calls it once and drops the result before loading the next tensor.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = itemsize(dtype_info(self.dtype))
        for s in self.shape:
            n *= s
        return n


def write_artifact(path, manifest: dict, tensors: list[TensorSpec], progress: bool = False) -> None:
    """Write a .ninfer v3 file at `path` (via `path + ".tmp"`, renamed when complete).

    Fills `manifest["format_version"]`, `["tensors"]` (encoding, component, crc32 per tensor; a
    component already given there for a name is kept) and `["components"]`, and defaults the
    optional keys. `manifest["architecture"]` is required. Raises ArtifactError on a bad spec
    or a loaded tensor that does not match its spec; the partial file is removed.
    """
    path = os.fspath(path)
    if not isinstance(manifest.get("architecture"), str) or not manifest["architecture"]:
        raise ArtifactError("the manifest needs an 'architecture' (the HF model_type)")
    specs = _checked_specs(tensors)
    # Larger elements first: every tensor then starts at a multiple of its element size (the
    # data section starts 8-aligned), so memory-mapped views are naturally aligned.
    specs.sort(key=lambda s: -itemsize(dtype_info(s.dtype)))

    given = manifest.get("tensors") or {}
    table: dict[str, dict] = {}
    for s in specs:
        entry = dict(given.get(s.name) or {})
        entry["encoding"] = stored_encoding(dtype_info(s.dtype), entry.get("encoding"))
        entry.setdefault("component", component_of(s.name))
        entry["crc32"] = CRC_PLACEHOLDER
        table[s.name] = entry
    name = manifest.get("name") or os.path.splitext(os.path.basename(path))[0]
    manifest["format_version"] = FORMAT_VERSION
    manifest["name"] = name
    manifest.setdefault("config", {})
    manifest.setdefault("tokenizer", {})
    manifest.setdefault("chat_template", None)
    manifest.setdefault("identity", {"model_id": name})
    manifest.setdefault("generation", {})
    manifest["components"] = ordered_components(e["component"] for e in table.values())
    manifest["tensors"] = table
    # Same dict, readable key order in the file: identity first, the big tables last.
    ordered = {k: manifest[k] for k in _KEY_ORDER if k in manifest}
    ordered.update((k, v) for k, v in manifest.items() if k not in ordered)
    ordered["tokenizer"], ordered["tensors"] = ordered.pop("tokenizer"), ordered.pop("tensors")
    manifest.clear()
    manifest.update(ordered)

    header = _header_bytes(manifest, specs)
    total = sum(s.nbytes for s in specs)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f, ByteProgress(progress, "writing", total, len(specs)) as bar:
            f.write(header)
            f.flush()
            for s in specs:
                table[s.name]["crc32"] = crc_hex(_write_tensor(f, s, bar))
                f.flush()  # on disk before the next load: the file shows how far a conversion got
                bar.item_done()
            final = _header_bytes(manifest, specs)
            if len(final) != len(header):  # pragma: no cover - CRCs are fixed width
                raise ArtifactError("internal error: the header changed length when CRCs were filled in")
            f.seek(0)
            f.write(final)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _checked_specs(tensors: list[TensorSpec]) -> list[TensorSpec]:
    seen = set()
    out = []
    for s in tensors:
        if s.name in seen:
            raise ArtifactError(f"tensor {s.name!r} is given twice")
        if not s.name or s.name == "__metadata__":
            raise ArtifactError(f"invalid tensor name {s.name!r}")
        seen.add(s.name)
        dtype_info(s.dtype)
        shape = tuple(s.shape)
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ArtifactError(f"tensor {s.name!r} has an invalid shape {s.shape!r}")
        out.append(TensorSpec(s.name, s.dtype, shape, s.load))
    return out


def _header_bytes(manifest: dict, specs: list[TensorSpec]) -> bytes:
    try:
        manifest_text = json.dumps(manifest, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"the manifest is not JSON-serialisable: {e}") from None
    header: dict = {
        "__metadata__": {
            "format": "pt",
            MANIFEST_KEY: manifest_text,
            HEADER_CRC_KEY: CRC_PLACEHOLDER,
        }
    }
    pos = 0
    for s in specs:
        n = s.nbytes
        header[s.name] = {
            "dtype": dtype_info(s.dtype).safetensors,
            "shape": list(s.shape),
            "data_offsets": [pos, pos + n],
        }
        pos += n
    raw = json.dumps(header, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    # safetensors wants the data section 8-aligned; it allows trailing spaces in the header.
    raw += b" " * (-(8 + len(raw)) % HEADER_ALIGN)
    placeholder = header_crc_field(CRC_PLACEHOLDER)
    raw = raw.replace(placeholder, header_crc_field(crc_hex(crc32(raw))))
    return len(raw).to_bytes(8, "little") + raw


def _write_tensor(f, spec: TensorSpec, bar: ByteProgress) -> int:
    t = spec.load()
    if not isinstance(t, torch.Tensor):
        raise ArtifactError(f"loading tensor {spec.name!r} returned {type(t).__name__}, not a tensor")
    if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
        raise ArtifactError(
            f"tensor {spec.name!r} loaded as {t.dtype}{list(t.shape)}, "
            f"but its spec says {spec.dtype}{list(spec.shape)}"
        )
    t = t.detach().to("cpu").contiguous().reshape(-1)
    data = memoryview(t.view(torch.uint8).numpy())
    crc = 0
    for i in range(0, len(data), _WRITE_CHUNK):
        chunk = data[i : i + _WRITE_CHUNK]
        f.write(chunk)
        crc = crc32(chunk, crc)
        bar.advance(len(chunk))
    del data, t
    return crc
