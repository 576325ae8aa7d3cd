"""The lifecycle API and model suspend on a single-model server, whose catalog is its one model.

The server's own startup loads the model (server/loader.py, exit status 1 when that fails); the
first request after it is ready adopts it as a loaded ModelSlot. From then on the router's rules
apply to it: /models, /models/load|unload|sleep, /models/sse, /v1/models/{id}/residency|suspend|
resume, --sleep-idle-seconds and --unload-idle-seconds; a generation request wakes a sleeping
model (auto_resume) or loads an unloaded one again, into the same ServerContext. An Engine
failure still stops the server with status 2 (spec "Stop the server").
"""

from __future__ import annotations

from typing import Any

from ninfer_core.router.api import own_app
from ninfer_core.router.front import RouterFront
from ninfer_core.router.manager import ModelManager
from ninfer_core.router.residency import Residency
from ninfer_core.router.slots import LOADED, UNLOADED, Loaded, ModelSlot, stop_loaded


class SingleBackend:
    def __init__(self, ctx: Any, first_loader: Any, args: Any):
        self.ctx, self.first, self.args = ctx, first_loader, args

    def load(self, slot: ModelSlot) -> Loaded:
        from ninfer_core.artifact import Artifact
        from ninfer_core.server.loader import Loader

        ctx = self.ctx
        if self.first is not None:
            loader, self.first = self.first, None
        else:
            old = slot.template_source
            artifact = Artifact.open(old.artifact.path)
            ctx.load_error = None
            # the console too: a model loaded again keeps the stats line the server started with
            loader = Loader(ctx, artifact, old.family_reg, old.template, old.spec_reg, console=old.console)
            loader.on_engine_failure = old.on_engine_failure
            loader.run()
            if ctx.load_error:
                stop_loaded(Loaded(ctx, None, loader, None))
                raise RuntimeError(ctx.load_error)
        slot.template_source = loader
        residency = Residency.from_args(loader.engine, self.args, loader.artifact)
        ctx.residency = residency
        return Loaded(ctx, None, loader, residency)

    def unload(self, slot: ModelSlot, loaded: Loaded) -> None:
        stop_loaded(loaded)
        self.ctx.engine, self.ctx.residency = None, None


class SingleGate:
    """Called by ServerMiddleware (ctx.gate) once its own checks passed."""

    def __init__(self, ctx: Any, loader: Any, args: Any):
        name = loader.ctx.model.id if loader.ctx.model is not None else "model"
        self.backend = SingleBackend(ctx, loader, args)
        self.slot = ModelSlot(name, (), ctx.options.artifact, args, self.backend)
        self.slot.template_source = loader
        self.manager = ModelManager([self.slot], 1, bool(getattr(args, "models_autoload", True)), router=False)
        own, paths = own_app(self.manager, router_mode=False)
        self.front = RouterFront(own, self.manager, paths, single=True)
        self._started = False

    async def __call__(self, scope, receive, send, inner) -> None:
        if not self._started:
            self._started = True
            self.manager.start()
            slot = self.slot
            if slot.status == UNLOADED and slot.loaded is None:
                slot.do_load()  # adopts the model the server's startup loaded: no blocking work
                slot.name = self.backend.ctx.model.id
                self.manager.by_name = {slot.name: slot}
                self.manager._set_status(slot, LOADED)
        await self.front(scope, receive, send, inner=inner)
