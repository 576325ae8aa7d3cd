"""Weights a resume reads back from the artifact (spec "Model suspend", --suspend-weights artifact).

A suspended model's weights are not copied to host memory: their device storages are shrunk like
the rest, and a resume fills them again from the artifact, whose file the server keeps open
(memory-mapped through safetensors). What makes this work for any model family without its
help is that the loader's transformations of a weight are, in every family here, a cast, a move
to the device and a concatenation along the first dimension (fused QKV or gate/up projections,
stacked experts), so each weight storage is a run of artifact tensors, each cast to the storage's
element type. `locate` finds that run once per storage and proves it byte for byte: it reads a
short fingerprint of the storage at each offset, looks up the artifact tensors that start with
it, and copies the candidate in through the very path a resume uses and compares the bytes. A
storage that is not exactly such a run (a transposed, quantised or computed weight, a rotary
table) has no sources and goes to the host snapshot as before. Weights are never written after
the load, so what was proven once holds for every later suspend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("ninfer")

FINGERPRINT = 16  # leading elements that key an artifact tensor
CHUNK_ELEMENTS = 1 << 24  # a copy or comparison at a time: bounds the scratch memory to 64 MiB of fp32
MAX_TRIES = 8  # candidates verified at one offset before the storage is given up


@dataclass(frozen=True)
class Segment:
    name: str  # the artifact tensor
    offset: int  # its first element in the storage's flat typed view
    numel: int


def _key(t: Any) -> bytes:
    """The bytes of a few elements. Read through a copy: handing a tensor's own memory to numpy
    would mark its storage not resizable, and a suspend shrinks every storage."""
    import torch

    return t.reshape(-1).to("cpu", copy=True).view(torch.uint8).numpy().tobytes()


class ArtifactWeights:
    """An open artifact as the source of a model's weights."""

    def __init__(self, artifact: Any):
        self.artifact = artifact
        self._index: dict[Any, dict[tuple[int, bytes], list[str]]] = {}  # dtype -> fingerprint -> names

    @staticmethod
    def usable(artifact: Any) -> bool:
        """A real .ninfer file (a random-weights stand-in has nothing to read back)."""
        return artifact is not None and bool(getattr(artifact, "path", None)) and \
            callable(getattr(artifact, "get_tensor", None)) and callable(getattr(artifact, "tensor_names", None))

    def _fingerprints(self, dtype: Any) -> dict[tuple[int, bytes], list[str]]:
        import torch

        index = self._index.get(dtype)
        if index is None:
            index = self._index[dtype] = {}
            for name in self.artifact.tensor_names():
                src = self.artifact.get_tensor(name).reshape(-1)
                n = min(FINGERPRINT, src.numel())
                if n == 0:
                    continue
                head = torch.empty(n, dtype=dtype).copy_(src[:n])
                index.setdefault((n, _key(head)), []).append(name)
        return index

    def locate(self, storage: Any, dtype: Any) -> list[Segment]:
        """The artifact tensors the storage is made of, in order, or [] when it is not such a run."""
        from ninfer_core.router.storages import typed_view

        if dtype is None or dtype.is_complex or storage.nbytes() % dtype.itemsize:
            return []
        flat = typed_view(storage, dtype)
        index = self._fingerprints(dtype)
        lengths = sorted({n for n, _ in index}, reverse=True)
        segments: list[Segment] = []
        off, total = 0, flat.numel()
        while off < total:
            found = None
            tries = 0
            for n in lengths:
                if off + n > total:
                    continue
                for name in index.get((n, _key(flat[off:off + n])), ()):
                    numel = self.artifact.get_tensor(name).numel()
                    if off + numel > total:
                        continue
                    tries += 1
                    if self._same(flat, off, name):
                        found = Segment(name, off, numel)
                        break
                    if tries >= MAX_TRIES:
                        return []
                if found is not None:
                    break
            if found is None:
                return []
            segments.append(found)
            off += found.numel
        return segments

    def _same(self, flat: Any, off: int, name: str) -> bool:
        import torch

        src = self.artifact.get_tensor(name).reshape(-1)
        for a in range(0, src.numel(), CHUNK_ELEMENTS):
            b = min(src.numel(), a + CHUNK_ELEMENTS)
            have = flat[off + a: off + b]
            again = torch.empty(b - a, dtype=flat.dtype, device=flat.device)
            again.copy_(src[a:b])  # the cast and upload a resume does
            if not torch.equal(again.view(torch.uint8), have.view(torch.uint8)):
                return False
        return True

    def reload(self, storage: Any, dtype: Any, segments: list[Segment]) -> int:
        """Fill a (regrown) storage from its segments; returns the artifact bytes read."""
        from ninfer_core.router.storages import typed_view

        flat = typed_view(storage, dtype)
        read = 0
        for seg in segments:
            src = self.artifact.get_tensor(seg.name).reshape(-1)
            for a in range(0, seg.numel, CHUNK_ELEMENTS):
                b = min(seg.numel, a + CHUNK_ELEMENTS)
                flat[seg.offset + a: seg.offset + b].copy_(src[a:b])
            read += self.artifact.tensor_nbytes(seg.name)
        return read
