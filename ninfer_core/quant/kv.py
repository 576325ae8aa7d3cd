"""Built-in plugin: the quantised KV-cache storage formats `--kv-dtype int8 | fp8 | k8v4`.

Each K and V row of a token is stored per KV head with one fp32 scale (amax / qmax of that
head's `head_dim` values), in the paged layout the runners already use:

    data  [num_pages, page_size, kv_heads, head_dim]       int8 / float8_e4m3fn
          [num_pages, page_size, kv_heads, head_dim / 2]   uint8 (int4: two per byte, low = even)
    scale [num_pages, page_size, kv_heads]                 fp32

int8 = int8 K and V, fp8 = e4m3 K and V, k8v4 = int8 K and int4 V. A family's reference
attention writes through `KVFormat.encode` and reads pages through `KVFormat.decode`. The
spec's other names (rk8v4, rk4v4, rk4v4-e8, rk2v4-e8, nvfp4) are refused by `check_kv_dtype`
until they exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_core import hookimpl

PLANNED = ("rk8v4", "rk4v4", "rk4v4-e8", "rk2v4-e8", "nvfp4")
_QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}
SCALE_BYTES = 4


@dataclass(frozen=True)
class KVFormat:
    """A KV dtype: the storage kind of K and of V ("model" = the run dtype, unscaled)."""

    name: str
    k_kind: str
    v_kind: str

    @property
    def quantized(self) -> bool:
        return self.k_kind != "model" or self.v_kind != "model"

    @staticmethod
    def row_bytes(kind: str, head_dim: int, model_elem: int) -> int:
        """Bytes of one token's row of one KV head, scale included."""
        if kind == "model":
            return head_dim * model_elem
        return (head_dim // 2 if kind == "int4" else head_dim) + SCALE_BYTES

    def bytes_per_token(self, layers: int, kv_heads: int, head_dim: int, model_elem: int) -> int:
        return layers * kv_heads * (self.row_bytes(self.k_kind, head_dim, model_elem)
                                    + self.row_bytes(self.v_kind, head_dim, model_elem))

    # -- storage -------------------------------------------------------------------------------
    def allocate(self, kind: str, num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype, device):
        """(data, scale or None) zeroed pages of one side (K or V) of one layer."""
        import torch

        if kind == "model":
            return torch.zeros((num_pages, page_size, kv_heads, head_dim), dtype=dtype, device=device), None
        cols = head_dim // 2 if kind == "int4" else head_dim
        store = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}[kind]
        data = torch.zeros((num_pages, page_size, kv_heads, cols), dtype=store, device=device)
        return data, torch.ones((num_pages, page_size, kv_heads), dtype=torch.float32, device=device)

    @staticmethod
    def encode(kind: str, x):
        """x [..., kv_heads, head_dim] -> (data, scale [..., kv_heads]) in `kind`'s layout."""
        import torch

        xf = x.float()
        amax = xf.abs().amax(-1)
        # a tensor divisor, not a Python number: on CUDA torch divides by a scalar as a multiply by
        # its reciprocal (off by an ulp at times), and the fused write (kv_attention) divides exactly
        scale = torch.where(amax > 0, amax / torch.full_like(amax, _QMAX[kind]), torch.ones_like(amax))
        y = xf / scale[..., None]
        if kind == "fp8":
            return y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale
        if kind == "int8":
            return torch.round(y).clamp(-127, 127).to(torch.int8), scale
        u = (torch.round(y).clamp(-8, 7).to(torch.int16) + 8).to(torch.uint8)
        return (u[..., 0::2] | (u[..., 1::2] << 4)), scale

    @staticmethod
    def decode(kind: str, data, scale, dtype):
        """The dequantised rows [..., kv_heads, head_dim] in `dtype`."""
        import torch

        if kind == "int4":
            lo = (data & 0xF).to(torch.int16) - 8
            hi = (data >> 4).to(torch.int16) - 8
            v = torch.stack([lo, hi], dim=-1).reshape(*data.shape[:-1], data.shape[-1] * 2).float()
        else:
            v = data.float()
        return (v * scale[..., None]).to(dtype)


BF16 = KVFormat("bf16", "model", "model")  # the run dtype's pages (bf16 on CUDA), as kv_bf16 stores them
INT8 = KVFormat("int8", "int8", "int8")
FP8 = KVFormat("fp8", "fp8", "fp8")
K8V4 = KVFormat("k8v4", "int8", "int4")


def check_kv_dtype(name: str, available) -> None:
    """ValueError with the spec's planned names refused clearly (the registry names the rest)."""
    if name in PLANNED and name not in available:
        raise ValueError(f"--kv-dtype {name} is not built yet; available: {', '.join(sorted(available))}")


def kv_format(obj) -> KVFormat:
    """The KVFormat of a resolved `--kv-dtype` target (a KVFormat, the built-in bf16 KVDtype, a
    name, or None for bf16)."""
    if isinstance(obj, KVFormat):
        return obj
    name = getattr(obj, "name", obj) or "bf16"
    known = {f.name: f for f in (BF16, INT8, FP8, K8V4)}
    if name not in known:
        raise ValueError(f"--kv-dtype {name}: this model family stores {', '.join(known)}")
    return known[name]


@hookimpl
def ninfer_register_kv_dtypes(register):
    register("int8", "ninfer_core.quant.kv:INT8")
    register("fp8", "ninfer_core.quant.kv:FP8")
    register("k8v4", "ninfer_core.quant.kv:K8V4")


class DequantPages:
    """A quantised page tensor read as the run dtype: `pages[idx]` gathers the pages (first axis)
    and dequantises them, so a reference attention indexes it like a float cache."""

    def __init__(self, kind: str, data, scale, dtype):
        self.kind, self.data, self.scale, self.dtype = kind, data, scale, dtype
        cols = data.shape[-1] * (2 if kind == "int4" else 1)
        self.shape = (*data.shape[:-1], cols)

    def __getitem__(self, idx):
        return KVFormat.decode(self.kind, self.data[idx], self.scale[idx], self.dtype)


def page_views(fmt: KVFormat, k, v, k_scale, v_scale, dtype):
    """(K, V) as attention reads them: the tensors themselves for "model" storage, else DequantPages."""
    kk = k if k_scale is None else DequantPages(fmt.k_kind, k, k_scale, dtype)
    vv = v if v_scale is None else DequantPages(fmt.v_kind, v, v_scale, dtype)
    return kk, vv


def write_rows(fmt: KVFormat, k_cache, v_cache, k_scale, v_scale, page_t, row_t, k, v, fused: bool = True) -> None:
    """Store new tokens' K, V [N, kv_heads, head_dim] at (page, row) in the layer's format (on CUDA
    or under the interpreter by one Triton launch, `kv_attention.fused_write_rows`, same bits)."""
    import torch

    if fused and fmt.quantized and k.shape == v.shape:
        from ninfer_core.quant import kv_attention as KA

        if KA.fused_write_supported(k, k_cache) and v.stride(-1) == 1 and k.device == k_cache.device:
            KA.fused_write_rows(fmt, k_cache, v_cache, k_scale, v_scale, page_t, row_t, k, v)
            return

    for kind, cache, scale, x in ((fmt.k_kind, k_cache, k_scale, k), (fmt.v_kind, v_cache, v_scale, v)):
        if scale is None:
            cache[page_t, row_t] = x.to(cache.dtype)
        else:
            data, s = KVFormat.encode(kind, x)
            if data.dtype == torch.float8_e4m3fn:  # write the bytes: index_put has no fp8 kernel everywhere
                cache, data = cache.view(torch.uint8), data.view(torch.uint8)
            cache[page_t, row_t] = data
            scale[page_t, row_t] = s
