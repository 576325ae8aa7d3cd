"""The device storages a model owns, found by walking its runner's objects (model suspend).

A suspend shrinks every storage to zero bytes and a resume grows it back, so tensors and their
views keep their storage objects (residency.py). This module finds those storages: every tensor
reachable from the runner (and the speculative backend) through modules, containers and ninfer or
plugin objects, deduplicated by storage, with whether it holds weights (parameters and buffers),
its element type, and, for the KV cache, the tensors whose first dimension is the page id (the
runner's `kv_page_tensors`), so a suspend can copy only the pages in use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Held:
    storage: Any  # torch.UntypedStorage, shrunk to 0 bytes while suspended
    nbytes: int
    weight: bool
    dtype: Any = None  # the element type of a tensor over it (a weight's, for artifact reloads)
    # KV pages: the tensor over the whole storage, page id on dim 0 (only live pages are copied)
    paged: Any = None
    snapshot: Any = None  # host copy while suspended: uint8 bytes, or the live pages' rows
    live: Any = None  # page ids the snapshot of a paged storage holds (a tensor), or None
    segments: list = field(default_factory=list)  # artifact sources of a weight (weights.py)

    @property
    def from_artifact(self) -> bool:
        return bool(self.segments)


def walk_roots(roots: list[Any]) -> list[tuple[Any, bool]]:
    """(tensor, is_weight) for every tensor reachable from `roots` through modules, containers and
    ninfer/plugin objects. Only objects of classes defined outside the standard library and torch's
    own internals are entered, so the walk stays inside the model and never reaches the process."""
    import torch
    from torch import nn

    out: list[tuple[Any, bool]] = []
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(r, False) for r in roots if r is not None]
    while stack:
        obj, weight = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append((obj, weight or isinstance(obj, nn.Parameter)))
        elif isinstance(obj, nn.Module):
            stack.extend((p, True) for p in obj._parameters.values() if p is not None)
            stack.extend((b, True) for b in obj._buffers.values() if b is not None)
            stack.extend((m, weight) for m in obj._modules.values() if m is not None)
            stack.extend((v, weight) for k, v in vars(obj).items()
                         if k not in ("_parameters", "_buffers", "_modules") and not k.startswith("_forward"))
        elif isinstance(obj, dict):
            stack.extend((v, weight) for v in obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((v, weight) for v in obj)
        elif _model_object(obj):
            try:
                stack.extend((v, weight) for v in vars(obj).values())
            except TypeError:
                pass
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    stack.append((getattr(obj, name), weight))
    return out


def _model_object(obj: Any) -> bool:
    mod = getattr(type(obj), "__module__", "") or ""
    return mod.startswith(("ninfer", "plugins.")) and not isinstance(obj, type) and \
        not callable(getattr(obj, "__func__", None))


def _page_tensors(runner: Any, pages: int) -> dict[int, Any]:
    """storage key -> the runner's KV page tensor over exactly that storage. A listed tensor that is
    not one row per page of the pool (a per-layer scale, say) is copied whole like any other."""
    get = getattr(runner, "kv_page_tensors", None)
    tensors = get() if callable(get) else ()
    out = {}
    for t in tensors or ():
        st = t.untyped_storage()
        if t.dim() >= 1 and t.shape[0] >= pages > 0 and t.is_contiguous() and t.storage_offset() == 0 and \
                st.nbytes() == t.numel() * t.element_size():
            out[storage_key(st)] = t
    return out


def owned_storages(engine: Any) -> list[Held]:
    """The distinct device storages of the engine's model (deduplicated across views)."""
    device = getattr(engine.runner, "device", None)
    dev_type = getattr(device, "type", str(device or "cpu"))
    paged = _page_tensors(engine.runner, int(getattr(engine, "pool_pages", 0) or 0))
    found: dict[int, Held] = {}
    for t, weight in walk_roots([engine.runner, getattr(engine, "spec", None)]):
        if t.device.type != dev_type or t.is_sparse or t.is_meta:
            continue
        st = t.untyped_storage()
        if st.nbytes() == 0 or not st.resizable():
            continue
        key = storage_key(st)
        held = found.get(key)
        if held is None:
            found[key] = held = Held(st, st.nbytes(), weight, t.dtype, paged.get(key))
        elif weight and not held.weight:
            held.weight, held.dtype = True, t.dtype
    for h in found.values():
        if h.weight:  # a parameter is never a page tensor, whatever the runner listed
            h.paged = None
    return list(found.values())


def storage_key(storage: Any) -> int:
    """A storage's identity that survives a resize (its data pointer does not: a regrown storage
    may sit elsewhere, and another storage may then sit where it was)."""
    return storage._cdata


def device_bytes(engine: Any) -> int:
    """Bytes the model's device storages hold now (0 while suspended): the allocation report."""
    return sum(h.storage.nbytes() for h in owned_storages(engine))


def byte_view(storage: Any) -> Any:
    """A uint8 tensor over the whole of `storage` (a slice of a tensor would keep its base's storage)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def typed_view(storage: Any, dtype: Any) -> Any:
    """A flat tensor of `dtype` over the whole of `storage`."""
    return byte_view(storage).view(dtype)


def used_pages(engine: Any) -> list[int]:
    """The page ids something holds (lanes, retained checkpoints, leases): what a suspend keeps."""
    pool = getattr(getattr(engine, "scheduler", None), "pages", None)
    if pool is None:
        return []
    return [p for p in range(pool.num_pages) if pool.refcount(p) > 0]
