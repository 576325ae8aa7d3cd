"""Model suspend (spec "Model suspend"): give a model's device memory back while idle, take it again.

A suspend first holds the Engine's worker at a boundary with nothing queued or running
(`Engine.hold_when_idle`), so no forward runs while the memory is gone. It then finds every
tensor storage the model owns on its device -- weights, KV pages, recurrent state and checkpoint
slots, workspaces -- by walking the runner's (and the speculative backend's) object graph
(storages.py), keeps what it must on the host and shrinks every storage to zero bytes. Tensors
and their views keep their storage objects, so a resume only grows each storage back and fills
it: every view, page table and Host-tier entry is as it was, and retained conversations reuse
their prefixes exactly as before.

What is kept, and where:
- weights: with `--suspend-weights artifact` (the default) nothing; the resume reads them again
  from the artifact (weights.py), and only a weight the artifact cannot give back byte for byte
  is copied to the host. With `--suspend-weights host` every weight is copied to the host.
- KV pages: only the pages something holds (retained conversations, leases); the free pages'
  bytes are not copied and read as zeros after the resume.
- everything else (state slots, checkpoints' Device slots, workspaces): copied whole.

What this Python build does not have: CUDA virtual memory management (the C++ server maps fresh
physical memory at the same addresses). A regrown storage may get another address, which a
captured CUDA Graph would still point at, so suspend needs eager decode on CUDA (--no-cuda-graph,
checked at startup).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from ninfer_core.router.storages import Held, byte_view, owned_storages, storage_key, used_pages
from ninfer_core.router.weights import ArtifactWeights

log = logging.getLogger("ninfer")

RESIDENT, SUSPENDED = "resident", "suspended"
WEIGHTS_MODES = ("artifact", "host")
ALIGN = 64  # bytes: each snapshot's place in a pinned block starts on this boundary


class ResidencyError(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class Transfer:
    duration_s: float
    state_bytes: int
    weight_bytes: int
    artifact_read_bytes: int = 0

    def report(self) -> dict:
        return {"duration_seconds": round(self.duration_s, 6), "state_bytes": self.state_bytes,
                "weight_bytes": self.weight_bytes, "artifact_read_bytes": self.artifact_read_bytes}


def _is_cuda(engine: Any) -> bool:
    return getattr(getattr(engine.runner, "device", None), "type", "cpu") == "cuda"


class Residency:
    """One model's suspend/resume state machine and its GET /v1/models/{id}/residency report.

    snapshot "pageable" (the default): host memory allocated at each suspend and freed after the
    resume. "pinned" (--suspend-snapshot pinned, CUDA only): one page-locked block the size of what
    a suspend can keep (every storage, less the weights when they come back from the artifact) is
    reserved here, at load, and kept; suspend and resume then copy at bus speed (asynchronous
    copies, one synchronisation). What does not fit the block (a storage grown after load, a weight
    the artifact cannot give back) falls back to pageable memory.

    weights "artifact" (the default) needs the open artifact (`artifact`); without a usable one the
    weights go to the host snapshot as with "host". The artifact sources of each weight are proven
    at the first suspend, or at load with a pinned block (so its first suspend is as fast as the
    next ones)."""

    def __init__(self, engine: Any, auto_resume: bool = True, snapshot: str = "pageable",
                 weights: str = "artifact", artifact: Any = None):
        if weights not in WEIGHTS_MODES:
            raise ValueError(f"suspend weights must be one of {WEIGHTS_MODES}, got {weights!r}")
        self.engine = engine
        self.auto_resume = auto_resume
        self.weights = weights if weights == "host" or ArtifactWeights.usable(artifact) else "host"
        self.source = ArtifactWeights(artifact) if self.weights == "artifact" else None
        self._sources: dict[int, list] | None = None  # storage key -> segments, once proven
        self._block = None
        if snapshot == "pinned" and _is_cuda(engine):
            self._reserve_block()
        self.state = RESIDENT
        self._held: list[Held] = []
        self._lock = threading.Lock()  # one suspend or resume at a time
        self.suspends = self.resumes = 0
        self.last_suspend: Transfer | None = None
        self.last_resume: Transfer | None = None
        self.last_error: str | None = None
        self._releasable: int | None = None

    @classmethod
    def from_args(cls, engine: Any, args: Any, artifact: Any) -> Residency:
        """The residency of a model started with these serve arguments."""
        suspend = bool(getattr(args, "model_suspend", False))
        return cls(engine, auto_resume=not getattr(args, "no_auto_resume", False),
                   snapshot=getattr(args, "suspend_snapshot", "pageable") if suspend else "pageable",
                   weights=getattr(args, "suspend_weights", "artifact"), artifact=artifact)

    def _reserve_block(self) -> None:
        import torch

        t0 = time.monotonic()
        held = self._storages()
        size = sum(-(-h.nbytes // ALIGN) * ALIGN for h in held if not h.from_artifact)
        try:
            self._block = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as e:  # page-locked memory is scarcer than memory: serve pageable instead
            log.warning("suspend snapshot: %.1f MiB of pinned host memory not available (%s); suspends use "
                        "pageable memory", size / 2**20, str(e).splitlines()[0])
        else:
            log.info("suspend snapshot: %.1f MiB of pinned host memory reserved in %.1f s", size / 2**20,
                     time.monotonic() - t0)

    def _storages(self) -> list[Held]:
        """The model's storages, each weight with its artifact sources (proven once)."""
        held = owned_storages(self.engine)
        if self.source is None:
            return held
        if self._sources is None:
            t0 = time.monotonic()
            self._sources = {}
            for h in held:
                if h.weight:
                    self._sources[storage_key(h.storage)] = self.source.locate(h.storage, h.dtype)
            n = sum(1 for s in self._sources.values() if s)
            mapped = sum(h.nbytes for h in held if self._sources.get(storage_key(h.storage)))
            weights = sum(h.nbytes for h in held if h.weight)
            log.info("suspend weights: %d of %d weight storages (%.1f of %.1f MiB) reload from the artifact "
                     "(proven in %.2f s); the rest go to the host snapshot", n, len(self._sources),
                     mapped / 2**20, weights / 2**20, time.monotonic() - t0)
        for h in held:
            if h.weight:
                h.segments = self._sources.get(storage_key(h.storage)) or []
        return held

    @property
    def suspended(self) -> bool:
        return self.state == SUSPENDED

    def suspend(self, auto_resume: bool | None = None) -> dict:
        """Blocking (run it off the event loop). 409 model_busy while a request is in the engine."""
        with self._lock:
            if auto_resume is not None:
                self.auto_resume = auto_resume
            if self.state == SUSPENDED:
                return self.report()
            if not self.engine.hold_when_idle().result(timeout=60):
                raise ResidencyError(409, "model_busy", "The model has requests queued or running; a suspend "
                                     "never interrupts them. Retry once they have finished.")
            t0 = time.monotonic()
            held: list[Held] = []
            try:
                held = self._storages()
                self._copy_out(held)  # everything first: a failure then leaves the model untouched
            except BaseException as e:
                for h in held:
                    h.snapshot = h.live = None
                self.engine.release_hold()
                self.last_error = f"suspend failed: {type(e).__name__}: {e}"
                raise ResidencyError(503, "suspend_failed", self.last_error) from e
            for h in held:
                h.storage.resize_(0)
            if _is_cuda(self.engine):
                import torch

                torch.cuda.empty_cache()  # hand the freed blocks back to the driver, not just the allocator
            self._held = held
            self._releasable = sum(h.nbytes for h in held)
            self.state = SUSPENDED
            self.suspends += 1
            self.last_suspend = Transfer(time.monotonic() - t0, sum(_kept(h) for h in held if not h.weight),
                                         sum(_kept(h) for h in held if h.weight))
            self.last_error = None
            log.info("model suspended: %.1f MiB of device memory given back in %.3f s (%.1f MiB kept on the host)",
                     self._releasable / 2**20, self.last_suspend.duration_s, self.host_snapshot_bytes / 2**20)
            return self.report()

    def _copy_out(self, held: list[Held]) -> None:
        import torch

        offset, room = 0, (self._block.numel() if self._block is not None else 0)

        def host(nbytes: int) -> Any:
            nonlocal offset
            start = offset
            if start + nbytes <= room:  # aligned, so a slice can be viewed as any element type
                offset = start + -(-nbytes // ALIGN) * ALIGN
                return self._block[start:start + nbytes]
            return torch.empty(nbytes, dtype=torch.uint8)

        live = used_pages(self.engine)
        for h in held:
            if h.from_artifact:
                continue
            if h.paged is not None:
                idx = torch.tensor(live, dtype=torch.int64, device=h.paged.device)
                rows = h.paged.index_select(0, idx)
                h.snapshot = host(rows.numel() * rows.element_size()).view(rows.dtype).view(rows.shape)
                h.snapshot.copy_(rows, non_blocking=h.snapshot.is_pinned())
                h.live = idx
            else:
                h.snapshot = host(h.nbytes)
                h.snapshot.copy_(byte_view(h.storage), non_blocking=h.snapshot.is_pinned())
        if _is_cuda(self.engine):
            torch.cuda.synchronize()

    def resume(self) -> dict:
        """Blocking. A failure (no device memory) leaves the model suspended with its snapshot intact."""
        import torch

        with self._lock:
            if self.state == RESIDENT:
                return self.report()
            t0 = time.monotonic()
            grown: list[Held] = []
            read = 0
            try:
                for h in self._held:
                    h.storage.resize_(h.nbytes)
                    grown.append(h)
                    if h.from_artifact:
                        read += self.source.reload(h.storage, h.dtype, h.segments)
                    elif h.paged is not None:
                        h.paged.zero_()  # free pages: zeros, never stale bytes a kernel might read past a mask
                        if h.live.numel():
                            h.paged.index_copy_(0, h.live, h.snapshot.to(h.paged.device, non_blocking=True))
                    elif h.snapshot.is_pinned():
                        byte_view(h.storage).copy_(h.snapshot, non_blocking=True)
                    else:
                        byte_view(h.storage).copy_(h.snapshot)
                if _is_cuda(self.engine):
                    torch.cuda.synchronize()
            except BaseException as e:
                for h in grown:  # give back what was taken; the snapshot (and the artifact) still hold every byte
                    h.storage.resize_(0)
                self.last_error = f"resume failed: {type(e).__name__}: {e}"
                log.error("model resume failed: %s", self.last_error)
                raise ResidencyError(503, "resume_failed", self.last_error) from e
            held, self._held = self._held, []
            moved_state = sum(_kept(h) for h in held if not h.weight)
            moved_weights = sum(h.nbytes if h.from_artifact else _kept(h) for h in held if h.weight)
            for h in held:
                h.snapshot = h.live = None
            self.state = RESIDENT
            self.resumes += 1
            self.last_resume = Transfer(time.monotonic() - t0, moved_state, moved_weights, read)
            self.last_error = None
            self.engine.release_hold()
            log.info("model resumed in %.3f s (%.1f MiB read from the artifact)", self.last_resume.duration_s,
                     read / 2**20)
            return self.report()

    def discard(self) -> None:
        """Unloading a suspended model: drop the snapshot and let the worker run to its shutdown."""
        with self._lock:
            for h in self._held:
                h.snapshot = h.live = None
            self._held = []
            self.engine.release_hold()

    def release_reserve(self) -> None:
        """Unloading: the pinned block (if any) is freed with the model, not at the next collection."""
        with self._lock:
            self._block = None

    @property
    def host_snapshot_bytes(self) -> int:
        return sum(_kept(h) for h in self._held)

    def report(self) -> dict:
        releasable = self._releasable if self.suspended else sum(h.nbytes for h in owned_storages(self.engine))
        return {
            "object": "ninfer.residency", "state": self.state, "auto_resume": self.auto_resume,
            "suspend_weights": self.weights,
            "releasable_device_bytes": int(releasable or 0), "device_bytes": 0 if self.suspended else int(releasable),
            "host_snapshot_bytes": self.host_snapshot_bytes,
            "host_reserved_bytes": int(self._block.numel()) if self._block is not None else 0,
            "suspend_count": self.suspends, "resume_count": self.resumes,
            "last_suspend": self.last_suspend.report() if self.last_suspend else None,
            "last_resume": self.last_resume.report() if self.last_resume else None,
            "last_error": self.last_error,
        }


def _kept(h: Held) -> int:
    """Host bytes a suspended storage's snapshot holds."""
    s = h.snapshot
    return 0 if s is None else s.numel() * s.element_size()

