"""The context-cache serve options (spec "Server options"), kept beside the cache they configure.

`config.add_serve_arguments` and `config.options_from_args` call these two functions.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

# The explicit capacity flags --no-prefix-reuse refuses, even when zero (spec "Server options").
CAPACITY_FLAGS = ("device_state_slots", "host_state_slots", "host_kv_mib", "host_cache_mib",
                  "max_private_continuations", "max_shared_prefixes", "max_long_anchors_per_continuation")


def _count(s: str) -> int:
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _gib(s: str) -> float:
    import math

    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s}")
    return v


def add_cache_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("context cache")
    g.add_argument("--no-prefix-reuse", action="store_true",
                   help="disable compatible-prefix caching (default: prefix reuse on)")
    g.add_argument("--device-state-slots", type=_count, default=None, metavar="N",
                   help="extra Device checkpoint StateImages beyond the active lanes (default: max-concurrency)")
    g.add_argument("--host-state-slots", type=_count, default=None, metavar="N",
                   help="Host StateImage capacity (default 8)")
    g.add_argument("--host-kv-mib", type=_count, default=None, metavar="N",
                   help="Host KV capacity in MiB (default 8192)")
    g.add_argument("--host-cache-mib", type=_count, default=None, metavar="N",
                   help="one Host ceiling in MiB for the retention tier; derives the state/KV split and replaces "
                        "--host-state-slots and --host-kv-mib (default: unset, the component flags apply)")
    g.add_argument("--max-private-continuations", type=_count, default=None, metavar="N",
                   help="private continuation cells (/slots) (default: 2 * max-concurrency)")
    g.add_argument("--max-shared-prefixes", type=_count, default=None, metavar="N",
                   help="shared stable prefixes (default: max(max-concurrency, 7))")
    g.add_argument("--max-long-anchors-per-continuation", type=_count, default=None, metavar="N",
                   help="long anchors per continuation (default 2, 4 with --auto-long-anchors)")
    g.add_argument("--auto-long-anchors", action="store_true",
                   help="anchor message boundaries of every request automatically")
    g.add_argument("--long-anchor-spacing", type=_count, default=1024, metavar="N",
                   help="minimum token gap between automatic anchors, doubling per anchor")
    g.add_argument("--branch-anchors", action="store_true",
                   help="capture a long anchor where a prompt leaves a retained conversation")
    g.add_argument("--no-endpoint-anchors", action="store_true",
                   help="do not keep a resumed endpoint as a long anchor")
    g.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="enable POST /slots/{id} save/restore/erase with files in DIR (default: off, 501)")
    g.add_argument("--auto-save-evicted", action="store_true",
                   help="write an evicted session back to its bound slot file; requires --slot-save-path")
    g.add_argument("--disk-kv-path", default=None, metavar="DIR",
                   help="disk tier: evicted conversations are written to DIR (default: off)")
    g.add_argument("--disk-kv-gib", type=_gib, default=64, metavar="N", help="disk tier budget in GiB")
    g.add_argument("--disk-kv-restore", action="store_true",
                   help="seed a new request's matching prefix from the disk tier (default: the tier is write-only)")
    g.add_argument("--kv-lease-growth", action="store_true",
                   help="admission reserves the prompt plus a 4096-token output window (or --prefill-chunk when "
                        "larger) and grows it at decode boundaries, releasing idle retained owners least recently "
                        "used first; an answer whose next page does not fit ends with finish_reason length "
                        "(default: own-pages leases)")
    g.add_argument("--reserve-continuation-pages", action="store_true",
                   help="admission reserves the pages a resumed conversation holds beyond the resumed checkpoint "
                        "instead of leasing them to the request (the behaviour before own-pages leases; default off)")


def apply_cache_arguments(a: argparse.Namespace, eng) -> None:
    """Copy the parsed flags onto EngineOptions; raises ValueError for refused combinations."""
    if getattr(a, "no_prefix_reuse", False):
        given = ["--" + f.replace("_", "-") for f in CAPACITY_FLAGS if getattr(a, f, None) is not None]
        if given:
            raise ValueError(f"--no-prefix-reuse cannot be combined with {', '.join(given)}")
        for flag in ("slot_save_path", "auto_save_evicted", "disk_kv_path"):
            if getattr(a, flag, None):
                raise ValueError(f"--{flag.replace('_', '-')} needs the checkpoint catalog: it is refused "
                                 "with --no-prefix-reuse")
    if getattr(a, "auto_save_evicted", False) and not getattr(a, "slot_save_path", None):
        raise ValueError("--auto-save-evicted needs --slot-save-path")
    if getattr(a, "disk_kv_restore", False) and not getattr(a, "disk_kv_path", None):
        raise ValueError("--disk-kv-restore needs --disk-kv-path")
    if getattr(a, "disk_kv_gib", 64) <= 0:
        raise ValueError("--disk-kv-gib must be positive")
    if getattr(a, "host_cache_mib", None) is not None and (
            getattr(a, "host_state_slots", None) is not None or getattr(a, "host_kv_mib", None) is not None):
        raise ValueError("--host-cache-mib replaces --host-state-slots and --host-kv-mib; give one or the other")
    eng.prefix_reuse = not getattr(a, "no_prefix_reuse", False)
    for f in CAPACITY_FLAGS:
        setattr(eng, f, getattr(a, f, None))
    eng.auto_long_anchors = bool(getattr(a, "auto_long_anchors", False))
    eng.long_anchor_spacing = int(getattr(a, "long_anchor_spacing", 1024))
    eng.branch_anchors = bool(getattr(a, "branch_anchors", False))
    eng.endpoint_anchors = not getattr(a, "no_endpoint_anchors", False)
    eng.slot_save_path = getattr(a, "slot_save_path", None)
    eng.auto_save_evicted = bool(getattr(a, "auto_save_evicted", False))
    eng.disk_kv_path = getattr(a, "disk_kv_path", None)
    eng.disk_kv_gib = float(getattr(a, "disk_kv_gib", 64))
    eng.disk_kv_restore = bool(getattr(a, "disk_kv_restore", False))
    eng.kv_lease_growth = bool(getattr(a, "kv_lease_growth", False))
    eng.reserve_continuation_pages = bool(getattr(a, "reserve_continuation_pages", False))
    artifact = getattr(a, "artifact", None)
    eng.disk_kv_model = os.path.basename(artifact) if artifact else "default"


@dataclass
class CacheCapacities:
    """Resolved context-cache capacities (spec "Server options")."""

    device_state_slots: int
    host_state_slots: int
    host_kv_bytes: int
    max_private_continuations: int
    max_shared_prefixes: int
    max_long_anchors: int
    auto_long_anchors: bool = False
    long_anchor_spacing: int = 1024
    branch_anchors: bool = False
    endpoint_anchors: bool = True
    host_cache_budget_bytes: int | None = None

    @classmethod
    def resolve(cls, options, state_bytes: int) -> CacheCapacities:
        """From EngineOptions; `--host-cache-mib` derives the Host state/KV split.

        Raises ValueError when the state footprint a budget implies exceeds half of it.
        """
        c = options.max_concurrency
        auto = bool(getattr(options, "auto_long_anchors", False))
        anchors = getattr(options, "max_long_anchors_per_continuation", None)
        anchors = (4 if auto else 2) if anchors is None else anchors
        private = getattr(options, "max_private_continuations", None) or 2 * c
        shared = getattr(options, "max_shared_prefixes", None)
        shared = max(c, 7) if shared is None else shared
        dev = getattr(options, "device_state_slots", None)
        dev = c if dev is None else dev
        budget_mib = getattr(options, "host_cache_mib", None)
        host_state = getattr(options, "host_state_slots", None)
        host_kv_mib = getattr(options, "host_kv_mib", None)
        budget = None
        if budget_mib is not None:
            budget = budget_mib * 2**20
            host_state = (2 + anchors) * private + shared
            if auto and anchors and state_bytes:
                # Spend the remaining state headroom (under half the budget) on more anchors.
                while (2 + anchors + 1) * private + shared <= budget // 2 // max(state_bytes, 1) \
                        and anchors < 64:
                    anchors += 1
                host_state = (2 + anchors) * private + shared
            if host_state * state_bytes > budget // 2:
                raise ValueError(
                    f"--host-cache-mib {budget_mib}: {host_state} Host StateImages of "
                    f"{state_bytes} bytes exceed half of the budget")
            host_kv = budget - host_state * state_bytes
        else:
            host_state = 8 if host_state is None else host_state
            host_kv = (8192 if host_kv_mib is None else host_kv_mib) * 2**20
        return cls(dev, host_state, host_kv, private, shared, anchors, auto,
                   int(getattr(options, "long_anchor_spacing", 1024)),
                   bool(getattr(options, "branch_anchors", False)),
                   bool(getattr(options, "endpoint_anchors", True)), budget)
