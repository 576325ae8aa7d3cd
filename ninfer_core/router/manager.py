"""The lifecycle of every model behind one address: room, LRU, waiting, idle timers, status events.

All state changes happen on the event loop; the blocking parts (load, unload, sleep, wake) run
in worker threads. The rules (spec "Several models (router)"):
- at most --models-max models occupy device memory (loaded, loading, or moving memory); 0: no limit;
- a request for a model that needs room queues in arrival order, one entry per model however many
  requests want it (they share one load); the head of the queue takes a free place, or makes one
  by putting the least recently used model without requests in flight to sleep (--model-suspend)
  or unloading it. A model with requests in flight is never interrupted: the request waits up to
  ten minutes, then fails with 503;
- a request that leaves while it waits gives up its place in the queue;
- --sleep-idle-seconds / --unload-idle-seconds act on a model no request has used for that long;
- a model whose Engine failed is unloaded once its requests are gone and loads on its next request;
- GET /models?reload=1 (`reload`) reads the catalog again: a new model is listed unloaded (never
  loaded by load-on-startup), a removed one leaves routing at once and the catalog once its
  requests are gone and it is unloaded, a changed one takes its new path and arguments at its next
  load (a loaded model keeps serving as it was loaded).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import deque
from typing import Any

from ninfer_core.engine.api import EngineError
from ninfer_core.router.catalog import CatalogError
from ninfer_core.router.slots import LOADED, LOADING, SLEEPING, UNLOADED, UNLOADING, ModelSlot

log = logging.getLogger("ninfer")

ROOM_WAIT_S = 600.0  # the longest a request waits for another model's requests to finish
IDLE_TICK_S = 0.25
# NINFER_DEBUG_FAKE_TIMING=1 (tests only; scripts/llama_server_shim.py sets it for llama.cpp's
# LLAMA_SERVER_DEBUG_FAKE_TIMING): a router load and every routed request then take this much
# longer, as llama.cpp's router does, so tests can hold a model busy for a known time.
FAKE_TIMING_S = 2.0


class ModelManager:
    def __init__(self, slots: list[ModelSlot], models_max: int, autoload: bool, router: bool = True):
        self.slots = slots
        self.by_name: dict[str, ModelSlot] = {}
        self._index()
        # the catalog read again (serve.py: build_slots; blocking, raises CatalogError); None: a
        # single-model server, whose catalog is its one model
        self.rebuild: Any = None
        self._reloading: asyncio.Lock | None = None
        self.models_max = models_max
        self.autoload = autoload
        self.router = router
        self._queue: deque[ModelSlot] = deque()  # models waiting for room, in arrival order
        self._changed = asyncio.Event()
        self._subscribers: set[asyncio.Queue] = set()
        self._tasks: set[asyncio.Task] = set()
        self._idle_task: asyncio.Task | None = None
        self.stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.fake_timing_s = FAKE_TIMING_S if router and os.environ.get("NINFER_DEBUG_FAKE_TIMING") else 0.0

    # -- lookup ------------------------------------------------------------------------------------
    def _index(self) -> None:
        self.by_name = {n: s for s in self.slots if not s.removed for n in s.names()}

    def listed(self) -> list[ModelSlot]:
        """The catalog (GET /models): every model but those a reload removed."""
        return [s for s in self.slots if not s.removed]

    def find(self, name: str | None) -> ModelSlot | None:
        return self.by_name.get(name) if name else None

    def default_slot(self) -> ModelSlot | None:
        """The model a request that names none gets: the most recently used loaded one (the only
        one of a one-model catalog)."""
        listed = self.listed()
        if len(listed) == 1:
            return listed[0]
        live = [s for s in listed if s.status in (LOADED, SLEEPING)]
        return max(live, key=lambda s: s.last_used) if live else None

    # -- events ------------------------------------------------------------------------------------
    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, timeout: float) -> None:
        ev = self._changed
        try:
            await asyncio.wait_for(ev.wait(), max(0.0, timeout))
        except TimeoutError:
            pass

    def _set_status(self, slot: ModelSlot, status: str) -> None:
        changed = slot.status != status
        slot.status = status
        if changed:
            data: dict[str, Any] = {"status": status}
            if slot.failed:
                data.update(failed=True, error=slot.error)
            self.publish({"model": slot.name, "event": "model_status", "data": data})
        self._notify()

    def publish(self, event: dict) -> None:
        line = json.dumps(event)
        for q in list(self._subscribers):
            q.put_nowait(line)

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subscribers.discard(q)

    # -- background --------------------------------------------------------------------------------
    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if self._idle_task is None:
            self._idle_task = asyncio.create_task(self._idle_loop())

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _idle_loop(self) -> None:
        while not self.stopping:
            await asyncio.sleep(IDLE_TICK_S)
            now = time.monotonic()
            for s in list(self.slots):
                if s.moving or s.in_flight:
                    continue
                idle = now - s.idle_since
                if s.removed:  # a reload took it out of the catalog: unload, then forget it
                    if s.status in (LOADED, SLEEPING):
                        log.info("model %s left the catalog: unloading", s.name)
                        self._spawn(self._unload(s))
                    elif s.status == UNLOADED and s not in self._queue:
                        self.slots.remove(s)
                        self.publish({"model": s.name, "event": "model_remove"})
                        self._notify()
                elif s.engine_failed is not None and s.status == LOADED:
                    self._spawn(self._unload(s))
                elif s.unload_idle_s and s.status in (LOADED, SLEEPING) and idle >= s.unload_idle_s:
                    log.info("model %s idle for %.0f s: unloading", s.name, idle)
                    self._spawn(self._unload(s))
                elif s.sleep_idle_s and s.model_suspend and s.status == LOADED and idle >= s.sleep_idle_s:
                    log.info("model %s idle for %.0f s: going to sleep", s.name, idle)
                    self._spawn(self._sleep(s))

    # -- transitions -------------------------------------------------------------------------------
    async def _run(self, slot: ModelSlot, status_during: str, fn, status_after: str, status_failed: str) -> bool:
        slot.moving, slot.reserved = True, False
        self._set_status(slot, status_during)
        try:
            await asyncio.to_thread(fn)
        except BaseException as e:  # noqa: BLE001 - reported in GET /models and to the waiters
            slot.moving = False
            slot.error = str(e) or type(e).__name__
            self._set_status(slot, status_failed)
            return False
        slot.moving = False
        self._set_status(slot, status_after)
        return True

    async def _load(self, slot: ModelSlot) -> None:
        slot.attempt += 1
        slot.failed, slot.error, slot.engine_failed = False, None, None
        slot.apply_pending()  # a reload's changes to this model take effect now
        t0 = time.monotonic()
        log.info("model %s: loading from %s", slot.name, slot.path)

        def load() -> None:
            if self.fake_timing_s:
                time.sleep(self.fake_timing_s)
            slot.do_load()

        ok = await self._run(slot, LOADING, load, LOADED, UNLOADED)
        if not ok:
            slot.failed = True
            self._set_status(slot, UNLOADED)
            self.publish({"model": slot.name, "event": "model_status",
                          "data": {"status": UNLOADED, "failed": True, "error": slot.error}})
            log.error("model %s: loading failed: %s", slot.name, slot.error)
            await asyncio.to_thread(slot.do_unload)  # whatever the failed load had started
        else:
            slot.idle_since = time.monotonic()
            log.info("model %s: loaded in %.1f s", slot.name, time.monotonic() - t0)

    async def _unload(self, slot: ModelSlot) -> None:
        if slot.status not in (LOADED, SLEEPING) or slot.moving:
            return
        await self._run(slot, UNLOADING, slot.do_unload, UNLOADED, UNLOADED)
        slot.apply_pending()  # an unloaded model shows (and next loads with) what a reload read
        log.info("model %s: unloaded", slot.name)

    async def _sleep(self, slot: ModelSlot) -> bool:
        if slot.status != LOADED or slot.moving:
            return slot.status == SLEEPING
        return await self._run(slot, SLEEPING, slot.do_sleep, SLEEPING, LOADED)

    async def _wake(self, slot: ModelSlot) -> bool:
        ok = await self._run(slot, LOADING, slot.do_wake, LOADED, SLEEPING)
        if ok:
            slot.idle_since = time.monotonic()
        return ok

    # -- room --------------------------------------------------------------------------------------
    def _free_places(self, want: ModelSlot) -> int:
        if not self.models_max:
            return 1
        return self.models_max - sum(1 for s in self.slots if s.occupies and s is not want)

    def _giving_back(self) -> bool:
        return any(s.moving and s.status in (UNLOADING, SLEEPING) for s in self.slots)

    def _victim(self, want: ModelSlot) -> ModelSlot | None:
        idle = [s for s in self.slots if s is not want and s.status == LOADED and not s.moving and not s.in_flight]
        return min(idle, key=lambda s: s.last_used) if idle else None

    async def _make_room(self, victim: ModelSlot) -> None:
        if victim.model_suspend:
            log.info("model %s: going to sleep to make room", victim.name)
            if await self._sleep(victim):
                return
        log.info("model %s: unloading to make room", victim.name)
        await self._unload(victim)

    async def acquire(self, slot: ModelSlot, wake: bool = True) -> None:
        """Wait until `slot` is loaded (and, with `wake`, awake). The caller has counted itself in
        slot.in_flight. Raises EngineError 503 model_load_failed or request_queue_timeout."""
        deadline = time.monotonic() + ROOM_WAIT_S
        attempt = None
        try:
            while True:
                if self.stopping:
                    raise EngineError(503, "service_unavailable", "The server is stopping.")
                if slot.removed:
                    raise EngineError(404, "model_not_found", f"The model '{slot.name}' was removed from the "
                                      "catalog.", param="model")
                if slot.ready or (not wake and slot.status == SLEEPING and not slot.moving):
                    return
                if attempt is not None and slot.attempt == attempt and slot.failed and slot.status == UNLOADED:
                    raise EngineError(503, "model_load_failed",
                                      f"Loading the model '{slot.name}' failed: {slot.error}", param="model")
                if slot.moving or slot.status in (LOADING, UNLOADING):
                    pass  # a move is under way: wait for it
                elif slot.status == LOADED and slot.engine_failed is not None:
                    if slot.in_flight <= 1:  # only this request: the failed engine goes now
                        self._spawn(self._unload(slot))
                elif slot.status in (UNLOADED, SLEEPING):
                    if slot not in self._queue:
                        self._queue.append(slot)
                    if self._queue[0] is slot:
                        if self._free_places(slot) > 0:
                            self._queue.popleft()
                            slot.reserved = True  # until its load or wake task runs (slots.py)
                            if slot.status == UNLOADED:
                                attempt = slot.attempt + 1
                                self._spawn(self._load(slot))
                            else:
                                self._spawn(self._wake(slot))
                            self._notify()
                        elif not self._giving_back():  # one eviction at a time frees one place
                            victim = self._victim(slot)
                            if victim is not None:
                                self._spawn(self._make_room(victim))
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EngineError(503, "request_queue_timeout",
                                      f"No room to load the model '{slot.name}' within {ROOM_WAIT_S:.0f} s: "
                                      "the loaded models kept serving requests.")
                await self._wait_change(min(remaining, 1.0))
        finally:
            if slot.in_flight <= 1 and slot in self._queue:  # nobody else waits for it
                self._queue.remove(slot)
                self._notify()

    def enter(self, slot: ModelSlot) -> None:
        slot.in_flight += 1

    def leave(self, slot: ModelSlot, used: bool) -> None:
        slot.in_flight = max(0, slot.in_flight - 1)
        now = time.monotonic()
        if used:
            slot.last_used = now
        if slot.in_flight == 0:
            slot.idle_since = now
        self._notify()

    # -- the lifecycle API -------------------------------------------------------------------------
    def request_load(self, slot: ModelSlot) -> None:
        """POST /models/load: load (or wake) in the background through the room queue."""
        async def go() -> None:
            self.enter(slot)
            try:
                await self.acquire(slot)
            except EngineError:
                pass
            finally:
                self.leave(slot, used=True)

        self._spawn(go())

    def request_unload(self, slot: ModelSlot) -> None:
        """POST /models/unload: unload once its requests have finished."""
        async def go() -> None:
            while not self.stopping and (slot.in_flight or slot.moving):
                await self._wait_change(1.0)
            await self._unload(slot)

        self._spawn(go())

    async def sleep_now(self, slot: ModelSlot) -> None:
        """POST /models/sleep and /v1/models/{id}/suspend: 409 model_busy while it has requests."""
        if slot.in_flight:
            raise EngineError(409, "model_busy", f"The model '{slot.name}' has requests in flight; a suspend never "
                              "interrupts them. Retry once they have finished.", param="model")
        while slot.moving:
            await self._wait_change(1.0)
        if slot.status == SLEEPING:
            return
        if slot.status != LOADED:
            raise EngineError(400, "model_not_loaded", f"The model '{slot.name}' is not loaded.", param="model")
        slot.moving = True
        self._set_status(slot, SLEEPING)
        try:
            await asyncio.to_thread(slot.do_sleep)
        except BaseException:
            slot.moving = False
            self._set_status(slot, LOADED)
            raise
        slot.moving = False
        self._notify()

    async def resume_now(self, slot: ModelSlot) -> None:
        self.enter(slot)
        try:
            await self.acquire(slot)
        finally:
            self.leave(slot, used=False)

    async def reload(self) -> None:
        """GET /models?reload=1: read --models-dir / --models-preset again and merge the result.
        A catalog that fails its checks (the startup checks) changes nothing: EngineError 500."""
        if self.rebuild is None:
            return
        if self._reloading is None:
            self._reloading = asyncio.Lock()
        async with self._reloading:  # one reading at a time; a reload waits for the one under way
            try:
                fresh = await asyncio.to_thread(self.rebuild)
            except CatalogError as e:
                raise EngineError(500, "models_reload_failed", f"The catalog was not reloaded: {e}",
                                  type_="server_error") from None
            self._merge(fresh)

    def _merge(self, fresh: list[ModelSlot]) -> None:
        current = {s.name: s for s in self.slots}
        wanted = {s.name for s in fresh}
        for new in fresh:
            old = current.get(new.name)
            if old is None:
                self.slots.append(new)
                log.info("catalog reload: model %s added", new.name)
                self.publish({"model": new.name, "event": "model_status", "data": {"status": new.status}})
                continue
            if old.removed:  # removed by an earlier reload, back before it was gone
                old.removed = False
            old.set_aliases(new.aliases)
            if new.settings() != old.next_settings():
                old.pending = (new.path, new.args)
                if old.status == UNLOADED and not old.moving:
                    old.apply_pending()
                else:
                    log.info("catalog reload: model %s changed; the change applies at its next load", old.name)
        for old in self.slots:
            if old.name not in wanted and not old.removed:
                old.removed = True
                log.info("catalog reload: model %s removed; it leaves once its requests are gone", old.name)
        self._index()
        self.publish({"model": "*", "event": "models_reload"})
        self._notify()

    def on_engine_failure(self, slot: ModelSlot, reason: str) -> None:
        """From the Engine's worker thread: requests then get 503 engine_failed; unload once idle."""
        def mark() -> None:
            slot.engine_failed = reason
            slot.failed, slot.error = True, f"engine failed: {reason}"
            log.error("model %s: engine failed (%s); it is unloaded once its requests are gone", slot.name, reason)
            self._notify()

        if self.loop is not None:
            self.loop.call_soon_threadsafe(mark)

    async def shutdown(self) -> None:
        self.stopping = True
        self._notify()
        if self._idle_task is not None:
            self._idle_task.cancel()
        for s in self.slots:
            if s.loaded is not None:
                await asyncio.to_thread(s.do_unload)
                s.status = UNLOADED
