"""Model suspend (spec "Model suspend"): give a model's device memory back while idle, take it again.

A suspend first holds the Engine's worker at a boundary with nothing queued or running
(`Engine.hold_when_idle`), so no forward runs while the memory is gone. It then finds every tensor
storage the model owns on its device -- weights, KV pages, recurrent state and checkpoint slots,
workspaces -- by walking the runner's (and the speculative backend's) object graph, copies each
to an ordinary host buffer and shrinks the storage to zero bytes. Tensors and their views keep
their storage objects, so a resume only grows each storage back and copies its bytes in: every
view, page table and Host-tier entry is as it was, and retained conversations reuse their
prefixes exactly as before.

What this Python build does not have: CUDA virtual memory management (the C++ server maps fresh
physical memory at the same addresses). A regrown storage may get another address, which a
captured CUDA Graph would still point at, so suspend needs eager decode on CUDA (--no-cuda-graph,
checked at startup). The weights are kept in the host snapshot (the spec's `--suspend-weights
host`); re-reading them from the artifact is not built. Free KV pages are copied with the rest.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("ninfer")

RESIDENT, SUSPENDED = "resident", "suspended"


class ResidencyError(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class _Held:
    storage: Any  # torch.UntypedStorage, shrunk to 0 bytes while suspended
    nbytes: int
    weight: bool
    snapshot: Any = None  # host copy (torch uint8 tensor) while suspended


@dataclass
class Transfer:
    duration_s: float
    state_bytes: int
    weight_bytes: int
    artifact_read_bytes: int = 0

    def report(self) -> dict:
        return {"duration_seconds": round(self.duration_s, 6), "state_bytes": self.state_bytes,
                "weight_bytes": self.weight_bytes, "artifact_read_bytes": self.artifact_read_bytes}


def _walk_roots(roots: list[Any]) -> list[tuple[Any, bool]]:
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


def owned_storages(engine: Any) -> list[_Held]:
    """The distinct device storages of the engine's model (deduplicated across views)."""
    device = getattr(engine.runner, "device", None)
    dev_type = getattr(device, "type", str(device or "cpu"))
    found: dict[int, _Held] = {}
    for t, weight in _walk_roots([engine.runner, getattr(engine, "spec", None)]):
        if t.device.type != dev_type or t.is_sparse or t.is_meta:
            continue
        st = t.untyped_storage()
        if st.nbytes() == 0 or not st.resizable():
            continue
        key = st.data_ptr()
        held = found.get(key)
        if held is None:
            found[key] = _Held(st, st.nbytes(), weight)
        elif weight:
            held.weight = True
    return list(found.values())


def device_bytes(engine: Any) -> int:
    """Bytes the model's device storages hold now (0 while suspended): the allocation report."""
    return sum(h.storage.nbytes() for h in owned_storages(engine))


def _byte_view(storage: Any) -> Any:
    """A uint8 tensor over the whole of `storage` (a slice of a tensor would keep its base's storage)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Residency:
    """One model's suspend/resume state machine and its GET /v1/models/{id}/residency report.

    snapshot "pageable" (the default): host memory allocated at each suspend and freed after the
    resume. "pinned" (--suspend-snapshot pinned, CUDA only): one page-locked block the size of the
    model's device storages is reserved here, at load, and kept; suspend and resume then copy at
    bus speed (asynchronous copies, one synchronisation). A storage that does not fit the block (one
    grown after load) falls back to pageable memory."""

    def __init__(self, engine: Any, auto_resume: bool = True, snapshot: str = "pageable"):
        self.engine = engine
        self.auto_resume = auto_resume
        self._block = None
        if snapshot == "pinned" and getattr(getattr(engine.runner, "device", None), "type", "cpu") == "cuda":
            import torch

            t0 = time.monotonic()
            size = sum(h.nbytes for h in owned_storages(engine))
            try:
                self._block = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as e:  # page-locked memory is scarcer than memory: serve pageable instead
                log.warning("suspend snapshot: %.1f MiB of pinned host memory not available (%s); suspends use "
                            "pageable memory", size / 2**20, str(e).splitlines()[0])
            else:
                log.info("suspend snapshot: %.1f MiB of pinned host memory reserved in %.1f s", size / 2**20,
                         time.monotonic() - t0)
        self.state = RESIDENT
        self._held: list[_Held] = []
        self._lock = threading.Lock()  # one suspend or resume at a time
        self.suspends = self.resumes = 0
        self.last_suspend: Transfer | None = None
        self.last_resume: Transfer | None = None
        self.last_error: str | None = None
        self._releasable: int | None = None

    @property
    def suspended(self) -> bool:
        return self.state == SUSPENDED

    def suspend(self, auto_resume: bool | None = None) -> dict:
        """Blocking (run it off the event loop). 409 model_busy while a request is in the engine."""
        import torch

        with self._lock:
            if auto_resume is not None:
                self.auto_resume = auto_resume
            if self.state == SUSPENDED:
                return self.report()
            if not self.engine.hold_when_idle().result(timeout=60):
                raise ResidencyError(409, "model_busy", "The model has requests queued or running; a suspend "
                                     "never interrupts them. Retry once they have finished.")
            t0 = time.monotonic()
            try:
                held = owned_storages(self.engine)
                offset, room = 0, (self._block.numel() if self._block is not None else 0)
                for h in held:  # copy everything first: a failure then leaves the model untouched
                    if offset + h.nbytes <= room:
                        h.snapshot = self._block[offset:offset + h.nbytes]
                        offset += h.nbytes
                        h.snapshot.copy_(_byte_view(h.storage), non_blocking=True)
                    else:
                        h.snapshot = torch.empty(h.nbytes, dtype=torch.uint8)
                        h.snapshot.untyped_storage().copy_(h.storage)
                if getattr(self.engine.runner.device, "type", "cpu") == "cuda":
                    torch.cuda.synchronize()
            except BaseException as e:
                self.engine.release_hold()
                self.last_error = f"suspend failed: {type(e).__name__}: {e}"
                raise ResidencyError(503, "suspend_failed", self.last_error) from e
            for h in held:
                h.storage.resize_(0)
            if getattr(self.engine.runner.device, "type", "cpu") == "cuda":
                torch.cuda.empty_cache()  # hand the freed blocks back to the driver, not just the allocator
            self._held = held
            self._releasable = sum(h.nbytes for h in held)
            self.state = SUSPENDED
            self.suspends += 1
            self.last_suspend = Transfer(time.monotonic() - t0, sum(h.nbytes for h in held if not h.weight),
                                         sum(h.nbytes for h in held if h.weight))
            self.last_error = None
            log.info("model suspended: %.1f MiB of device memory given back in %.3f s", self._releasable / 2**20,
                     self.last_suspend.duration_s)
            return self.report()

    def resume(self) -> dict:
        """Blocking. A failure (no device memory) leaves the model suspended with its snapshot intact."""
        with self._lock:
            if self.state == RESIDENT:
                return self.report()
            t0 = time.monotonic()
            grown: list[_Held] = []
            try:
                for h in self._held:
                    h.storage.resize_(h.nbytes)
                    grown.append(h)
                    if h.snapshot.is_pinned():
                        _byte_view(h.storage).copy_(h.snapshot, non_blocking=True)
                    else:
                        h.storage.copy_(h.snapshot.untyped_storage())
                if getattr(self.engine.runner.device, "type", "cpu") == "cuda":
                    import torch

                    torch.cuda.synchronize()
            except BaseException as e:
                for h in grown:  # give back what was taken; the snapshot still holds every byte
                    h.storage.resize_(0)
                self.last_error = f"resume failed: {type(e).__name__}: {e}"
                log.error("model resume failed: %s", self.last_error)
                raise ResidencyError(503, "resume_failed", self.last_error) from e
            held, self._held = self._held, []
            for h in held:
                h.snapshot = None
            self.state = RESIDENT
            self.resumes += 1
            self.last_resume = Transfer(time.monotonic() - t0, sum(h.nbytes for h in held if not h.weight),
                                        sum(h.nbytes for h in held if h.weight))
            self.last_error = None
            self.engine.release_hold()
            log.info("model resumed in %.3f s", self.last_resume.duration_s)
            return self.report()

    def discard(self) -> None:
        """Unloading a suspended model: drop the snapshot and let the worker run to its shutdown."""
        with self._lock:
            for h in self._held:
                h.snapshot = None
            self._held = []
            self.engine.release_hold()

    def release_reserve(self) -> None:
        """Unloading: the pinned block (if any) is freed with the model, not at the next collection."""
        with self._lock:
            self._block = None

    def report(self) -> dict:
        snapshot = sum(h.nbytes for h in self._held)
        releasable = self._releasable if self.suspended else sum(h.nbytes for h in owned_storages(self.engine))
        return {
            "object": "ninfer.residency", "state": self.state, "auto_resume": self.auto_resume,
            "releasable_device_bytes": int(releasable or 0), "device_bytes": 0 if self.suspended else int(releasable),
            "host_snapshot_bytes": snapshot,
            "host_reserved_bytes": int(self._block.numel()) if self._block is not None else 0,
            "suspend_count": self.suspends, "resume_count": self.resumes,
            "last_suspend": self.last_suspend.report() if self.last_suspend else None,
            "last_resume": self.last_resume.report() if self.last_resume else None,
            "last_error": self.last_error,
        }


@dataclass
class ResidencyOptions:
    model_suspend: bool = False
    auto_resume: bool = True
    sleep_idle_s: float | None = None
    unload_idle_s: float | None = None
    extra: dict = field(default_factory=dict)
