"""Weight encodings as transforms: which tensors `ninfer convert --quantize` encodes, the packed
and scale tensor specs it writes, and the load-time side that swaps a built model's weights for
`QuantizedWeight`s (from an encoded artifact, or quantised while loading: --lm-head-q4|q6,
--embedding-q4|q6).

Manifest entry of an encoded weight `W`: {"encoding": "int4-g64", "shape": [out, in] (the
logical shape), "scale": "W.qscale", ...}; the scale tensor's entry is {"encoding": "bf16",
"scale_of": "W"}. Names stay the checkpoint's, so a family's loader finds every weight where it
expects it.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ninfer_core.quant.encodings import (
    SCALE_DTYPES,
    Encoding,
    EncodingError,
    parse_encoding,
    quantize,
    storage_dtype,
)
from ninfer_core.quant.weight import QuantizedWeight

SCALE_SUFFIX = ".qscale"
CONVERT_SCHEMES = {"int8": "int8", "int4": "int4", "fp8": "fp8_e4m3"}
LOAD_SCHEMES = {"q4": "q4", "q6": "q6"}  # --lm-head-q4|q6, --embedding-q4|q6
LOAD_GROUP = 32
# projection weights: dense `*_proj.weight` and fused MoE experts (`experts.gate_up_proj`); never
# embeddings, heads, norms, convolutions, routers or the vision tower / MTP components by default
_PROJ = re.compile(r"(_proj(\.weight)?|\.experts\.(gate_up_proj|down_proj))$")
_KEEP = ("embed", "lm_head", "norm", "conv1d", "visual", "mtp")


def convert_encoding(quantize_name: str, group_size: int | None) -> Encoding:
    """`--quantize int8|int4|fp8 [--group-size N]` -> the Encoding (fp8 without a group: per row)."""
    scheme = CONVERT_SCHEMES.get(quantize_name)
    if scheme is None:
        raise EncodingError(f"--quantize {quantize_name!r}: choose one of {', '.join(CONVERT_SCHEMES)}")
    if group_size is None:
        group_size = None if scheme == "fp8_e4m3" else 128
    return Encoding(scheme, group_size)


def should_encode(name: str, shape, component: str, enc: Encoding) -> bool:
    if component != "text" or len(shape) not in (2, 3) or not _PROJ.search(name):
        return False
    if any(k in name for k in _KEEP):
        return False
    try:
        enc.check_shape(shape)
    except EncodingError:
        return False  # a width the group does not divide stays in its float encoding
    return True


def encoded_specs(specs: list, table: dict, enc: Encoding, scale_dtype: str = "bf16") -> list:
    """TensorSpecs with every chosen projection replaced by its packed tensor plus a scale tensor
    (loaded lazily, one weight at a time); fills the manifest `table` entries for them."""
    from ninfer_core.artifact.format import component_of
    from ninfer_core.artifact.writer import TensorSpec

    sdt = SCALE_DTYPES[scale_dtype]
    out = []
    for s in specs:
        comp = (table.get(s.name) or {}).get("component") or component_of(s.name)
        if not s.dtype.is_floating_point or not should_encode(s.name, s.shape, comp, enc):
            out.append(s)
            continue
        k = s.shape[-1]
        cache: dict = {}

        def take(part, load=s.load, cache=cache):
            if not cache:  # one quantisation serves both tensors, whichever the writer asks first
                cache["q"], cache["s"] = quantize(load(), enc, sdt)
            return cache.pop(part)

        def load_q(take=take):
            return take("q")

        def load_s(take=take):
            return take("s")

        sname = s.name + SCALE_SUFFIX
        qshape = (*s.shape[:-1], enc.packed_cols(k))
        out.append(TensorSpec(s.name, storage_dtype(enc.scheme), qshape, load_q))
        out.append(TensorSpec(sname, sdt, (*s.shape[:-1], k // enc.group_for(k)), load_s))
        table[s.name] = {**(table.get(s.name) or {}), "component": comp, "encoding": enc.name,
                         "shape": list(s.shape), "scale": sname}
        table[sname] = {"component": comp, "scale_of": s.name}
    return out


def is_encoded(artifact, name: str) -> bool:
    info = artifact.manifest["tensors"].get(name) or {}
    return bool(info.get("scale"))


def encoded_weight(artifact, name: str, dtype: torch.dtype, device) -> QuantizedWeight:
    """The artifact's encoded weight `name` on `device`, computing in `dtype`."""
    info = artifact.manifest["tensors"][name]
    enc = parse_encoding(info["encoding"])
    shape = tuple(info["shape"])
    q = artifact.get_tensor(name).to(device)
    s = artifact.get_tensor(info["scale"]).to(device)
    return QuantizedWeight(q, s, enc, shape[-1], dtype)


def split_encoded(artifact, state: dict, rename=lambda n: n) -> dict:
    """Pop encoded weights (and their scales) out of a loader's `state` {param name: tensor}.

    `rename(artifact_name) -> param name` maps names as the loader did. Returns {param name:
    artifact name} for `assign_encoded`."""
    # an in-memory source without a tensor table (the bench's random artifacts) holds no encodings
    table = (getattr(artifact, "manifest", None) or {}).get("tensors") or {}
    found = {}
    for art_name, info in table.items():
        if info.get("scale_of"):
            state.pop(rename(art_name), None)
        elif info.get("scale"):
            key = rename(art_name)
            if key in state:
                state.pop(key)
                found[key] = art_name
    return found


def set_weight(module: nn.Module, name: str, value) -> None:
    """Put `value` (a QuantizedWeight) where the parameter `name` of `module` was."""
    owner, _, leaf = name.rpartition(".")
    mod = module.get_submodule(owner) if owner else module
    mod._parameters.pop(leaf, None)
    setattr(mod, leaf, value)


def assign_encoded(module: nn.Module, artifact, found: dict, dtype, device) -> int:
    """Set every weight of `found` ({param name: artifact name}) on `module`; returns the bytes."""
    total = 0
    for key, art_name in found.items():
        w = encoded_weight(artifact, art_name, dtype, device)
        expected = _param_shape(module, key)
        if expected is not None and tuple(expected) != tuple(w.shape):
            raise ValueError(f"{art_name}: encoded shape {tuple(w.shape)}, the model expects {tuple(expected)}")
        set_weight(module, key, w)
        total += w.nbytes
    return total


def _param_shape(module: nn.Module, name: str):
    owner, _, leaf = name.rpartition(".")
    mod = module.get_submodule(owner) if owner else module
    p = mod._parameters.get(leaf)
    return None if p is None else p.shape


def quantize_loaded(module: nn.Module, name: str, scheme: str, scale_dtype=torch.bfloat16) -> QuantizedWeight:
    """Encode a loaded float weight in place (the load-time --lm-head-q*/--embedding-q* options)."""
    owner, _, leaf = name.rpartition(".")
    mod = module.get_submodule(owner) if owner else module
    w = getattr(mod, leaf)
    if isinstance(w, QuantizedWeight):
        return w
    enc = Encoding(LOAD_SCHEMES[scheme], LOAD_GROUP)
    qw = QuantizedWeight.from_float(w.detach(), enc, scale_dtype, dtype=w.dtype)
    set_weight(module, name, qw)
    return qw


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's weights: parameters plus encoded weights (packed + scales)."""
    seen, total = set(), 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    for m in module.modules():
        for v in vars(m).values():
            if isinstance(v, QuantizedWeight) and id(v) not in seen:
                seen.add(id(v))
                total += v.nbytes
    return total


def encoded_params(module: nn.Module) -> int:
    """Elements of the encoded weights of `module` (a runner's parameter count adds them)."""
    seen, total = set(), 0
    for m in module.modules():
        for v in vars(m).values():
            if isinstance(v, QuantizedWeight) and id(v) not in seen:
                seen.add(id(v))
                total += v.numel()
    return total


def is_encoded_or_scale(artifact, name: str) -> bool:
    info = (getattr(artifact, "manifest", None) or {}).get("tensors", {}).get(name) or {}
    return bool(info.get("scale") or info.get("scale_of"))


def load_encodings(options) -> dict:
    """{"lm_head": "q4"|"q6", "embedding": ...} from the serve options namespace (absent: off)."""
    out = {}
    for part in ("lm_head", "embedding"):
        v = getattr(options, f"{part}_q", None) if options is not None else None
        if v:
            if v not in LOAD_SCHEMES:
                raise EncodingError(f"--{part.replace('_', '-')}-{v}: choose q4 or q6")
            out[part] = v
    return out


def apply_load_encodings(model: nn.Module, options, head: str = "lm_head.weight",
                         embedding: str = "embed_tokens.weight") -> None:
    """Quantise the output head and/or token embedding while loading (--lm-head-q4|q6,
    --embedding-q4|q6). A tied head keeps reading the float embedding unless it is encoded itself."""
    want = load_encodings(options)
    if "embedding" in want:  # a tied head keeps its own reference to the float tensor
        quantize_loaded(model, embedding, want["embedding"])
    if "lm_head" in want:
        quantize_loaded(model, head, want["lm_head"])


def quantize_model(model: nn.Module, enc: Encoding, scale_dtype=torch.bfloat16) -> int:
    """Encode a built model's projection weights in place (`ninfer bench --quantize`: random weights
    drawn on the device, so there is no artifact to convert); returns how many were encoded."""
    n = 0
    for name, p in list(model.named_parameters()):
        if should_encode(name, tuple(p.shape), "text", enc):
            set_weight(model, name, QuantizedWeight.from_float(p.detach(), enc, scale_dtype, dtype=p.dtype))
            n += 1
    return n


def named_weights(model: nn.Module):
    """(name, weight) of every parameter and encoded weight, each object once."""
    seen = set()
    for mname, m in model.named_modules():
        items = list(m._parameters.items()) + [(k, v) for k, v in vars(m).items() if isinstance(v, QuantizedWeight)]
        for k, v in items:
            if v is None or id(v) in seen:
                continue
            seen.add(id(v))
            yield (f"{mname}.{k}" if mname else k), v


def stored_bytes(w) -> int:
    return w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()
