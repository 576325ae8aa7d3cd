"""Built-in plugin: the bf16 KV-cache storage format (`--kv-dtype bf16`)."""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_core import hookimpl


@dataclass(frozen=True)
class KVDtype:
    """How KV pages are stored: element type name and bytes per element."""

    name: str
    torch_dtype: str  # attribute of torch, e.g. "bfloat16"
    bytes_per_element: float


BF16 = KVDtype("bf16", "bfloat16", 2)


@hookimpl
def ninfer_register_kv_dtypes(register):
    register("bf16", "ninfer_core.engine.kv_bf16:BF16")
