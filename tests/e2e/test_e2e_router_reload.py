"""GET /models?reload=1 (llama.cpp's router: the catalog read again while serving) and the preset's
dedup-cache-models, end to end: real `ninfer serve --models-dir --models-preset` processes on
loopback, httpx for the lifecycle routes and the SSE stream, the openai client for generation.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ninfer_tiny", reason="the router tests serve ninfer-tiny (plugins/tiny)")

TINY = Path(__file__).resolve().parents[2] / "plugins/tiny/ninfer_tiny/data/ninfer-tiny.ninfer"
CHAT = [{"role": "user", "content": "Say hello."}]


def catalog(base: str, reload: bool = False) -> dict[str, dict]:
    r = httpx.get(base + "/models" + ("?reload=1" if reload else ""), timeout=60)
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


def chat(base: str, model: str, timeout: float = 120) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": 4},
                      timeout=timeout)


def wait_for(pred, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


class Events:
    """GET /models/sse collected on a thread."""

    def __init__(self, base: str):
        self.items: list[dict] = []
        self.ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(base,), daemon=True)
        self._thread.start()
        assert self.ready.wait(30)

    def _run(self, base: str) -> None:
        try:
            with httpx.stream("GET", base + "/models/sse", timeout=None) as r:
                for line in r.iter_lines():
                    if line.startswith(": connected"):
                        self.ready.set()
                    if line.startswith("data: "):
                        self.items.append(json.loads(line[6:]))
        except httpx.HTTPError:  # the server stopped at the end of the test
            pass

    def seen(self, **want) -> bool:
        return any(all(e.get(k) == v for k, v in want.items()) for e in list(self.items))


def test_reload_adds_removes_and_changes_models(launch, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    os.symlink(TINY, models / "dir-a.ninfer")
    preset = tmp_path / "models.ini"
    preset.write_text("[*]\nmax-context = 2048\n"
                      f"[keep]\nmodel = {TINY}\nmax-context = 1024\n"
                      f"[gone]\nmodel = {TINY}\n")
    # NINFER_DEBUG_FAKE_TIMING: every routed request waits 2 s, so one stays in flight across the reload
    s = launch(None, "--models-dir", str(models), "--models-preset", str(preset), "--models-max", "0",
               "--log-stats-interval-ms", "0", log_dir=tmp_path, env={"NINFER_DEBUG_FAKE_TIMING": "1"})
    try:
        base = s.base_url
        assert set(catalog(base)) == {"dir-a", "keep", "gone"}
        assert chat(base, "keep").status_code == 200
        assert chat(base, "gone").status_code == 200
        assert catalog(base)["keep"]["max_model_len"] == 1024
        events = Events(base)

        busy: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: busy.update(r=chat(base, "gone")))
        t.start()
        # let it be routed into its 2 s wait: if the reload still came first, it would be a 404 and fail below
        time.sleep(1.0)
        os.symlink(TINY, models / "dir-b.ninfer")
        preset.write_text("[*]\nmax-context = 2048\n"
                          f"[keep]\nmodel = {TINY}\nmax-context = 512\nalias = kept\n"
                          f"[fresh]\nmodel = {TINY}\nload-on-startup = true\n")
        cat = catalog(base, reload=True)
        # a new model is listed unloaded (load-on-startup is for startup only); a removed one is gone
        assert set(cat) == {"dir-a", "dir-b", "keep", "fresh"}
        assert cat["fresh"]["status"]["value"] == cat["dir-b"]["status"]["value"] == "unloaded"
        # a changed model keeps serving as it was loaded; the change applies at its next load
        assert cat["keep"]["status"]["value"] == "loaded" and cat["keep"]["max_model_len"] == 1024
        # the event reaches the SSE reader thread on its own schedule (a loaded machine lags it)
        wait_for(lambda: events.seen(model="*", event="models_reload"))
        r = chat(base, "kept")  # a new alias serves at once, by the loaded model
        assert r.status_code == 200 and "kept" in catalog(base)["keep"]["aliases"]
        r = chat(base, "gone")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        t.join(120)
        assert busy["r"].status_code == 200  # the request in flight on the removed model finished
        wait_for(lambda: events.seen(model="gone", event="model_remove"))
        assert events.seen(model="gone", event="model_status", data={"status": "unloaded"})
        assert "gone" not in catalog(base)

        assert httpx.post(base + "/models/unload", json={"model": "keep"}).status_code == 200
        wait_for(lambda: catalog(base)["keep"]["status"]["value"] == "unloaded")
        assert "512" in catalog(base)["keep"]["status"]["args"]  # the arguments its next load uses
        assert chat(base, "keep").status_code == 200
        assert catalog(base)["keep"]["max_model_len"] == 512
        assert chat(base, "fresh").status_code == 200
        assert catalog(base)["fresh"]["max_model_len"] == 2048

        # a catalog that fails the startup checks changes nothing
        preset.write_text(f"[keep]\nmodel = {TINY}\nno-such-option = 1\n")
        r = httpx.get(base + "/models?reload=1", timeout=60)
        assert r.status_code == 500 and r.json()["error"]["code"] == "models_reload_failed"
        assert "no-such-option" in r.json()["error"]["message"]
        assert set(catalog(base)) == {"dir-a", "dir-b", "keep", "fresh"}
        r = httpx.get(base + "/models?reload=maybe", timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"
        assert r.json()["error"]["param"] == "reload"
        assert chat(base, "keep").status_code == 200
    finally:
        s.stop()


def test_dedup_cache_models_folds_directory_models_into_the_preset_model(launch, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(TINY, models / "cached.ninfer")
    os.symlink(models / "cached.ninfer", models / "cached-link.ninfer")  # the same file under another name
    shutil.copy(TINY, models / "other.ninfer")  # another file
    preset = tmp_path / "models.ini"
    preset.write_text(f"[main]\nmodel = {models / 'cached.ninfer'}\ndedup-cache-models = true\nmax-context = 1024\n")
    s = launch(None, "--models-dir", str(models), "--models-preset", str(preset), "--log-stats-interval-ms", "0",
               log_dir=tmp_path)
    try:
        base = s.base_url
        cat = catalog(base)
        assert set(cat) == {"main", "other"}
        assert {"cached", "cached-link"} <= set(cat["main"]["aliases"])
        # a folded name still serves, through the one model
        r = httpx.post(base + "/tokenize", json={"model": "cached", "content": "hello"}, timeout=60)
        assert r.status_code == 200 and r.json()["tokens"]
        assert chat(base, "cached-link").status_code == 200
        assert catalog(base)["main"]["status"]["value"] == "loaded"
        assert catalog(base)["main"]["max_model_len"] == 1024

        preset.write_text(f"[main]\nmodel = {models / 'cached.ninfer'}\n")  # without the key: three models
        assert set(catalog(base, reload=True)) == {"main", "cached", "cached-link", "other"}
        # in [*], and a directory model with a section of its own is configured, not folded
        preset.write_text("[*]\ndedup-cache-models = 1\n"
                          f"[main]\nmodel = {models / 'cached.ninfer'}\n"
                          "[cached-link]\nmax-context = 512\n")
        assert set(catalog(base, reload=True)) == {"main", "cached-link", "other"}
        preset.write_text(f"[main]\nmodel = {models / 'cached.ninfer'}\ndedup-cache-models = maybe\n")
        r = httpx.get(base + "/models?reload=1", timeout=60)
        assert r.status_code == 500 and "dedup-cache-models" in r.json()["error"]["message"]
    finally:
        s.stop()
