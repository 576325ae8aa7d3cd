"""One catalog model's lifecycle: unloaded, loading, loaded, sleeping, unloading.

A ModelSlot owns at most one loaded model: its ServerContext, the FastAPI app built around it
(every protocol, exactly as a single-model server) and its Engine. Loading, unloading and the
device-memory moves of sleep and wake are blocking work that runs in threads; the slot's state is
changed only on the event loop, by ninfer_core.router.manager.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any

from ninfer_core.router.residency import Residency

log = logging.getLogger("ninfer")

UNLOADED, LOADING, LOADED, SLEEPING, UNLOADING = "unloaded", "loading", "loaded", "sleeping", "unloading"


@dataclass
class Loaded:
    """What a load produced; dropped whole on unload so nothing of the model stays referenced."""

    ctx: Any  # ServerContext
    app: Any  # its FastAPI app
    loader: Any  # ninfer_core.server.loader.Loader (the raw Engine, reporters)
    residency: Residency


class ModelSlot:
    def __init__(self, name: str, aliases: tuple[str, ...], path: str | None, args: Any, backend: Any):
        self.name, self.aliases, self.path = name, aliases, path
        self.args = args  # the parsed serve namespace of this model (preset + command line)
        self.backend = backend  # load(slot) -> Loaded, unload(slot, loaded): blocking
        self.status = UNLOADED
        self.loaded: Loaded | None = None
        self.failed = False
        self.error: str | None = None
        self.engine_failed: str | None = None  # an Engine-wide failure: unload once idle, load again
        self.in_flight = 0  # requests routed to it (waiting for it or running on it)
        self.last_used = 0.0  # monotonic time of the last request that used it (LRU order)
        self.idle_since = time.monotonic()
        self.moving = False  # a load, unload, sleep or wake is running
        # given a place by the room queue, its load (or wake) task not started yet: it occupies the
        # place already, or the next waiter, woken by the same change, would take it too
        self.reserved = False
        self.attempt = 0  # counts loads, so a waiter sees whether the load it waited on failed
        # GET /models?reload=1 (manager.reload): a changed entry's (path, args) wait here for the
        # model's next load; a removed entry leaves routing at once and the catalog once unloaded.
        self.pending: tuple[str | None, Any] | None = None
        self.removed = False

    # -- facts -------------------------------------------------------------------------------------
    @property
    def model_suspend(self) -> bool:
        return bool(getattr(self.args, "model_suspend", False))

    @property
    def sleep_idle_s(self) -> float | None:
        return getattr(self.args, "sleep_idle_seconds", None)

    @property
    def unload_idle_s(self) -> float | None:
        return getattr(self.args, "unload_idle_seconds", None)

    @property
    def occupies(self) -> bool:
        """Counts toward --models-max: it holds (or is taking, or still giving back) device memory."""
        return self.reserved or self.status in (LOADING, LOADED, UNLOADING) or \
            (self.status == SLEEPING and self.moving)

    @property
    def ready(self) -> bool:
        return self.status == LOADED and not self.moving and self.engine_failed is None

    @property
    def ctx(self) -> Any:
        return self.loaded.ctx if self.loaded is not None else None

    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    # -- blocking work (threads) -------------------------------------------------------------------
    def settings(self) -> tuple[str | None, list[str]]:
        """What a reload compares: the artifact and the serve arguments (preset, then command line)."""
        return self.path, list(getattr(self.args, "serve_argv_model", None) or [])

    def set_aliases(self, aliases: tuple[str, ...]) -> None:
        """A reload's aliases apply at once: the router routes them, and a loaded model's own
        routes (which check the body's model name) accept them."""
        self.aliases = aliases
        ctx = self.ctx
        if ctx is not None and getattr(ctx, "model", None) is not None:
            ctx.model = dataclasses.replace(ctx.model, aliases=tuple(a for a in aliases if a != ctx.model.id))

    def next_settings(self) -> tuple[str | None, list[str]]:
        """The settings its next load uses: a reload's pending change, else its own."""
        if self.pending is None:
            return self.settings()
        return self.pending[0], list(getattr(self.pending[1], "serve_argv_model", None) or [])

    def apply_pending(self) -> None:
        if self.pending is not None:
            (self.path, self.args), self.pending = self.pending, None

    def do_load(self) -> None:
        self.loaded = self.backend.load(self)

    def do_unload(self) -> None:
        loaded, self.loaded = self.loaded, None
        if loaded is not None:
            if loaded.residency is not None:
                if loaded.residency.suspended:
                    loaded.residency.discard()
                loaded.residency.release_reserve()  # a pinned snapshot block goes with the model
            self.backend.unload(self, loaded)
            del loaded
        gc.collect()  # the model's tensors go now, not at some later collection
        _empty_device_cache()

    def do_sleep(self) -> None:
        self.loaded.residency.suspend()

    def do_wake(self) -> None:
        self.loaded.residency.resume()


def _empty_device_cache() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - best effort
        log.debug("emptying the CUDA cache: %s", e)


def stop_loaded(loaded: Loaded) -> None:
    """Stop what a Loader started: the Engine (its worker thread), reporters, grammar threads."""
    loader = loaded.loader
    loader.stopping.set()
    if loader.stats is not None:
        loader.stats.stop()
        try:
            loader.stats.report()  # the last partial interval: a model unloaded early still shows its work
        except Exception as e:  # noqa: BLE001 - unloading regardless
            log.debug("stats line at unload: %s", e)
    if loader.engine is not None:
        try:
            loader.engine.shutdown()
        except Exception as e:  # noqa: BLE001
            log.warning("engine shutdown: %s", e)
    if loader.throughput is not None:
        loader.throughput.stop()
    ctx = loaded.ctx
    if ctx.structured is not None and hasattr(ctx.structured, "close"):
        ctx.structured.close()
    if loaded.app is not None and ctx.request_log is not None:  # a router model's own log (router/reporting.py)
        ctx.request_log.close()
    artifact = getattr(loader, "artifact", None)
    if artifact is not None and hasattr(artifact, "close"):
        artifact.close()
