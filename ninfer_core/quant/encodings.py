"""Weight encodings: groupwise int8 / int4 / q6, fp8 e4m3 (per row or per group), torch reference.

Every encoding is symmetric and scales groups of `group_size` consecutive input columns (the last
dimension of a `[..., out, in]` weight) by one scale, so a fused tensor of several projections is
the row-wise concatenation of their packed rows and scales, and an expert of a stacked `[E, out,
in]` tensor is its first-axis slice. Storage (`qdata`) per encoding:

    int8        int8  [..., out, in]          q in [-127, 127], w = q * scale
    int4        uint8 [..., out, in / 2]      two per byte: low nibble = even column, value q + 8
    q6          uint8 [..., out, in * 3 / 4]  four 6-bit values (q + 32) in three bytes, little-endian
    q4          the int4 layout (the name the spec's --lm-head-q4 / --embedding-q4 use)
    fp8_e4m3    float8_e4m3fn [..., out, in]  w = q * scale (scale = amax / 448)

scales: [..., out, in / group_size] in bf16 or f16 (fp8 per row: group_size = in). The manifest
names an encoding "<scheme>-g<group>" ("int4-g64", "fp8_e4m3-row"), see `encoding_name`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCHEMES = ("int8", "int4", "q6", "q4", "fp8_e4m3")
GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
_QMAX = {"int8": 127.0, "int4": 7.0, "q4": 7.0, "q6": 31.0, "fp8_e4m3": 448.0}
# input columns per stored element (int4: two per byte; q6: four per three bytes)
_COLS_PER_BYTE = {"int8": 1.0, "int4": 2.0, "q4": 2.0, "q6": 4.0 / 3.0, "fp8_e4m3": 1.0}
BITS = {"int8": 8, "int4": 4, "q4": 4, "q6": 6, "fp8_e4m3": 8}


class EncodingError(ValueError):
    """An encoding name or a weight shape the encoding cannot take."""


@dataclass(frozen=True)
class Encoding:
    scheme: str
    group_size: int | None  # None: one scale per row (fp8 "row")

    @property
    def name(self) -> str:
        return encoding_name(self.scheme, self.group_size)

    def group_for(self, in_features: int) -> int:
        return in_features if self.group_size is None else self.group_size

    def packed_cols(self, in_features: int) -> int:
        return int(in_features / _COLS_PER_BYTE[self.scheme])

    def check_shape(self, shape) -> None:
        k = int(shape[-1])
        g = self.group_for(k)
        if k % g:
            raise EncodingError(f"{self.name}: {k} input columns are not a multiple of the group size {g}")
        if self.scheme == "q6" and k % 4:
            raise EncodingError(f"q6: {k} input columns are not a multiple of 4")
        if self.scheme in ("int4", "q4") and k % 2:
            raise EncodingError(f"{self.scheme}: {k} input columns are odd")

    def bytes_per_weight(self, scale_bytes: int = 2) -> float:
        """Stored bytes per weight element, scales included (the read floor of a GEMV)."""
        g = self.group_size or 4096
        return BITS[self.scheme] / 8 + scale_bytes / g


def encoding_name(scheme: str, group_size: int | None) -> str:
    return f"{scheme}-row" if group_size is None else f"{scheme}-g{group_size}"


def parse_encoding(name: str) -> Encoding:
    """"int4-g64" -> Encoding("int4", 64); EncodingError for a name that is none of these."""
    scheme, _, group = str(name).rpartition("-")
    if scheme not in SCHEMES:
        raise EncodingError(f"unknown weight encoding {name!r} (schemes: {', '.join(SCHEMES)})")
    if group == "row":
        return Encoding(scheme, None)
    if not group.startswith("g") or not group[1:].isdigit() or int(group[1:]) <= 0:
        raise EncodingError(f"weight encoding {name!r}: the group part must be g<N> or row")
    return Encoding(scheme, int(group[1:]))


def is_quantized_encoding(name) -> bool:
    try:
        parse_encoding(name)
    except EncodingError:
        return False
    return True


def storage_dtype(scheme: str) -> torch.dtype:
    return {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}.get(scheme, torch.uint8)


@torch.no_grad()
def quantize(w: torch.Tensor, enc: Encoding, scale_dtype: torch.dtype = torch.bfloat16):
    """w [..., out, in] (any float dtype) -> (qdata, scale) in `enc`'s layout (see the module doc)."""
    enc.check_shape(w.shape)
    k = w.shape[-1]
    g = enc.group_for(k)
    wf = w.float().reshape(*w.shape[:-1], k // g, g)
    amax = wf.abs().amax(-1)
    scale = (amax / _QMAX[enc.scheme]).to(scale_dtype)
    scale = torch.where(scale.float() > 0, scale, torch.ones_like(scale))
    # quantise against the rounded scale the kernels will multiply by
    x = wf / scale.float()[..., None]
    if enc.scheme == "fp8_e4m3":
        q = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).reshape(w.shape)
        return q, scale
    qmax = _QMAX[enc.scheme]
    q = torch.round(x).clamp(-qmax - (1 if enc.scheme != "int8" else 0), qmax).to(torch.int32).reshape(w.shape)
    if enc.scheme == "int8":
        return q.to(torch.int8), scale
    if enc.scheme in ("int4", "q4"):
        u = (q + 8).to(torch.uint8)
        return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous(), scale
    u = (q + 32).reshape(*q.shape[:-1], k // 4, 4)  # q6
    bits = u[..., 0] | (u[..., 1] << 6) | (u[..., 2] << 12) | (u[..., 3] << 18)
    packed = torch.stack([bits & 0xFF, (bits >> 8) & 0xFF, (bits >> 16) & 0xFF], dim=-1)
    return packed.reshape(*q.shape[:-1], k * 3 // 4).to(torch.uint8).contiguous(), scale


def unpack(qdata: torch.Tensor, enc: Encoding, in_features: int) -> torch.Tensor:
    """The stored values as fp32 [..., out, in] before scaling."""
    if enc.scheme == "int8":
        return qdata.float()
    if enc.scheme == "fp8_e4m3":
        return qdata.float()
    if enc.scheme in ("int4", "q4"):
        lo = (qdata & 0xF).to(torch.int16) - 8
        hi = (qdata >> 4).to(torch.int16) - 8
        return torch.stack([lo, hi], dim=-1).reshape(*qdata.shape[:-1], in_features).float()
    b = qdata.to(torch.int32).reshape(*qdata.shape[:-1], in_features // 4, 3)
    bits = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    vals = torch.stack([(bits >> s) & 63 for s in (0, 6, 12, 18)], dim=-1) - 32
    return vals.reshape(*qdata.shape[:-1], in_features).float()


def dequantize(qdata: torch.Tensor, scale: torch.Tensor, enc: Encoding, in_features: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference: w [..., out, in] = unpacked values * their group's scale, cast to `dtype`."""
    v = unpack(qdata, enc, in_features)
    g = enc.group_for(in_features)
    w = v.reshape(*v.shape[:-1], in_features // g, g) * scale.float()[..., None]
    return w.reshape(v.shape).to(dtype)
