"""The checkpoint catalog: exact prefix reuse for hybrid (attention + recurrent) models.

A Gated DeltaNet layer's state cannot be cut at an arbitrary token, so the cache keeps whole
checkpoints (KV pages + StateImage) at chosen frontiers and a request resumes from the deepest one
whose tokens are its own prompt's prefix, token for token (spec "Execution behavior"):

* private continuations (/slots cells, `--max-private-continuations`): each finished conversation's
  endpoint (the executed frontier: the last sampled token is not in the KV yet), the turn closure
  before the assistant opener, and long anchors (endpoint anchors, client markers, automatic
  anchors at message boundaries);
* shared stable prefixes (`--max-shared-prefixes`): a system/tools prefix captured and published on
  its second sighting across conversations.

Captures cost no extra forward: the engine ends a prefill chunk at every planned frontier (splitting
a chunk where needed) and copies the lane's state there, and takes the endpoint at request end.
StateImages live in Device state slots (runner slots past the lanes) or, demoted under pressure,
as Host copies; pages are shared by reference count with the tail page copied on write.

The engine worker calls everything here under its lock; the model calls (state and page copies)
are fast copies, never forwards.

This module is the façade: `ContextCache`, the object the engine gets from the prefix-cache
registry (`checkpoint_catalog`), joins the parts, each in a module of its own:

* `cache_catalog`: the catalog's data (entries, pools, reference counts, lookup, audit, reports);
* `cache_admission`: admission and pressure (reuse plans, room making, eviction choice);
* `cache_capture`: capture planning and publishing;
* `cache_tiers`: the moves between Device, Host and disk tiers, the only part that calls the runner;
* `cache_options`: the capacities the serve options resolve to; `checkpoints`: the checkpoint,
  continuation and hint records, and the chat-format hints (`derive_hints`).
"""

from __future__ import annotations

import logging
import os

from ninfer_core import hookimpl
from ninfer_core.engine.cache_admission import Admission, ReusePlan
from ninfer_core.engine.cache_capture import Capture
from ninfer_core.engine.cache_catalog import CheckpointCatalog
from ninfer_core.engine.cache_options import CacheCapacities
from ninfer_core.engine.cache_tiers import TierMoves
from ninfer_core.engine.checkpoints import derive_hints
from ninfer_core.engine.pages import PagePool

# What callers import from here (the parts' own names are imported from their modules; the
# disk-tier constants are read from cache_tiers, where a test sets them).
__all__ = ["CacheCapacities", "ContextCache", "ReusePlan", "build_context_cache", "derive_hints"]

log = logging.getLogger("ninfer.engine.cache")


class ContextCache(Admission, Capture, TierMoves, CheckpointCatalog):
    """The checkpoint catalog over one engine's page pool and the runner's extra state slots."""

    name = "checkpoint_catalog"


def build_context_cache(runner, pages: PagePool, options, state_bytes: int, page_size: int
                        ) -> ContextCache | None:
    """The default prefix cache for an engine, or None (root-only) with --no-prefix-reuse or a
    runner that cannot copy state and pages."""
    if not getattr(options, "prefix_reuse", True):
        return None
    if not runner.supports_context_cache:
        log.info("context cache off: the model runner cannot capture state")
        return None
    caps = CacheCapacities.resolve(options, state_bytes)
    spec = runner.cache_spec()
    cache = ContextCache(runner, pages, options.max_concurrency, caps, state_bytes, page_size,
                         spec.kv_bytes_per_token)
    disk_path = getattr(options, "disk_kv_path", None)
    if disk_path:
        from ninfer_core.engine.cache_disk import DiskTier

        info = runner.info
        compat = {"architecture": info.architecture, "vocab": info.vocab_size, "hidden": info.hidden_size,
                  "n_params": info.n_params, "kv_dtype": getattr(options, "kv_dtype", "bf16"),
                  "page_size": page_size, "kv_bytes_per_token": spec.kv_bytes_per_token,
                  "state_bytes": spec.state_bytes, "model": getattr(options, "disk_kv_model", "")}
        cache.disk = DiskTier(disk_path, int(getattr(options, "disk_kv_gib", 64) * 2**30), compat,
                              bool(getattr(options, "disk_kv_restore", False)))
    slot_dir = getattr(options, "slot_save_path", None)
    if slot_dir and getattr(options, "auto_save_evicted", False):
        from ninfer_core.engine.cache_spill import SlotSpiller

        os.makedirs(slot_dir, exist_ok=True)
        cache.spiller = SlotSpiller(slot_dir)
    return cache


@hookimpl
def ninfer_register_prefix_caches(register):
    register("checkpoint_catalog", "ninfer_core.engine.cache:build_context_cache")
    register("none", None)
