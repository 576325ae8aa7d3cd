"""`--kv-capacity auto`: the Main Text KV pool sized from the memory left once the model is loaded.

The tokens are counted at the cache spec's real bytes per token, so a quantised `--kv-dtype`
(int8: about half of bf16's bytes with its scales) fits proportionally more. On CUDA the budget is
the device's free memory less `--kv-headroom-mib` and the lanes' state slots; on the CPU (tests,
the reference path) it is a quarter of the available host memory less the headroom, so an
accidental `auto` never takes the whole machine.
"""

from __future__ import annotations

import os

from ninfer_core.engine.pages import pages_for


def free_memory_bytes(device) -> int:
    import torch

    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        avail = 8 * 2**30
    return int(avail) // 4


def auto_kv_capacity(spec, device, headroom_mib: int, lanes: int, page_size: int, free_bytes: int | None = None) -> int:
    """Tokens (whole pages) of the pool that fit the free memory; ValueError when not one page fits."""
    per_token = int(spec.kv_bytes_per_token)
    free = free_memory_bytes(device) if free_bytes is None else int(free_bytes)
    budget = free - int(headroom_mib) * 2**20 - int(spec.state_bytes) * lanes
    if per_token <= 0:
        raise ValueError("--kv-capacity auto: this model keeps no paged KV to size")
    pages = budget // (per_token * page_size)
    if pages < 1:
        raise ValueError(f"--kv-capacity auto: {max(free, 0) / 2**30:.2f} GiB free is not enough for one KV page "
                         f"beside --kv-headroom-mib {headroom_mib}")
    return int(pages) * page_size


def pool_pages(options, spec, device, page_size: int) -> int:
    if options.kv_capacity == "auto":
        tokens = auto_kv_capacity(spec, device, options.kv_headroom_mib, options.max_concurrency, page_size)
        return pages_for(tokens, page_size)
    return pages_for(options.resolved_kv_capacity(), page_size)
