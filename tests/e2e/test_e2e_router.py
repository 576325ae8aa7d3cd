"""The router end to end: ninfer-tiny under several names behind one `ninfer serve --models-dir`.

Real server processes on loopback ports, the real openai and anthropic clients, httpx for the
llama.cpp and lifecycle routes.
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
CHAT = [{"role": "user", "content": "Say hello to the router."}]


@pytest.fixture
def models_dir(tmp_path) -> Path:
    d = tmp_path / "models"
    d.mkdir()
    for name in ("tiny-a", "tiny-b", "tiny-c"):
        os.symlink(TINY, d / f"{name}.ninfer")
    (d / "nested").mkdir()
    os.symlink(TINY, d / "nested" / "whatever.ninfer")
    (d / "two").mkdir()  # two artifacts: not a model
    os.symlink(TINY, d / "two" / "one.ninfer")
    os.symlink(TINY, d / "two" / "other.ninfer")
    (d / "broken.ninfer").write_bytes(b"not an artifact")
    return d


@pytest.fixture
def router(launch, tmp_path, models_dir):
    started = []

    def start(*flags: str):
        s = launch(None, "--models-dir", str(models_dir), "--log-stats-interval-ms", "0", "--greedy", *flags,
                   log_dir=tmp_path)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def status(base: str) -> dict[str, dict]:
    r = httpx.get(base + "/models", timeout=10)
    assert r.status_code == 200
    return {m["id"]: m for m in r.json()["data"]}


def wait_status(base: str, model: str, want: set[str], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while True:
        got = status(base)[model]["status"]["value"]
        if got in want or time.monotonic() > deadline:
            assert got in want, f"{model}: {got}, wanted {want}"
            return got
        time.sleep(0.05)


def chat(base: str, model: str | None, messages=CHAT, max_tokens: int = 8, **kw) -> httpx.Response:
    body = {"messages": messages, "max_tokens": max_tokens, **kw}
    if model is not None:
        body["model"] = model
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=120)


def err(r: httpx.Response) -> dict:
    return r.json()["error"]


def test_catalog_lists_stems_and_single_artifact_subdirectories(router):
    s = router()
    cat = status(s.base_url)
    assert set(cat) == {"tiny-a", "tiny-b", "tiny-c", "nested", "broken"}
    assert cat["nested"]["path"].endswith("nested/whatever.ninfer")
    assert all(m["status"]["value"] == "unloaded" for m in cat.values())
    props = httpx.get(s.base_url + "/props").json()
    assert props["role"] == "router" and props["max_instances"] == 1 and props["models_autoload"] is True


def test_two_models_concurrently_with_the_openai_client(router):
    import openai

    s = router("--models-max", "2")
    client = openai.OpenAI(base_url=s.api_base, api_key="x", max_retries=0)
    results: dict[str, object] = {}

    def run(model: str) -> None:
        results[model] = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8)

    threads = [threading.Thread(target=run, args=(m,)) for m in ("tiny-a", "tiny-b", "tiny-a", "tiny-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert {r.model for r in results.values()} == {"tiny-a", "tiny-b"}
    cat = status(s.base_url)
    assert cat["tiny-a"]["status"]["value"] == cat["tiny-b"]["status"]["value"] == "loaded"
    assert cat["tiny-a"]["max_model_len"] == 8192  # a loaded model carries the fields of /v1/models
    # no model named: the most recently used loaded one
    r = chat(s.base_url, None)
    assert r.status_code == 200 and r.json()["model"] in ("tiny-a", "tiny-b")


def test_lru_model_is_unloaded_to_make_room(router):
    s = router("--models-max", "2")
    assert chat(s.base_url, "tiny-a").status_code == 200
    assert chat(s.base_url, "tiny-b").status_code == 200
    assert chat(s.base_url, "tiny-a").status_code == 200  # tiny-b is now the least recently used
    assert chat(s.base_url, "tiny-c").status_code == 200
    cat = status(s.base_url)
    assert cat["tiny-b"]["status"]["value"] == "unloaded"
    assert cat["tiny-a"]["status"]["value"] == cat["tiny-c"]["status"]["value"] == "loaded"


def test_in_flight_model_is_never_interrupted(router):
    s = router("--models-max", "1")
    assert chat(s.base_url, "tiny-a").status_code == 200
    events: list[str] = []
    done: dict[str, httpx.Response] = {}

    def long_stream() -> None:
        with httpx.stream("POST", s.base_url + "/v1/chat/completions", timeout=120, json={
                "model": "tiny-a", "messages": CHAT, "max_tokens": 120, "stream": True,
                "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(line)
            done["a"] = r

    t = threading.Thread(target=long_stream)
    t.start()
    while not events:
        time.sleep(0.01)
    r_b = chat(s.base_url, "tiny-b")  # waits for tiny-a's stream, then takes its place
    t.join(120)
    assert done["a"].status_code == 200
    last = json.loads(events[-1][6:])
    assert any(c.get("finish_reason") == "length" for c in last["choices"]) or last.get("usage")
    assert r_b.status_code == 200 and r_b.json()["model"] == "tiny-b"
    assert status(s.base_url)["tiny-a"]["status"]["value"] == "unloaded"


def _residency(base: str, model: str) -> dict:
    r = httpx.get(f"{base}/v1/models/{model}/residency", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_sleep_keeps_prefix_reuse_and_gives_memory_back(router):
    s = router("--models-max", "1", "--model-suspend")
    first = chat(s.base_url, "tiny-a", max_tokens=6).json()
    turn2 = CHAT + [{"role": "assistant", "content": first["choices"][0]["message"]["content"] or "Hello."},
                    {"role": "user", "content": "And once more, please."}]
    before = chat(s.base_url, "tiny-a", messages=turn2, max_tokens=4).json()
    cached = before["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    again = chat(s.base_url, "tiny-a", messages=turn2, max_tokens=4).json()
    cached_awake = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    resident = _residency(s.base_url, "tiny-a")
    assert resident["state"] == "resident" and resident["device_bytes"] > 0
    assert chat(s.base_url, "tiny-b").status_code == 200  # tiny-a sleeps to make room
    asleep = _residency(s.base_url, "tiny-a")
    assert asleep["state"] == "suspended" and asleep["device_bytes"] == 0
    # --suspend-weights artifact (the default): the weights are not copied, the resume reads them
    # again from the artifact; of the KV pool only the pages in use are kept
    assert resident["suspend_weights"] == "artifact"
    assert 0 < asleep["host_snapshot_bytes"] < resident["releasable_device_bytes"] // 4
    assert asleep["last_suspend"]["state_bytes"] > 0
    assert asleep["last_suspend"]["weight_bytes"] < asleep["last_suspend"]["state_bytes"]  # tables computed at load
    assert status(s.base_url)["tiny-a"]["status"]["value"] == "sleeping"
    # read-only routes report it as it is and do not wake it
    props = httpx.get(s.base_url + "/props", params={"model": "tiny-a"}).json()
    assert props["is_sleeping"] is True
    assert httpx.post(s.base_url + "/tokenize", json={"model": "tiny-a", "content": "hi"}).status_code == 200
    assert _residency(s.base_url, "tiny-a")["state"] == "suspended"
    woke = chat(s.base_url, "tiny-a", messages=turn2, max_tokens=4).json()
    assert woke["usage"]["prompt_tokens_details"]["cached_tokens"] == cached_awake
    assert woke["choices"][0]["message"] == again["choices"][0]["message"]  # greedy: the same answer
    back = _residency(s.base_url, "tiny-a")
    assert back["state"] == "resident" and back["device_bytes"] == resident["device_bytes"]
    assert back["resume_count"] == 1 and back["host_snapshot_bytes"] == 0
    assert back["last_resume"]["artifact_read_bytes"] > 0
    assert status(s.base_url)["tiny-b"]["status"]["value"] == "sleeping"
    # a token count is no host-side route: it wakes its model (llama.cpp's test_sleep expects it)
    r = httpx.post(s.base_url + "/v1/messages/count_tokens", timeout=120,
                   json={"model": "tiny-b", "messages": [{"role": "user", "content": "Hello world"}]})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    assert status(s.base_url)["tiny-b"]["status"]["value"] == "loaded"
    assert status(s.base_url)["tiny-a"]["status"]["value"] == "sleeping"


def test_sleep_with_the_weights_on_the_host(router):
    s = router("--models-max", "1", "--model-suspend", "--suspend-weights", "host")
    before = chat(s.base_url, "tiny-a", max_tokens=6).json()
    resident = _residency(s.base_url, "tiny-a")
    assert resident["suspend_weights"] == "host"
    assert chat(s.base_url, "tiny-b").status_code == 200  # tiny-a sleeps to make room
    asleep = _residency(s.base_url, "tiny-a")
    assert asleep["state"] == "suspended"
    weights = asleep["last_suspend"]["weight_bytes"]
    assert weights > resident["releasable_device_bytes"] // 2  # the weights are most of the model
    assert asleep["host_snapshot_bytes"] == weights + asleep["last_suspend"]["state_bytes"]
    again = chat(s.base_url, "tiny-a", max_tokens=6).json()
    assert again["choices"][0]["message"] == before["choices"][0]["message"]
    back = _residency(s.base_url, "tiny-a")
    assert back["last_resume"]["artifact_read_bytes"] == 0 and back["last_resume"]["weight_bytes"] == weights


def test_suspend_and_resume_routes(router):
    s = router("--model-suspend", "--no-models-autoload")
    base = s.base_url
    assert httpx.post(base + "/models/load", json={"model": "tiny-a"}).json() == {"success": True}
    wait_status(base, "tiny-a", {"loaded"})
    r = httpx.post(base + "/v1/models/tiny-a/suspend", json={"auto_resume": False})
    assert r.status_code == 200 and r.json()["state"] == "suspended" and r.json()["auto_resume"] is False
    r = chat(base, "tiny-a")  # no auto_resume: 503
    assert r.status_code == 503 and err(r)["code"] == "model_not_loaded" and err(r)["param"] == "model"
    r = httpx.post(base + "/v1/models/tiny-a/resume", json={})
    assert r.status_code == 200 and r.json()["state"] == "resident"
    assert chat(base, "tiny-a").status_code == 200
    r = httpx.post(base + "/models/sleep", json={"model": "tiny-a"})
    assert r.status_code == 200 and status(base)["tiny-a"]["status"]["value"] == "sleeping"
    r = httpx.post(base + "/models/load", json={"model": "tiny-a"})  # load wakes a sleeping model
    assert r.status_code == 200
    wait_status(base, "tiny-a", {"loaded"})


def test_idle_timers_sleep_then_unload(router):
    s = router("--models-max", "0", "--model-suspend", "--sleep-idle-seconds", "1", "--unload-idle-seconds", "4")
    assert chat(s.base_url, "tiny-a").status_code == 200
    t0 = time.monotonic()
    wait_status(s.base_url, "tiny-a", {"sleeping"}, timeout=10)
    # polling the model does not keep it awake
    for _ in range(5):
        httpx.get(s.base_url + "/props", params={"model": "tiny-a"})
        httpx.get(s.base_url + "/v1/load", params={"model": "tiny-a"})
    wait_status(s.base_url, "tiny-a", {"unloaded"}, timeout=15)
    assert time.monotonic() - t0 >= 3.5


def test_sse_reports_status_changes(router):
    s = router()
    seen: list[dict] = []
    ready = threading.Event()

    def listen() -> None:
        with httpx.stream("GET", s.base_url + "/models/sse", timeout=30) as r:
            ready.set()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                    if seen[-1]["data"]["status"] == "loaded":
                        return

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    assert ready.wait(10)
    time.sleep(0.2)
    assert httpx.post(s.base_url + "/models/load", json={"model": "tiny-b"}).status_code == 200
    t.join(30)
    assert [e["data"]["status"] for e in seen] == ["loading", "loaded"]
    assert all(e["model"] == "tiny-b" and e["event"] == "model_status" for e in seen)


def _proc_counts(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def test_unload_leaks_no_threads_or_files(router):
    s = router("--models-max", "1")
    assert chat(s.base_url, "tiny-a").status_code == 200
    httpx.post(s.base_url + "/models/unload", json={"model": "tiny-a"})
    wait_status(s.base_url, "tiny-a", {"unloaded"})
    time.sleep(0.5)
    baseline = _proc_counts(s.proc.pid)
    for model in ("tiny-b", "tiny-c", "tiny-a"):  # each load evicts the one before
        assert chat(s.base_url, model).status_code == 200
    httpx.post(s.base_url + "/models/unload", json={"model": "tiny-a"})
    wait_status(s.base_url, "tiny-a", {"unloaded"})
    time.sleep(0.5)
    threads, files = _proc_counts(s.proc.pid)
    assert threads <= baseline[0] and files <= baseline[1], (baseline, (threads, files))


# -- every error path: status, code/type, param, and the server still serves -----------------------

def _still_serves(base: str) -> None:
    r = chat(base, "tiny-a")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def test_unknown_model_in_each_protocol(router):
    import anthropic
    import openai

    s = router()
    base = s.base_url
    with pytest.raises(openai.NotFoundError) as e:
        openai.OpenAI(base_url=s.api_base, api_key="x", max_retries=0).chat.completions.create(
            model="no-such-model", messages=CHAT, max_tokens=4)
    assert e.value.code == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(anthropic.NotFoundError) as e:
        anthropic.Anthropic(base_url=base, api_key="x", max_retries=0).messages.create(
            model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(base + "/completion", json={"model": "no-such-model", "prompt": "hi", "n_predict": 2})
    assert r.status_code == 404 and err(r)["code"] == "model_not_found" and err(r)["param"] == "model"
    r = httpx.get(base + "/props", params={"model": "no-such-model"})
    assert r.status_code == 404 and err(r)["code"] == "model_not_found"
    r = httpx.get(base + "/v1/models/no-such-model")
    assert r.status_code == 404 and err(r)["code"] == "model_not_found"
    _still_serves(base)


def test_no_autoload_and_the_autoload_query(router):
    s = router("--no-models-autoload")
    base = s.base_url
    r = chat(base, "tiny-a")
    assert r.status_code == 503 and err(r)["code"] == "model_not_loaded" and err(r)["param"] == "model"
    assert err(r)["type"] == "service_unavailable"
    r = httpx.get(base + "/slots", params={"model": "tiny-a"})  # reads never load
    assert r.status_code == 503 and err(r)["code"] == "model_not_loaded"
    r = httpx.post(base + "/v1/chat/completions?autoload=maybe", json={"model": "tiny-a", "messages": CHAT})
    assert r.status_code == 400 and err(r)["param"] == "autoload"
    r = httpx.post(base + "/v1/chat/completions?autoload=1", timeout=60,
                   json={"model": "tiny-a", "messages": CHAT, "max_tokens": 4})
    assert r.status_code == 200
    _still_serves(base)


def test_failed_load_is_reported_and_the_server_serves(router):
    s = router()
    base = s.base_url
    r = chat(base, "broken")
    assert r.status_code == 503 and err(r)["code"] == "model_load_failed" and err(r)["param"] == "model"
    entry = status(base)["broken"]
    assert entry["status"]["value"] == "unloaded" and entry["status"]["failed"] is True
    assert entry["status"]["error"]
    r = httpx.post(base + "/v1/messages", json={"model": "broken", "max_tokens": 4,
                                                "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error" \
        or r.json()["error"]["type"] in ("api_error", "service_unavailable")
    _still_serves(base)


def test_lifecycle_route_errors(router):
    s = router()
    base = s.base_url
    cases = [
        (httpx.post(base + "/models/load", json={}), 400, "missing_required_parameter", "model"),
        (httpx.post(base + "/models/load", json={"model": "nope"}), 404, "model_not_found", "model"),
        (httpx.post(base + "/models/unload", json={"model": "tiny-b"}), 400, "model_not_loaded", "model"),
        (httpx.post(base + "/models/sleep", json={"model": "tiny-a"}), 400, "model_suspend_disabled", "model"),
        (httpx.get(base + "/v1/models/tiny-a/residency"), 503, "model_not_loaded", "model"),
        (httpx.post(base + "/models/load", content=b"{not json"), 400, "invalid_json", None),
    ]
    for r, code, name, param in cases:
        assert r.status_code == code, r.text
        assert err(r)["code"] == name and err(r)["param"] == param
    _still_serves(base)


def test_sleep_of_a_busy_model_is_409(router):
    s = router("--model-suspend")
    base = s.base_url
    assert chat(base, "tiny-a").status_code == 200
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=120, json={
                "model": "tiny-a", "messages": CHAT, "max_tokens": 150, "stream": True, "ignore_eos": True}) as r:
            for _ in r.iter_lines():
                started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    r = httpx.post(base + "/models/sleep", json={"model": "tiny-a"})
    r2 = httpx.post(base + "/v1/models/tiny-a/suspend", json={})
    t.join(120)
    assert r.status_code == 409 and err(r)["code"] == "model_busy" and err(r)["param"] == "model"
    assert r2.status_code == 409 and err(r2)["code"] == "model_busy"
    _still_serves(base)


def test_preset_file(launch, tmp_path, models_dir):
    preset = tmp_path / "models.ini"
    shutil.copy(TINY, tmp_path / "elsewhere.ninfer")
    preset.write_text(
        "; llama.cpp's preset format\n"
        "[*]\n"
        "max-context = 2048\n"
        "# a model of --models-dir needs no path\n"
        "[tiny-a]\n"
        "alias = first, primo\n"
        "max-context = 1024\n"
        "load-on-startup = true\n"
        "[far]\n"
        "model = elsewhere.ninfer\n"
        "model-suspend = true\n"
        "max-concurrency = 2\n")
    s = launch(None, "--models-dir", str(models_dir), "--models-preset", str(preset), "--models-max", "0",
               "--log-stats-interval-ms", "0", "--max-concurrency", "3", log_dir=tmp_path)
    try:
        wait_status(s.base_url, "tiny-a", {"loaded"})  # load-on-startup
        r = chat(s.base_url, "primo")  # an alias routes to its model
        assert r.status_code == 200 and r.json()["model"] in ("primo", "tiny-a")
        assert status(s.base_url)["tiny-a"]["max_model_len"] == 1024  # its section over [*]
        assert chat(s.base_url, "far").status_code == 200
        assert status(s.base_url)["far"]["max_model_len"] == 2048
        # the command line wins over the preset
        assert httpx.get(s.base_url + "/props", params={"model": "far"}).json()["total_slots"] == 3
        assert httpx.post(s.base_url + "/models/sleep", json={"model": "far"}).status_code == 200
    finally:
        s.stop()


def test_bad_preset_fails_startup(launch, tmp_path, models_dir):
    import subprocess
    import sys

    preset = tmp_path / "bad.ini"
    for text, needle in (("[x]\nmodel = a.ninfer\nno-such-option = 1\n", "unknown option"),
                         ("[x]\nmodel = a.ninfer\nmax-context = many\n", "max-context"),
                         ("[ghost]\nalias = g\n", "no model = PATH"),
                         ("[x]\nmodel = a.ninfer\nport = 9\n", "router's own option")):
        preset.write_text(text)
        p = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "serve", "--models-preset", str(preset),
                            "--port", "0"], capture_output=True, text=True, timeout=60, check=False)
        assert p.returncode == 1 and needle in p.stderr, p.stderr


def test_oversized_chunked_body_is_413(router):
    s = router("--max-request-mib", "1")

    def chunks():
        yield b'{"model": "tiny-a", "messages": [{"role": "user", "content": "'
        for _ in range(20):
            yield b"x" * 65536 * 2
        yield b'"}]}'

    r = httpx.post(s.base_url + "/v1/chat/completions", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and err(r)["code"] == "request_too_large"
    assert status(s.base_url)["tiny-a"]["status"]["value"] == "unloaded"  # nothing loaded for it
    _still_serves(s.base_url)


def test_each_model_writes_its_own_request_log_and_stats_line(router, tmp_path):
    log_path = tmp_path / "requests.jsonl"
    s = router("--models-max", "1", "--request-log-jsonl", str(log_path), "--log-stats-interval-ms", "200")
    assert chat(s.base_url, "tiny-a").status_code == 200
    assert chat(s.base_url, "tiny-b").status_code == 200  # tiny-a unloads: its file is closed
    assert chat(s.base_url, "tiny-a").status_code == 200  # loaded again: appended, a new server_start
    assert not log_path.exists()  # no shared file: one per model
    records = {}
    for name in ("tiny-a", "tiny-b"):
        lines = (tmp_path / f"requests.{name}.jsonl").read_text().splitlines()
        records[name] = [json.loads(line) for line in lines]
        assert records[name][0]["event"] == "server_start"
        text = "\n".join(lines)
        assert "Say hello to the router" not in text  # no prompt in the log
    a, b = records["tiny-a"], records["tiny-b"]
    assert [r["event"] for r in a].count("server_start") == 2
    assert [r["event"] for r in a].count("request_done") == 2 and [r["event"] for r in b].count("request_done") == 1
    assert all(r["endpoint"] == "/v1/chat/completions" for r in a + b if r["event"] == "request_done")
    deadline = time.monotonic() + 10
    while "stats tiny-a | " not in s.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "stats tiny-a | " in s.log() and "stats tiny-b | " in s.log()


def test_a_request_log_in_a_missing_directory_fails_startup(launch, tmp_path, models_dir):
    with pytest.raises(RuntimeError) as e:
        launch(None, "--models-dir", str(models_dir), "--request-log-jsonl", str(tmp_path / "nowhere" / "r.jsonl"),
               log_dir=tmp_path)
    assert "rc=1" in str(e.value) and "error: model " in str(e.value) and "does not exist" in str(e.value)


def test_count_tokens_without_model_uses_the_most_recently_used_model(router):
    """A count that names no model goes where every other route's request goes: the most recently
    used loaded (or sleeping) model, woken first; with none loaded, 400 model_required in
    Anthropic's envelope."""
    s = router("--models-max", "1", "--model-suspend")
    base = s.base_url
    body = {"messages": [{"role": "user", "content": "Count me."}]}
    r = httpx.post(base + "/v1/messages/count_tokens", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["code"] == "model_required" and r.json()["error"]["param"] == "model"
    assert chat(base, "tiny-b").status_code == 200
    assert httpx.post(base + "/models/sleep", json={"model": "tiny-b"}).status_code == 200
    r = httpx.post(base + "/v1/messages/count_tokens", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    cat = status(base)
    assert cat["tiny-b"]["status"]["value"] == "loaded"  # woken for the count
    assert cat["tiny-a"]["status"]["value"] == "unloaded"
    named = httpx.post(base + "/v1/messages/count_tokens", json={"model": "tiny-b", **body}, timeout=60)
    assert named.json() == r.json()
