"""Device helpers every model family's GPU path shares: the run dtype a load asks for, and whether
Triton kernels run on a tensor (CUDA, or the CPU under TRITON_INTERPRET=1, which is how CI tests
the kernels). Imported by family plugins only; core's own code never needs torch kernels."""

from __future__ import annotations

import os

import torch

try:  # triton is optional: every family keeps a torch reference path
    import triton  # noqa: F401

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAVE_TRITON = False

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "f32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
}  # fmt: skip


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """None or "auto" -> float32 on the CPU, bfloat16 on CUDA; accepts torch dtypes and common names."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r} (float32, bfloat16, float16)") from None


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run on `t`: on CUDA, or anywhere under TRITON_INTERPRET=1."""
    if not HAVE_TRITON:
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
