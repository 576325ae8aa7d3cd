"""A test-only plugin (`--plugin ninfer_faults.plugin` with tests/ on PYTHONPATH) that injects Engine worker failures into a real
server, so the end-to-end tests can see recovery, the failure latch and exit status 2.

Importing it wraps the scheduler's pick_prefill: when a lane's request has the stop string
FAULT-INVARIANT it raises a RuntimeError (a broken invariant outside any forward), with
FAULT-OOM a torch.OutOfMemoryError. No other request is affected.
"""

from __future__ import annotations

import torch

from ninfer_core.engine.scheduler import Scheduler

INVARIANT = "FAULT-INVARIANT"
OOM = "FAULT-OOM"

_real_pick_prefill = Scheduler.pick_prefill


def _pick_prefill(self):
    for seq in self.lanes:
        stops = getattr(seq.request, "stop", None) or []
        if INVARIANT in stops:
            raise RuntimeError("injected invariant failure")
        if OOM in stops:
            raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 20.00 GiB")
    return _real_pick_prefill(self)


Scheduler.pick_prefill = _pick_prefill
