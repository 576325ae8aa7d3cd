"""The router's ModelManager against a backend that records what it holds: --models-max holds when
several waiters are woken by the same change (the room queue's race), and the reload merge.

The backend's load and unload run in the manager's worker threads like a real model's; they hold
no model, so the event loop's order of events is what is tested. The end-to-end router tests
(tests/e2e/test_e2e_router*.py) serve real models.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from ninfer_core.router.manager import ModelManager
from ninfer_core.router.slots import LOADED, UNLOADED, Loaded, ModelSlot


class CountingBackend:
    def __init__(self):
        self.lock = threading.Lock()
        self.held: set[str] = set()
        self.most = 0
        self.loads: list[str] = []

    def load(self, slot: ModelSlot) -> Loaded:
        with self.lock:
            self.held.add(slot.name)
            self.most = max(self.most, len(self.held))
            self.loads.append(slot.name)
        return Loaded(ctx=None, app=None, loader=None, residency=None)

    def unload(self, slot: ModelSlot, loaded: Loaded) -> None:
        with self.lock:
            self.held.discard(slot.name)


def _slot(name: str, backend, path: str = "/models/x.ninfer", argv=()) -> ModelSlot:
    return ModelSlot(name, (), path, SimpleNamespace(serve_argv_model=list(argv)), backend)


async def _hold(m: ModelManager, slot: ModelSlot) -> None:
    m.enter(slot)
    await m.acquire(slot)


def test_waiters_woken_together_take_one_place_each_in_turn():
    """llama.cpp's test_router_queue_is_fifo: with --models-max 1, two waiters queued behind a
    busy model must load one after the other; the second woken by the change that gave the first
    its place used to see the place still free (the first's load had not started) and load too."""
    backend = CountingBackend()
    a, b, c = (_slot(n, backend) for n in "abc")

    async def scenario() -> None:
        m = ModelManager([a, b, c], models_max=1, autoload=True)
        m.start()
        await _hold(m, a)  # a is loaded and busy
        tb = asyncio.create_task(_hold(m, b))
        await asyncio.sleep(0.05)
        tc = asyncio.create_task(_hold(m, c))
        await asyncio.sleep(0.05)
        assert a.status == LOADED and b.status == c.status == UNLOADED  # both wait for a
        m.leave(a, used=True)  # a is evicted; b takes the place
        await asyncio.wait_for(tb, 30)
        await asyncio.sleep(0.2)
        assert b.ready and c.status == UNLOADED and not tc.done()  # c waits for b's request
        m.leave(b, used=True)
        await asyncio.wait_for(tc, 30)
        assert c.ready and b.status == UNLOADED
        m.leave(c, used=True)
        await m.shutdown()

    asyncio.run(scenario())
    assert backend.loads == ["a", "b", "c"]
    assert backend.most == 1


def test_reload_merge_adds_removes_and_defers_changes():
    backend = CountingBackend()
    keep, gone = _slot("keep", backend, argv=["--max-context", "1024"]), _slot("gone", backend)

    async def scenario() -> None:
        m = ModelManager([keep, gone], models_max=0, autoload=True)
        m.start()
        await _hold(m, keep)
        await _hold(m, gone)
        events = m.subscribe()
        fresh = [_slot("keep", backend, argv=["--max-context", "512"]), _slot("new", backend)]
        m.rebuild = lambda: fresh
        await m.reload()
        assert [s.name for s in m.listed()] == ["keep", "new"]
        assert m.find("gone") is None and m.find("new") is fresh[1]
        assert keep.settings()[1] == ["--max-context", "1024"]  # loaded: as it was loaded
        assert keep.next_settings()[1] == ["--max-context", "512"]
        m.leave(gone, used=True)  # its request finished: it unloads and leaves
        for _ in range(200):
            if gone not in m.slots:
                break
            await asyncio.sleep(0.05)
        assert gone not in m.slots and "gone" not in backend.held
        seen = []
        while not events.empty():
            seen.append(events.get_nowait())
        assert any('"models_reload"' in e for e in seen) and any('"model_remove"' in e for e in seen)
        m.leave(keep, used=True)
        await m._unload(keep)
        assert keep.settings()[1] == ["--max-context", "512"]  # unloaded: the new arguments
        await m.shutdown()

    asyncio.run(scenario())
