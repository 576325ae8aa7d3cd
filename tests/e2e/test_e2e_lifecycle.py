"""Stopping and failing on a real server (spec "Stop the server", "Startup readiness"): Ctrl+C twice,
one Ctrl+C that expires, SIGTERM with a request running, a Ctrl+C during startup; the engine failure
latch (503 engine_failed, exit status 2), out-of-memory and --recover-invariant-failures recoveries
counted in ninfer:engine_recoveries_total. Worker faults are injected by tests/ninfer_faults/plugin.py."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.timeout(600)
HI = [{"role": "user", "content": "Hi"}]
FAULT_PLUGINS = ("--plugin", "qwen35", "--plugin", "ninfer_faults.plugin")
# tests/ on the server's path, so `--plugin ninfer_faults.plugin` imports tests/ninfer_faults/plugin.py
FAULT_ENV = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                            os.environ.get("PYTHONPATH", "")])}
INVARIANT, OOM = "FAULT-INVARIANT", "FAULT-OOM"  # the stop strings tests/ninfer_faults/plugin.py reacts to


def _recoveries(base: str) -> float:
    line = next(ln for ln in httpx.get(base + "/metrics", timeout=30).text.splitlines()
                if ln.startswith("ninfer:engine_recoveries_total "))
    return float(line.split()[1])


def _chat(base: str, **extra) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", timeout=120,
                      json={"messages": HI, "max_tokens": 3, "temperature": 0, **extra})


def _wait_exit(server, timeout: float = 60.0) -> int | None:
    try:
        return server.proc.wait(timeout)
    except Exception:  # noqa: BLE001 - TimeoutExpired: reported as None
        return None


def test_ctrl_c_once_prompts_and_serving_goes_on_twice_stops(start_server):
    s = start_server()
    s.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert "Press Ctrl+C again within 5 s to close" in s.log()
    assert _chat(s.base_url).status_code == 200  # still serving
    time.sleep(5.5)  # the window passes: the next press prompts again instead of stopping
    s.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert s.proc.poll() is None and s.log().count("Press Ctrl+C again within 5 s") == 2
    s.proc.send_signal(signal.SIGINT)
    assert _wait_exit(s) == 0
    log = s.log()
    assert "stopping (Ctrl+C pressed twice)" in log and "server stopped" in log


def test_sigterm_stops_at_once_and_a_running_stream_gets_an_error_event(start_server):
    s = start_server()
    events: list[str] = []
    with httpx.Client(timeout=120) as c, c.stream("POST", s.base_url + "/v1/chat/completions", json={
            "messages": HI, "max_tokens": 2000, "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(line)
                if len(events) == 3:
                    s.proc.send_signal(signal.SIGTERM)
    assert any('"service_unavailable"' in e or "shutting down" in e for e in events[3:]), events[-3:]
    assert _wait_exit(s) == 0
    assert "stopping (SIGTERM received)" in s.log()


def test_one_ctrl_c_during_startup_ends_it(start_server):
    s = start_server(wait_ready=False)
    s.proc.send_signal(signal.SIGINT)
    rc = _wait_exit(s, 60)
    assert rc == 0, s.log()
    assert "interrupted during startup" in s.log()


def test_a_worker_failure_latches_the_engine_and_exits_with_status_2(start_server):
    s = start_server(*FAULT_PLUGINS, env=FAULT_ENV)
    r = _chat(s.base_url, stop=[INVARIANT])
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "engine_failed" and r.headers["retry-after"] == "2"
    assert _wait_exit(s) == 2
    log = s.log()
    assert "engine | worker failure: RuntimeError: injected invariant failure" in log
    assert "the server stops (exit status 2)" in log


def test_recoveries_keep_serving_and_are_counted(start_server):
    s = start_server(*FAULT_PLUGINS, "--recover-invariant-failures", env=FAULT_ENV)
    base = s.base_url
    assert _recoveries(base) == 0
    r = _chat(base, stop=[INVARIANT])
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert _chat(base).status_code == 200
    r = _chat(base, stop=[OOM])
    assert r.status_code == 503 and r.json()["error"]["code"] == "out_of_memory" and r.headers["retry-after"] == "2"
    r = httpx.post(base + "/v1/messages", timeout=120, json={"model": "m", "max_tokens": 3, "messages": HI,
                                                            "stop_sequences": [OOM]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "out_of_memory"  # the Anthropic envelope
    assert r.json()["type"] == "error"
    assert _chat(base).status_code == 200
    assert _recoveries(base) == 3
    assert httpx.get(base + "/health", timeout=30).status_code == 200
    log = s.log()
    assert "engine | recovering from out of memory" in log and "engine | recovered from a broken invariant" in log
    assert s.stop() == 0


def test_out_of_memory_is_recovered_without_the_flag(start_server):
    s = start_server(*FAULT_PLUGINS, env=FAULT_ENV)
    r = _chat(s.base_url, stop=[OOM])
    assert r.status_code == 503 and r.json()["error"]["code"] == "out_of_memory"
    assert _chat(s.base_url).status_code == 200 and _recoveries(s.base_url) == 1
    assert s.stop() == 0
