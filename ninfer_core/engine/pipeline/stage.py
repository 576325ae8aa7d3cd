"""A pipeline stage: its process, its part of a forward, and how outputs travel back to rank 0.

Rank 0 is the engine's own process (the façade, ninfer_core.engine.pipeline.runner, holds stage 0
in process); ranks 1.. are spawned processes running `stage_main`. Control messages (the op and
its small arguments, StateImages and KV pages as shared-memory tensors) go over one pipe per
worker; hidden states go stage to stage over torch.distributed point-to-point on the `fwd` group,
and the last stage's logits (and final hidden, when asked) to rank 0 on the `ret` group. The two
directions have groups of their own so that NCCL, which orders a communicator's operations on one
stream, never has a return transfer wait behind a forward one.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ninfer_core.engine.pipeline.microbatch import output_rows

# What a worker answers over its pipe (the façade calls them on stage 0 directly).
CACHE_OPS = frozenset({"cache_spec", "allocate_cache", "free_cache", "reset_slot", "copy_slot", "copy_page",
                       "capture_state", "restore_state", "read_pages", "write_pages", "commit", "configure"})


@dataclass(frozen=True)
class StageSpec:
    """Everything a stage process needs to build its part of the model (picklable)."""

    rank: int
    world: int
    init_method: str  # tcp://127.0.0.1:PORT, rank 0 hosts the store
    backend: str  # gloo (CPU) or nccl (CUDA)
    family_target: str  # "module:Class" of the model family
    artifact_path: Any  # the artifact's path, or a picklable factory(device) -> artifact-like (random weights)
    device: str
    layers: tuple[int, int]  # [start, stop)
    dtype: str | None = None
    options: Any = None  # the family's serve options (an argparse.Namespace)
    timeout_s: float = 1800.0


def init_groups(spec: StageSpec):
    """Join the process group; returns (fwd, ret) groups (every rank calls this in the same order)."""
    import torch
    import torch.distributed as dist

    if spec.backend == "nccl":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off (KINDS.md of the device machines)
        torch.cuda.set_device(torch.device(spec.device))
    dist.init_process_group(spec.backend, init_method=spec.init_method, rank=spec.rank, world_size=spec.world,
                            timeout=timedelta(seconds=spec.timeout_s))
    return dist.new_group(list(range(spec.world))), dist.new_group(list(range(spec.world)))


def load_target(target: str):
    import importlib

    mod, _, attr = target.partition(":")
    obj = importlib.import_module(mod)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj() if isinstance(obj, type) else obj


def open_artifact(source: Any, device: str):
    """An open artifact from a path, or from a factory called with the stage's device."""
    if isinstance(source, str):
        from ninfer_core.artifact import Artifact

        return Artifact.open(source)
    return source(device)


def load_stage(spec: StageSpec):
    family = load_target(spec.family_target)
    return family.load_stage(open_artifact(spec.artifact_path, spec.device), range(*spec.layers), spec.device,
                             spec.dtype, spec.options)


def stage_forward(runner, pieces: list, rank: int, world: int, groups, hidden_size: int,
                  layers: range = range(0)) -> tuple[list, list]:
    """This stage's part of every piece, in order: receive the previous stage's hidden (rank > 0),
    run the stage's layers, send on (to the next stage, or the outputs to rank 0 from the last).

    Layer outputs a piece's segments ask for (`LaneSegment.hidden`) that this stage holds (its
    model layers `layers`) go to rank 0 too, every row, one tensor per layer in layer order,
    before the last stage's outputs. Returns (spans, taps): the (start, end) of each piece's
    layers on this stage (time.monotonic, one clock for every process of the machine; on CUDA the
    host's launch span), which the runner compares between stages to count how the pieces
    overlapped, and on rank 0 its own layer outputs per piece ({layer: [rows, hidden]}).

    A stage whose forward raises still sends zeros of the right shapes for the rest of the pieces,
    so that every stage ends the forward and the pipeline stays in step; the error is raised at
    the end (a worker reports it over its pipe, and rank 0 raises it from `forward`)."""
    import torch
    import torch.distributed as dist

    fwd, ret = groups
    # what goes stage to stage per row: the residual stream, and whatever else a family carries
    # beside it (`StageRunner.stage_width`, a family's per-layer inputs); equal on every stage
    width = int(getattr(runner, "stage_width", 0) or hidden_size)
    spans, taps = [], []
    pending = []  # (work, tensor) kept alive until the send completes
    error = None
    for piece in pieces:
        rows = sum(len(s) for s in piece.segments)
        h = None
        if rank > 0:
            h = torch.empty(rows, width, dtype=runner.dtype, device=runner.device)
            dist.recv(h, src=rank - 1, group=fwd)
        out = None
        t0 = time.monotonic()
        if error is None:
            try:
                out = runner.forward_stage(piece, h)
            except Exception as e:  # noqa: BLE001 - raised after the pipeline's transfers
                error = e
        spans.append((t0, time.monotonic()))
        asked = asked_layers(piece, layers)
        mine = {}
        if asked:
            got = runner.stage_layer_outputs() if out is not None else {}
            for layer in asked:
                t = got.get(layer)
                if t is None or t.shape[0] != rows:
                    t = torch.zeros(rows, hidden_size, dtype=runner.dtype, device=runner.device)
                mine[layer] = t.contiguous()
            if rank > 0:
                for t in mine.values():
                    pending.append((dist.isend(t, dst=0, group=ret), t))
        taps.append(mine if rank == 0 else {})
        if rank < world - 1:
            out = out.contiguous() if out is not None else torch.zeros(rows, width, dtype=runner.dtype,
                                                                        device=runner.device)
            pending.append((dist.isend(out, dst=rank + 1, group=fwd), out))
            continue
        sends = pack_outputs(piece, out) if out is not None else zero_outputs(piece, runner, hidden_size)
        for t in sends:
            pending.append((dist.isend(t, dst=0, group=ret), t))
    for work, _ in pending:
        work.wait()
    if error is not None:
        raise error
    return spans, taps


def asked_layers(piece, layers: range) -> list[int]:
    """The layer outputs a piece asks for that the stage of `layers` holds, in layer order."""
    from ninfer_core.engine.model_api import FINAL_HIDDEN

    return sorted({layer for s in piece.segments for layer in s.hidden if layer != FINAL_HIDDEN and layer in layers})


def zero_outputs(piece, runner, hidden_size: int) -> list:
    """What `pack_outputs` sends, as zeros (the last stage's forward failed)."""
    import torch

    n_logits = sum(output_rows(s)[0] for s in piece.segments)
    n_hidden = sum(output_rows(s)[1] for s in piece.segments)
    out = []
    if n_logits:
        out.append(torch.zeros(n_logits, int(runner.info.vocab_size), dtype=torch.float32, device=runner.device))
    if n_hidden:
        out.append(torch.zeros(n_hidden, hidden_size, dtype=runner.dtype, device=runner.device))
    return out


def pack_outputs(piece, outs) -> list:
    """The last stage's SegmentOutputs of a piece as at most two tensors: fp32 logits rows and
    final hidden rows, both in segment order (rank 0 knows the shapes from the segments)."""
    import torch

    from ninfer_core.engine.model_api import FINAL_HIDDEN

    logits, hidden = [], []
    for seg, o in zip(piece.segments, outs):
        n_logits, n_hidden = output_rows(seg)
        if n_logits:
            logits.append(o.logits.reshape(n_logits, -1).float())
        if n_hidden:
            hidden.append(o.hidden[FINAL_HIDDEN].reshape(n_hidden, -1))
    return [torch.cat(x).contiguous() for x in (logits, hidden) if x]


def stage_main(spec: StageSpec, conn) -> None:
    """A worker stage: join the group, load the layers, then serve the façade's ops until "exit"."""
    try:
        groups = init_groups(spec)
        import torch

        torch.set_grad_enabled(False)
        runner = load_stage(spec)
        conn.send(("ok", {"info": runner.info, "cache_spec": runner.cache_spec()}))
    except BaseException as e:  # noqa: BLE001 - reported to the façade, which fails the load
        _send_error(conn, e)
        return
    import torch.distributed as dist

    from ninfer_core.engine.pipeline.draft import WORKER_OPS, worker_op

    heads: dict = {}  # the draft heads enabled on this stage, by name
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):  # the engine process is gone
            break
        if op == "exit":
            break
        try:
            if op == "forward":
                pieces, hidden_size = args
                result = stage_forward(runner, pieces, spec.rank, spec.world, groups, hidden_size,
                                       range(*spec.layers))[0]
            elif op == "names":
                result = names_of(runner)
            elif op in WORKER_OPS:
                result = worker_op(runner, heads, op, args)
            elif op in CACHE_OPS:
                result = getattr(runner, op)(*args)
            else:
                raise ValueError(f"unknown pipeline op {op!r}")
            conn.send(("ok", result))
        except BaseException as e:  # noqa: BLE001
            _send_error(conn, e)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the process ends anyway
        pass


def names_of(runner) -> tuple[list[str], list[str]]:
    """The StateImage and KV page tensor names this stage owns (read once after allocate_cache)."""
    return list(runner.capture_state(0).tensors), list(runner.read_pages([0]))


def _send_error(conn, e: BaseException) -> None:
    try:
        conn.send(("error", type(e).__name__, str(e), traceback.format_exc(limit=8)))
    except Exception:  # noqa: BLE001 - the pipe is closed: the façade sees the process end
        pass
