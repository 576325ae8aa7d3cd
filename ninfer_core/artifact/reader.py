"""Artifact: a validated, memory-mapped .ninfer file."""

from __future__ import annotations

import os

import torch

from ninfer_core.artifact.format import (
    ArtifactError,
    TensorEntry,
    crc32,
    crc_hex,
    parse_header,
)
from ninfer_core.artifact.progress import ByteProgress

_VERIFY_CHUNK = 16 << 20


class Artifact:
    """An open .ninfer v3 file; tensors are memory-mapped views (read-only by convention).

    `open` checks the header, the manifest and the tensor offsets against the file size, but
    not the per-tensor CRCs: reading 50 GB on every start is too slow. `verify()` does that.
    """

    def __init__(self, path: str, header, handle):
        self.path = path
        self.manifest: dict = header.manifest
        self._data_start = header.data_start
        self._entries: dict[str, TensorEntry] = {e.name: e for e in header.entries}
        self._order = [e.name for e in header.entries]
        self._handle = handle

    @classmethod
    def open(cls, path) -> "Artifact":
        """Open and validate `path`; ArtifactError (truncated, corrupt, wrong version, not .ninfer)."""
        path = os.fspath(path)
        if not os.path.exists(path):
            raise ArtifactError(f"artifact {path} does not exist")
        if os.path.isdir(path):
            raise ArtifactError(f"artifact {path} is a directory, not a .ninfer file")
        header = parse_header(path)
        from safetensors import safe_open

        try:
            # framework "pt" maps the file (MAP_PRIVATE); get_tensor returns views into it.
            handle = safe_open(path, framework="pt")
        except Exception as e:  # the Rust binding raises its own SafetensorError
            raise ArtifactError(f"artifact {path} cannot be opened by safetensors: {e}") from None
        return cls(path, header, handle)

    # manifest views
    @property
    def name(self) -> str:
        return self.manifest.get("name") or ""

    @property
    def architecture(self) -> str:
        return self.manifest["architecture"]

    @property
    def config(self) -> dict:
        return self.manifest.get("config") or {}

    @property
    def tokenizer_section(self) -> dict:
        return self.manifest.get("tokenizer") or {}

    @property
    def chat_template(self) -> str | None:
        return self.manifest.get("chat_template")

    @property
    def components(self) -> list[str]:
        return list(self.manifest.get("components") or [])

    @property
    def generation(self) -> dict:
        return self.manifest.get("generation") or {}

    # tensors
    def tensor_names(self, component: str | None = None) -> list[str]:
        """Names in file order, optionally only those of one component."""
        if component is None:
            return list(self._order)
        table = self.manifest["tensors"]
        return [n for n in self._order if table[n].get("component") == component]

    def has_tensor(self, name) -> bool:
        return name in self._entries

    def _entry(self, name) -> TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise ArtifactError(f"artifact {self.path} has no tensor {name!r}") from None

    def tensor_dtype(self, name) -> torch.dtype:
        return self._entry(name).dtype.torch

    def tensor_shape(self, name) -> tuple[int, ...]:
        return self._entry(name).shape

    def tensor_nbytes(self, name) -> int:
        return self._entry(name).nbytes

    def tensor_encoding(self, name) -> str:
        """The manifest's encoding: a dtype name ("bf16") or a weight encoding ("int4-g64")."""
        return self.manifest["tensors"][name].get("encoding") or self._entry(name).dtype.encoding

    def tensor_info(self, name) -> dict:
        """The tensor's manifest entry (encoding, component, and for an encoded weight its logical
        `shape` and `scale` tensor)."""
        self._entry(name)
        return dict(self.manifest["tensors"][name])

    def logical_shape(self, name) -> tuple[int, ...]:
        """The shape a tensor has as a model parameter (an encoded weight's unpacked shape)."""
        shape = self.manifest["tensors"][name].get("shape")
        return tuple(shape) if shape else tuple(self._entry(name).shape)

    def tensor_component(self, name) -> str:
        self._entry(name)
        return self.manifest["tensors"][name].get("component", "text")

    def tensor_file_range(self, name) -> tuple[int, int]:
        """(absolute byte offset, byte length) of a tensor's data, for readers that bypass torch."""
        e = self._entry(name)
        return self._data_start + e.begin, e.nbytes

    def get_tensor(self, name) -> torch.Tensor:
        """The tensor as a memory-mapped CPU view; copy it before writing to it."""
        self._entry(name)
        if self._handle is None:
            raise ArtifactError(f"artifact {self.path} is closed")
        return self._handle.get_tensor(name)

    def get_slice(self, name):
        """A safetensors slice of a tensor (index it to read only part, e.g. some experts)."""
        self._entry(name)
        if self._handle is None:
            raise ArtifactError(f"artifact {self.path} is closed")
        return self._handle.get_slice(name)

    def num_parameters(self, component: str | None = None) -> int:
        """Model parameters: an encoded weight counts its unpacked elements, its scales none."""
        from math import prod

        table = self.manifest["tensors"]
        return sum(prod(self.logical_shape(n)) for n in self.tensor_names(component)
                   if not table[n].get("scale_of"))

    def verify(self, progress: bool = False) -> int:
        """Check every tensor's CRC32 against the manifest; returns the number checked.

        Raises ArtifactError naming the tensors whose data changed since the file was written.
        Reads the whole file once, sequentially.
        """
        table = self.manifest["tensors"]
        entries = [self._entries[n] for n in self._order]
        bad: list[str] = []
        unchecked = 0
        total = sum(e.nbytes for e in entries)
        with open(self.path, "rb") as f, ByteProgress(progress, "verifying", total, len(entries)) as bar:
            for e in entries:
                want = table[e.name].get("crc32")
                f.seek(self._data_start + e.begin)
                crc, left = 0, e.nbytes
                while left:
                    chunk = f.read(min(left, _VERIFY_CHUNK))
                    if not chunk:
                        raise ArtifactError(f"artifact {self.path} is truncated while reading {e.name!r}")
                    crc = crc32(chunk, crc)
                    left -= len(chunk)
                    bar.advance(len(chunk))
                bar.item_done()
                if want is None:
                    unchecked += 1
                elif crc_hex(crc) != want:
                    bad.append(e.name)
        if bad:
            shown = ", ".join(repr(n) for n in bad[:5])
            more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            raise ArtifactError(
                f"artifact {self.path} is corrupt: CRC32 mismatch in {len(bad)} tensor(s): {shown}{more}"
            )
        if unchecked:
            raise ArtifactError(f"artifact {self.path} has no CRC32 for {unchecked} tensor(s)")
        return len(entries)

    def close(self) -> None:
        """Drop the file mapping; tensors already returned keep their own reference to it."""
        self._handle = None

    def __enter__(self) -> "Artifact":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Artifact({self.path!r}, architecture={self.architecture!r}, tensors={len(self._order)})"
