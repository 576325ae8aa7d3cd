"""The .ninfer v3 layout: constants, dtype/encoding tables, component rules and header parsing.

A .ninfer file is a safetensors file: an 8-byte little-endian header length, a JSON header
(tensor entries plus `__metadata__`, whose "ninfer.manifest" value is the manifest as a JSON
string), then the tensor data. The header is parsed here by hand rather than only through
`safetensors.safe_open` so that every way a file can be broken gets a message naming the file
and what is wrong with it; the safetensors library still opens the tensors.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from dataclasses import dataclass

import torch

FORMAT_VERSION = 3
MANIFEST_KEY = "ninfer.manifest"
# CRC32 of the whole header (length prefix excluded) with these 8 hex digits read as "00000000":
# any flipped header byte is refused on open, not only those that break the JSON.
HEADER_CRC_KEY = "ninfer.header_crc32"
# safetensors refuses headers above 100 MB; a 250k-token BPE tokenizer section is ~5 MB.
MAX_HEADER_BYTES = 100_000_000
HEADER_ALIGN = 8
COMPONENT_ORDER = ("text", "mtp", "dflash", "dflash2", "vision")


class ArtifactError(Exception):
    """A .ninfer file that cannot be used; the message is meant for the user (the CLI exits 1)."""


@dataclass(frozen=True)
class DType:
    torch: torch.dtype
    safetensors: str  # the dtype string in the safetensors header
    encoding: str  # the manifest's per-tensor encoding name


_DTYPES = [
    DType(torch.bfloat16, "BF16", "bf16"),
    DType(torch.float16, "F16", "f16"),
    DType(torch.float32, "F32", "f32"),
    DType(torch.float64, "F64", "f64"),
    DType(torch.int8, "I8", "i8"),
    DType(torch.int16, "I16", "i16"),
    DType(torch.int32, "I32", "i32"),
    DType(torch.int64, "I64", "i64"),
    DType(torch.uint8, "U8", "u8"),
    DType(torch.bool, "BOOL", "bool"),
]
for _name, _st, _enc in (
    ("uint16", "U16", "u16"),
    ("uint32", "U32", "u32"),
    ("uint64", "U64", "u64"),
    ("float8_e4m3fn", "F8_E4M3", "f8_e4m3"),
    ("float8_e5m2", "F8_E5M2", "f8_e5m2"),
):
    if hasattr(torch, _name):
        _DTYPES.append(DType(getattr(torch, _name), _st, _enc))

BY_TORCH = {d.torch: d for d in _DTYPES}
BY_SAFETENSORS = {d.safetensors: d for d in _DTYPES}


def dtype_info(dtype: torch.dtype) -> DType:
    """The table row of a torch dtype; ArtifactError for dtypes the format cannot store."""
    try:
        return BY_TORCH[dtype]
    except KeyError:
        raise ArtifactError(f"dtype {dtype} cannot be stored in a .ninfer artifact") from None


def itemsize(d: DType) -> int:
    return torch.empty((), dtype=d.torch).element_size()


def component_of(name: str) -> str:
    """The component a Hugging Face tensor name belongs to (`mtp.*`; vision: `model.visual.*`/`visual.*`,
    `model.vision_tower.*`/`model.embed_vision.*`; audio: `model.audio_tower.*`/`model.embed_audio.*`),
    by the prefixes Hugging Face checkpoints use for these towers."""
    if name.startswith(("mtp.", "mtp_proposal.")):
        return "mtp"
    if name.startswith(("dflash.", "dflash2.")):  # drafter companions (ninfer_core.artifact.drafters)
        return name.split(".", 1)[0]
    if name.startswith(("model.visual.", "visual.", "model.vision_tower.", "model.embed_vision.")):
        return "vision"
    if name.startswith(("model.audio_tower.", "model.embed_audio.")):
        return "audio"
    return "text"


def ordered_components(names) -> list[str]:
    """Component names in the canonical order, unknown ones after, sorted."""
    present = set(names)
    known = [c for c in COMPONENT_ORDER if c in present]
    return known + sorted(present - set(COMPONENT_ORDER))


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header places it; `begin`/`end` are relative to the data section."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ParsedHeader:
    header_len: int  # bytes of header JSON (padding included)
    data_start: int  # absolute offset of the first data byte (8 + header_len)
    metadata: dict[str, str]
    entries: list[TensorEntry]  # in data order
    manifest: dict


def parse_header(path: str) -> ParsedHeader:
    """Read and check a .ninfer header; ArtifactError says which check failed and why."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ArtifactError(
                    f"{path} is not a safetensors file: {size} bytes is too short for a header"
                )
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise ArtifactError(
                    f"{path} is not a safetensors file or is truncated: the header length field says "
                    f"{n} bytes of header, the file has {size - 8} bytes after it"
                )
            raw = f.read(n)
    except OSError as e:
        raise ArtifactError(f"cannot read artifact {path}: {e.strerror or e}") from None
    if not raw.startswith(b"{"):
        raise ArtifactError(f"{path} is not a safetensors file: the header does not start with '{{'")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"artifact {path} has a corrupt header: {e}") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"artifact {path} has a corrupt header: not a JSON object")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or MANIFEST_KEY not in metadata:
        raise ArtifactError(
            f"{path} is not a .ninfer artifact (its safetensors metadata has no {MANIFEST_KEY!r}); "
            "build one with `ninfer convert HF_DIR OUT`"
        )
    manifest = _parse_manifest(path, metadata)
    _check_header_crc(path, raw, metadata)
    entries = _parse_entries(path, header)
    _check_offsets(path, entries, data_len=size - 8 - n)
    _check_manifest_tensors(path, manifest, entries)
    return ParsedHeader(n, 8 + n, metadata, entries, manifest)


def _parse_manifest(path: str, metadata: dict) -> dict:
    text = metadata[MANIFEST_KEY]
    if not isinstance(text, str):
        raise ArtifactError(f"artifact {path} has a corrupt manifest: {MANIFEST_KEY} is not a string")
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as e:
        raise ArtifactError(f"artifact {path} has a corrupt manifest: {e}") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"artifact {path} has a corrupt manifest: not a JSON object")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"artifact {path}: format version {version} is not supported; this build reads version "
            f"{FORMAT_VERSION}, reconvert with ninfer convert"
        )
    if not isinstance(manifest.get("architecture"), str) or not manifest["architecture"]:
        raise ArtifactError(f"artifact {path} has a corrupt manifest: no architecture")
    if not isinstance(manifest.get("tensors"), dict):
        raise ArtifactError(f"artifact {path} has a corrupt manifest: no tensors table")
    return manifest


def header_crc_field(value: str) -> bytes:
    """The bytes the header CRC is stored as in the serialised header (compact JSON)."""
    return b'"' + HEADER_CRC_KEY.encode() + b'":"' + value.encode("ascii", "replace") + b'"'


def _check_header_crc(path: str, raw: bytes, metadata: dict) -> None:
    want = metadata.get(HEADER_CRC_KEY)
    field = header_crc_field(want) if isinstance(want, str) else b""
    if not field or raw.count(field) != 1:
        raise ArtifactError(
            f"artifact {path} has a corrupt header: its checksum ({HEADER_CRC_KEY}) is missing"
        )
    got = crc_hex(crc32(raw.replace(field, header_crc_field(CRC_PLACEHOLDER))))
    if got != want:
        raise ArtifactError(
            f"artifact {path} has a corrupt header: CRC32 is {got}, the header says {want} "
            "(the file was modified or damaged after it was written)"
        )


def _parse_entries(path: str, header: dict) -> list[TensorEntry]:
    entries = []
    for name, e in header.items():
        bad = f"artifact {path} has a corrupt header: tensor {name!r}"
        if not isinstance(e, dict):
            raise ArtifactError(f"{bad} is not an object")
        d = BY_SAFETENSORS.get(e.get("dtype"))
        if d is None:
            raise ArtifactError(f"{bad} has unknown dtype {e.get('dtype')!r}")
        shape, offs = e.get("shape"), e.get("data_offsets")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ArtifactError(f"{bad} has an invalid shape {shape!r}")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and o >= 0 for o in offs)
            or offs[0] > offs[1]
        ):
            raise ArtifactError(f"{bad} has invalid data_offsets {offs!r}")
        entry = TensorEntry(name, d, tuple(shape), offs[0], offs[1])
        if entry.nbytes != entry.numel * itemsize(d):
            raise ArtifactError(
                f"{bad}: its offsets span {entry.nbytes} bytes but {d.safetensors}{list(shape)} "
                f"needs {entry.numel * itemsize(d)}"
            )
        entries.append(entry)
    entries.sort(key=lambda x: (x.begin, x.end))
    return entries


def _check_offsets(path: str, entries: list[TensorEntry], data_len: int) -> None:
    pos = 0
    for e in entries:
        if e.begin != pos:
            what = "overlaps the previous tensor" if e.begin < pos else "leaves a gap before it"
            raise ArtifactError(
                f"artifact {path} has inconsistent tensor offsets: {e.name!r} starts at {e.begin}, "
                f"expected {pos} ({what})"
            )
        pos = e.end
    if pos > data_len:
        raise ArtifactError(
            f"artifact {path} is truncated: header says {pos} bytes of tensor data, file has {data_len}"
        )
    if pos < data_len:
        raise ArtifactError(
            f"artifact {path} is corrupt: header says {pos} bytes of tensor data, file has {data_len} "
            f"({data_len - pos} unexpected bytes at the end)"
        )


def _check_manifest_tensors(path: str, manifest: dict, entries: list[TensorEntry]) -> None:
    table = manifest["tensors"]
    names = {e.name for e in entries}
    missing = [n for n in table if n not in names]
    extra = [e.name for e in entries if e.name not in table]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"manifest lists {len(missing)} tensor(s) the file lacks (e.g. {missing[0]!r})")
        if extra:
            parts.append(f"file has {len(extra)} tensor(s) the manifest lacks (e.g. {extra[0]!r})")
        raise ArtifactError(f"artifact {path} is inconsistent: " + "; ".join(parts))
    for e in entries:
        info = table[e.name]
        if not isinstance(info, dict) or info.get("encoding") != e.dtype.encoding:
            got = info.get("encoding") if isinstance(info, dict) else info
            raise ArtifactError(
                f"artifact {path} is inconsistent: tensor {e.name!r} is {e.dtype.safetensors} "
                f"but the manifest says encoding {got!r}"
            )


def crc32(data, value: int = 0) -> int:
    """zlib CRC32 (running when `value` is a previous result)."""
    return zlib.crc32(data, value) & 0xFFFFFFFF


CRC_PLACEHOLDER = "0" * 8


def crc_hex(value: int) -> str:
    """CRCs are stored as 8 hex digits so the header keeps its length when they are filled in."""
    return f"{value:08x}"
