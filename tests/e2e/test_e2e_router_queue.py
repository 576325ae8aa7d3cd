"""The router's room queue against clients that leave, found by llama.cpp's
test_router_queue_client_disconnect_keeps_model: a request that disconnects while it waits for
room gives its place up, so no model is evicted for nobody.

NINFER_DEBUG_FAKE_TIMING=1 (llama.cpp's LLAMA_SERVER_DEBUG_FAKE_TIMING) makes every load and
every routed request take 2 s longer, which holds a model busy for a known time.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ninfer_tiny", reason="the router tests serve ninfer-tiny (plugins/tiny)")

TINY = Path(__file__).resolve().parents[2] / "plugins/tiny/ninfer_tiny/data/ninfer-tiny.ninfer"


@pytest.fixture
def router(launch, tmp_path):
    d = tmp_path / "models"
    d.mkdir()
    for name in ("tiny-a", "tiny-b"):
        os.symlink(TINY, d / f"{name}.ninfer")
    s = launch(None, "--models-dir", str(d), "--models-max", "1", "--log-stats-interval-ms", "0",
               log_dir=tmp_path, env={"NINFER_DEBUG_FAKE_TIMING": "1"})
    yield s
    s.stop()


def statuses(base: str) -> dict[str, str]:
    r = httpx.get(base + "/models", timeout=10)
    assert r.status_code == 200
    return {m["id"]: m["status"]["value"] for m in r.json()["data"]}


def tokenize(base: str, model: str, timeout: float = 120) -> httpx.Response:
    return httpx.post(base + "/tokenize", json={"model": model, "content": "hello world"}, timeout=timeout)


def test_a_waiter_that_disconnects_gives_its_place_up(router):
    base = router.base_url
    assert httpx.post(base + "/models/load", json={"model": "tiny-a"}, timeout=10).json() == {"success": True}
    deadline = time.monotonic() + 60
    while statuses(base)["tiny-a"] != "loaded":
        assert time.monotonic() < deadline
        time.sleep(0.05)

    busy: dict = {}
    t0 = time.monotonic()
    worker = threading.Thread(target=lambda: busy.update(r=tokenize(base, "tiny-a")))
    worker.start()
    time.sleep(0.5)  # tiny-a now has a request in flight (2 s of fake timing)
    with pytest.raises(httpx.TimeoutException):
        tokenize(base, "tiny-b", timeout=1.0)  # waits for room behind tiny-a, then leaves
    worker.join(30)
    assert busy["r"].status_code == 200 and busy["r"].json()["tokens"]
    assert time.monotonic() - t0 >= 2.0  # the fake timing held tiny-a busy
    time.sleep(3)  # without the fix the abandoned waiter evicts tiny-a here and loads tiny-b
    assert statuses(base) == {"tiny-a": "loaded", "tiny-b": "unloaded"}
    # the server still serves both models: a waiter that stays is served
    r = tokenize(base, "tiny-b")
    assert r.status_code == 200 and r.json()["tokens"]
    assert statuses(base) == {"tiny-a": "unloaded", "tiny-b": "loaded"}
