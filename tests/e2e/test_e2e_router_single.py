"""The lifecycle API and model suspend on a single-model server (its catalog is its one model)."""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("ninfer_tiny", reason="the router tests serve ninfer-tiny (plugins/tiny)")


def _props(base: str) -> dict:
    r = httpx.get(base + "/props", timeout=10)
    assert r.status_code == 200
    return r.json()


def _wait(pred, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_idle_sleep_wake_unload_and_reload(launch, tmp_path):
    s = launch(None, "--model-suspend", "--sleep-idle-seconds", "1", "--log-stats-interval-ms", "0", log_dir=tmp_path)
    try:
        base = s.base_url
        _wait(lambda: _props(base)["is_sleeping"])
        assert httpx.get(base + "/health").status_code == 200  # reads answer and do not wake it
        models = httpx.get(base + "/models").json()["data"]
        assert len(models) == 1 and models[0]["status"]["value"] == "sleeping"
        res = httpx.get(f"{base}/v1/models/{models[0]['id']}/residency").json()
        assert res["state"] == "suspended" and res["device_bytes"] == 0 and res["host_snapshot_bytes"] > 0
        r = httpx.post(base + "/completion", json={"prompt": "Hello", "n_predict": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 2
        assert _props(base)["is_sleeping"] is False
        name = models[0]["id"]
        assert httpx.post(base + "/models/unload", json={"model": name}).json() == {"success": True}
        _wait(lambda: httpx.get(base + "/models").json()["data"][0]["status"]["value"] == "unloaded")
        r = httpx.post(base + "/completion", json={"prompt": "Hello", "n_predict": 2}, timeout=60)
        assert r.status_code == 200  # loads again into the same server
        r = httpx.post(base + "/models/load", json={"model": "other"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    finally:
        s.stop()


def test_suspend_needs_the_option(launch, tmp_path):
    s = launch(None, "--log-stats-interval-ms", "0", log_dir=tmp_path)
    try:
        name = httpx.get(s.base_url + "/models").json()["data"][0]["id"]
        r = httpx.post(f"{s.base_url}/v1/models/{name}/suspend", json={})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_suspend_disabled"
        assert r.json()["error"]["param"] == "model"
        assert httpx.post(s.base_url + "/completion", json={"prompt": "Hi", "n_predict": 1}).status_code == 200
    finally:
        s.stop()


def test_count_tokens_without_model_wakes_the_one_model(launch, tmp_path):
    """llama.cpp's test_server_sleep_token_counting_wake: every token count wakes a sleeping model,
    Anthropic's count_tokens too, whose body may leave `model` out (the server's one model)."""
    import anthropic

    s = launch(None, "--model-suspend", "--sleep-idle-seconds", "1", "--log-stats-interval-ms", "0", log_dir=tmp_path)
    try:
        base = s.base_url
        client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
        named = client.messages.count_tokens(model="any-label", messages=[{"role": "user", "content": "Hello world"}])
        _wait(lambda: _props(base)["is_sleeping"])
        r = httpx.post(base + "/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": "Hello world"}]},
                       timeout=60)
        assert r.status_code == 200 and r.json() == {"input_tokens": named.input_tokens}
        assert _props(base)["is_sleeping"] is False
        r = httpx.post(base + "/v1/messages/count_tokens", json={"model": 7, "messages": []}, timeout=60)
        e = r.json()
        assert r.status_code == 400 and e["type"] == "error" and e["error"]["type"] == "invalid_request_error"
        assert e["error"]["code"] == "invalid_type" and e["error"]["param"] == "model"
        assert r.headers["request-id"] == e["request_id"]
    finally:
        s.stop()
