"""Which layers each pipeline stage holds: `--devices A,B,...` and `--stage-layers A,B,...`.

Pure functions (no process, no tensor): the parse of both flags, the checks the spec names (2 to 8
devices, one count per device, counts that add up to the family's layer count) and the default
split from each device's free memory (an even split where every device reports the same).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

MIN_STAGES, MAX_STAGES = 2, 8
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


class StageSplitError(ValueError):
    """A --devices / --stage-layers value the server refuses (the message names the flag)."""


def parse_devices(text: str) -> list[str]:
    """`--devices A,B,...` -> torch device names; 2 to 8 of them, all CPU or all distinct CUDA devices."""
    items = [x.strip() for x in str(text).split(",")]
    if any(not x for x in items):
        raise StageSplitError(f"--devices {text!r}: an empty device name (use a comma-separated list such as "
                              "cuda:0,cuda:1)")
    bad = [x for x in items if not _DEVICE.match(x)]
    if bad:
        raise StageSplitError(f"--devices: {bad[0]!r} is not a device (cpu, cuda or cuda:N)")
    if not MIN_STAGES <= len(items) <= MAX_STAGES:
        raise StageSplitError(f"--devices lists {len(items)} device{'s' if len(items) != 1 else ''}; a pipeline "
                              f"has {MIN_STAGES} to {MAX_STAGES} stages, one per device")
    kinds = {x.split(":")[0] for x in items}
    if len(kinds) > 1:
        raise StageSplitError("--devices mixes the CPU and CUDA devices; list stages of one kind")
    if kinds == {"cuda"}:
        items = [x if ":" in x else "cuda:0" for x in items]
        dup = sorted({x for x in items if items.count(x) > 1})
        if dup:
            raise StageSplitError(f"--devices lists {dup[0]} twice (each stage needs its own CUDA device)")
    return items


def parse_stage_layers(text: str) -> list[int]:
    """`--stage-layers A,B,...` -> positive layer counts (their number and sum are checked by `plan_stages`)."""
    out = []
    for x in str(text).split(","):
        x = x.strip()
        if not x.isdigit() or int(x) < 1:
            raise StageSplitError(f"--stage-layers {text!r}: every stage holds a whole number of layers, at least 1 "
                                  f"(got {x!r})")
        out.append(int(x))
    return out


def plan_stages(num_layers: int, devices: list[str], stage_layers: list[int] | None = None,
                free_bytes: list[int] | None = None, cuts: Sequence[int] | None = None) -> list[range]:
    """The layer range of each stage, in `devices` order.

    `stage_layers` given: one count per device, adding up to `num_layers`. Otherwise the layers are
    shared in proportion to `free_bytes` (each device's free memory; None: equal), every stage at
    least one, rounded by largest remainder so the split is deterministic. `cuts`: the first layers
    a stage may start at (the family's `pipeline_cuts`; None: any); a default split moves each
    boundary to the nearest of them, an explicit one that crosses another is refused."""
    n = len(devices)
    if num_layers < n:
        raise StageSplitError(f"--devices lists {n} stages but the model has {num_layers} layers (one at least "
                              "per stage)")
    if stage_layers is not None:
        if len(stage_layers) != n:
            raise StageSplitError(f"--stage-layers lists {len(stage_layers)} counts for {n} devices (one per device, "
                                  "in --devices order)")
        if sum(stage_layers) != num_layers:
            raise StageSplitError(f"--stage-layers adds up to {sum(stage_layers)} layers; the model has {num_layers}")
        counts = list(stage_layers)
    else:
        weights = [max(int(b), 1) for b in free_bytes] if free_bytes is not None else [1] * n
        if len(weights) != n:
            raise ValueError("one free-memory figure per device")
        spare = num_layers - n  # every stage has one layer; the rest go by weight
        share = [spare * w / sum(weights) for w in weights]
        counts = [1 + int(s) for s in share]
        order = sorted(range(n), key=lambda i: (-(share[i] - int(share[i])), i))
        for i in order[: num_layers - sum(counts)]:
            counts[i] += 1
    bounds = [sum(counts[:k]) for k in range(1, n)]
    if cuts is not None:
        allowed = sorted({int(c) for c in cuts if 0 < int(c) < num_layers})
        if stage_layers is not None:
            bad = [b for b in bounds if b not in allowed]
            if bad:
                raise StageSplitError(f"--stage-layers starts a stage at layer {bad[0]}, which reads state of a layer "
                                      f"before it; this model's stages may start at layers {_listing(allowed)}")
        else:
            bounds = _snap(bounds, allowed, num_layers)
    ranges, start = [], 0
    for b in [*bounds, num_layers]:
        ranges.append(range(start, b))
        start = b
    return ranges


def _snap(bounds: list[int], allowed: list[int], num_layers: int) -> list[int]:
    """Each boundary at the allowed cut nearest to it, in order, one layer at least per stage."""
    if len(allowed) < len(bounds):
        raise StageSplitError(f"--devices lists {len(bounds) + 1} stages; this model's layers split into "
                              f"{len(allowed) + 1} stages at most (stages may start at layers {_listing(allowed)})")
    out: list[int] = []
    for k, b in enumerate(bounds):
        left = len(bounds) - k - 1  # boundaries still to place after this one
        choices = [c for c in allowed if (not out or c > out[-1]) and sum(1 for x in allowed if x > c) >= left]
        out.append(min(choices, key=lambda c: (abs(c - b), c)))
    return out


def _listing(cuts: list[int]) -> str:
    if not cuts:
        return "none (it runs as one stage)"
    if len(cuts) > 1 and cuts == list(range(cuts[0], cuts[-1] + 1)):
        return f"{cuts[0]}..{cuts[-1]}"
    return ", ".join(map(str, cuts))


def free_memory(devices: list[str]) -> list[int] | None:
    """Free bytes of each CUDA device (torch.cuda.mem_get_info); None on the CPU (an even split)."""
    if not devices or not devices[0].startswith("cuda"):
        return None
    import torch

    return [int(torch.cuda.mem_get_info(torch.device(d))[0]) for d in devices]
