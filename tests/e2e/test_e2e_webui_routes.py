"""End-to-end: the routes llama.cpp's WebUI calls, on the real server (tiny random Qwen3.5 artifact).

Static serving with --webui-dir (no API key for the files, the API still asks), /tools 403
feature_disabled, resumable streams (X-Conversation-Id, /v1/streams/lookup, GET and DELETE
/v1/stream), the reasoning_end control, return_progress and timings_per_token on the Chat
Completions and llama.cpp streams, and the --webui-mcp-proxy relay. The model has random weights,
so its thinking never closes by itself: only the control can close it. The headless-browser test
of the built WebUI is tests/e2e/test_e2e_webui_browser.py.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from ninfer_core.server.prepare import BUDGET_MESSAGE

pytestmark = pytest.mark.timeout(300)
KEY = "webui-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "Count to three."}]


@pytest.fixture(scope="module")
def webui_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("webui")
    (d / "index.html").write_text("<!doctype html><title>llama-ui</title>")
    (d / "_app").mkdir()
    (d / "_app" / "bundle.js").write_text("console.log('ui')")
    return d


@pytest.fixture(scope="module")
def server(tiny_artifact, webui_dir, tmp_path_factory, launch):
    s = launch(tiny_artifact, "--api-key", KEY, "--webui-dir", str(webui_dir), "--webui-mcp-proxy",
               "--prefill-chunk", "16", log_dir=tmp_path_factory.mktemp("webui-server"))
    yield s
    s.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=120) as c:
        yield c


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def assert_error(r, status: int, code: str, param: str | None, type_: str = "invalid_request_error"):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == param and err["type"] == type_, err


def wait_idle(http, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        r = http.get("/v1/load").json()["requests"]
        if r["running"] == 0 and r["admitted"] == 0 and r["waiting"] == 0:
            return
        assert time.monotonic() < deadline, r
        time.sleep(0.05)


def assert_serves(http):
    r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"


# -- static files --------------------------------------------------------------------------------------

def test_static_files_need_no_key_and_the_api_still_does(server, webui_dir):
    with httpx.Client(base_url=server.base_url, timeout=30) as anon:
        root = anon.get("/")
        assert root.status_code == 200 and "llama-ui" in root.text and root.headers["cache-control"] == "no-cache"
        assert anon.get("/_app/bundle.js").text == "console.log('ui')"
        assert anon.head("/").status_code == 200
        # the UI's client-side routes get the entry page; nothing leaves the directory
        assert "llama-ui" in anon.get("/chat/123").text
        assert "llama-ui" in anon.get("/%2e%2e/%2e%2e/etc/passwd").text
        for path in ("/v1/models", "/props", "/tools", "/slots", "/v1/streams/lookup"):
            method = "POST" if path.endswith("lookup") else "GET"
            assert anon.request(method, path).status_code == 401, path
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=30) as c:
        assert_error(c.get("/v1/nope"), 404, "not_found", None)
        assert_error(c.post("/nope"), 404, "not_found", None)
        assert_error(c.get("/v1/chat/completions"), 405, "method_not_allowed", None)
        assert c.get("/props").json()["cors_proxy_enabled"] is True


def test_webui_startup_options(tiny_artifact, tmp_path, launch, live_server):
    assert httpx.get(live_server.base_url + "/props").json()["cors_proxy_enabled"] is False
    assert httpx.get(live_server.base_url + "/cors-proxy", params={"url": "http://x"}).status_code == 403
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "serve", tiny_artifact, "--port", "0",
                          "--webui-dir", str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "--webui-dir" in out.stderr and "index.html" in out.stderr
    out = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "serve", tiny_artifact, "--port", "0",
                          "--webui-dir", str(tmp_path), "--no-webui"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "exclude each other" in out.stderr
    off = launch(tiny_artifact, "--no-webui", log_dir=tmp_path)
    try:
        assert httpx.get(off.base_url + "/").status_code == 404
    finally:
        off.stop()


# -- /tools ----------------------------------------------------------------------------------------------

def test_tools_is_feature_disabled(http):
    for method in ("GET", "POST"):
        r = http.request(method, "/tools", json={"tool": "file_glob_search", "params": {}})
        assert_error(r, 403, "feature_disabled", None, type_="feature_disabled")
    assert_serves(http)


# -- resumable streams -------------------------------------------------------------------------------------

def chat_stream_body(**extra):
    return {"messages": HI, "stream": True, "max_tokens": 24, "temperature": 0, **extra}


def test_a_stream_with_a_conversation_id_survives_the_client(server, http):
    conv = "conv-survive::ninfer"
    with http.stream("POST", "/v1/chat/completions", json=chat_stream_body(), headers={"X-Conversation-Id": conv}) as r:
        assert r.status_code == 200
        first = next(r.iter_lines())  # read one event, then go away
        assert first.startswith("data: ")
    deadline = time.monotonic() + 60
    while True:
        found = http.post("/v1/streams/lookup", json={"conversation_ids": ["conv-survive"]}).json()
        assert [s["conversation_id"] for s in found] == [conv]  # "<id>::<model>" matches its id
        if found[0]["is_done"]:
            break
        assert time.monotonic() < deadline
        time.sleep(0.1)
    s = found[0]
    assert s["total_bytes"] > 0 and s["completed_at"] >= s["started_at"] > 0
    replay = http.get("/v1/stream", params={"conv_id": conv, "from": 0})
    assert replay.status_code == 200 and replay.headers["content-type"].startswith("text/event-stream")
    assert replay.text.endswith("data: [DONE]\n\n") and len(replay.content) == s["total_bytes"]
    events = sse_events(replay.text)
    assert events[-1]["choices"][0]["finish_reason"] == "length"  # it ran to max_tokens after the client left
    tail = http.get("/v1/stream", params={"conv_id": conv, "from": 10})
    assert tail.content == replay.content[10:]
    assert http.post("/v1/streams/lookup", json={"conversation_ids": ["other"]}).json() == []
    assert http.delete("/v1/stream", params={"conv_id": conv}).status_code == 204
    assert http.post("/v1/streams/lookup", json={"conversation_ids": [conv]}).json() == []
    assert_error(http.get("/v1/stream", params={"conv_id": conv}), 404, "stream_not_found", "conv_id")


def test_delete_stream_is_the_users_stop(server, http):
    conv = "conv-stop"
    body = chat_stream_body(max_tokens=4000, ignore_eos=True)
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Conversation-Id": conv}) as r:
        lines = r.iter_lines()
        n = 0
        for line in lines:
            if line.startswith("data: ") and '"content"' in line:
                n += 1
                if n == 3:
                    break
        assert http.delete("/v1/stream", params={"conv_id": conv}).status_code == 204
        rest = "\n".join(lines)  # the session ends for its readers at once, as llama-server's does
    assert "[DONE]" not in rest
    wait_idle(http)
    assert http.delete("/v1/stream", params={"conv_id": conv}).status_code == 204  # idempotent


@pytest.mark.parametrize("method, path, params, code, param", [
    ("GET", "/v1/stream", {}, "missing_required_parameter", "conv_id"),
    ("DELETE", "/v1/stream", {}, "missing_required_parameter", "conv_id"),
    ("GET", "/v1/stream", {"conv_id": "nope"}, "stream_not_found", "conv_id"),
])
def test_bad_stream_requests(http, method, path, params, code, param):
    r = http.request(method, path, params=params)
    assert_error(r, 404 if code == "stream_not_found" else 400, code, param)
    assert http.post("/v1/streams/lookup", content=b"{not json").status_code == 400
    assert http.post("/v1/streams/lookup", json={"conversation_ids": "x"}).json() == []
    assert_serves(http)


def test_a_bad_offset_is_refused(http):
    conv = "conv-offset"
    r = http.post("/v1/chat/completions", json=chat_stream_body(max_tokens=2), headers={"X-Conversation-Id": conv})
    assert r.status_code == 200
    assert_error(http.get("/v1/stream", params={"conv_id": conv, "from": "x"}), 400, "invalid_value", "from")


# -- the reasoning_end control ---------------------------------------------------------------------------

def test_reasoning_end_closes_the_thinking(server, http):
    body = chat_stream_body(max_tokens=120, reasoning_control=True, temperature=0, ignore_eos=True)
    reasoning, content, result, cid = [], [], None, None
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            cid = ev["id"]
            delta = ev["choices"][0]["delta"] if ev["choices"] else {}
            if delta.get("reasoning_content"):
                reasoning.append(delta["reasoning_content"])
                if result is None and len(reasoning) >= 3:
                    result = http.post("/v1/chat/completions/control",
                                       json={"id": cid, "action": "reasoning_end"}).json()
            if delta.get("content"):
                content.append(delta["content"])
    assert result == {"success": True}
    assert BUDGET_MESSAGE.strip() in "".join(reasoning)  # the close came from the control
    assert content, "the answer went on after the closed thinking"
    # the completion is over: the control finds nothing to act on
    for _ in range(50):  # the stream's end unregisters it
        late = http.post("/v1/chat/completions/control", json={"id": cid, "action": "reasoning_end"}).json()
        if late.get("message") == "no active completion for this id":
            break
        time.sleep(0.05)
    assert late == {"success": False, "message": "no active completion for this id"}


def test_the_control_needs_reasoning_control(server, http):
    body = chat_stream_body(max_tokens=60, ignore_eos=True)
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                cid = json.loads(line[6:])["id"]
                out = http.post("/v1/chat/completions/control", json={"id": cid, "action": "reasoning_end"}).json()
                break
    assert out == {"success": False, "message": "reasoning control not enabled for this completion"}
    wait_idle(http)


@pytest.mark.parametrize("body, code, param", [
    ({"action": "reasoning_end"}, "missing_required_parameter", "id"),
    ({"id": "chatcmpl-1", "action": "pause"}, "invalid_value", "action"),
    ({"id": "chatcmpl-1"}, "invalid_value", "action"),
    ([1], "invalid_type", None),
])
def test_bad_control_requests(http, body, code, param):
    assert_error(http.post("/v1/chat/completions/control", json=body), 400, code, param)
    assert http.post("/v1/chat/completions/control",
                     json={"id": "chatcmpl-unknown", "action": "reasoning_end"}).json()["success"] is False
    assert_serves(http)


def test_llamacpp_stream_fields_are_booleans(http):
    r = http.post("/v1/chat/completions", json={"messages": HI, "timings_per_token": "yes"})
    assert_error(r, 400, "invalid_type", "timings_per_token")
    assert_serves(http)


# -- return_progress and timings_per_token ------------------------------------------------------------------

LONG = [{"role": "user", "content": "Please count the following words carefully: " + "apple banana cherry " * 40}]


def _progress_run(http, path: str, body: dict) -> tuple[list[dict], list[dict]]:
    events = sse_events(http.post(path, json=body).text)
    progress = [e for e in events if "prompt_progress" in e]
    return events, progress


def _check_progress(events: list[dict], progress: list[dict], cached: bool) -> None:
    pp = [e["prompt_progress"] for e in progress]
    # initial, one per committed 16-token prefill unit, final (a cached prompt has a short suffix)
    assert len(pp) >= (2 if cached else 3), pp
    total, cache = pp[0]["total"], pp[0]["cache"]
    assert pp[0]["processed"] == cache and (cache > 0) == cached
    assert pp[-1]["processed"] == total
    assert [p["processed"] for p in pp] == sorted(p["processed"] for p in pp)
    assert all(p["total"] == total and p["cache"] == cache and isinstance(p["time_ms"], int) for p in pp)
    for e in progress:  # prompt-only live snapshots
        t = e["timings"]
        assert t["predicted_n"] == 0 and t["predicted_ms"] == 0 and t["cache_n"] == cache
        assert t["prompt_n"] == e["prompt_progress"]["processed"] - cache
    last_progress = events.index(progress[-1])
    assert all("prompt_progress" not in e for e in events[last_progress + 1:])
    text = [i for i, e in enumerate(events) if e.get("content") or (e.get("choices") and any(
        e["choices"][0].get("delta", {}).get(k) for k in ("content", "reasoning_content")))]
    assert text and text[0] > last_progress  # the final progress event precedes any output


def test_chat_return_progress_and_timings_per_token(http):
    body = {"messages": LONG, "stream": True, "max_tokens": 8, "temperature": 0, "return_progress": True,
            "timings_per_token": True}
    for cached in (False, True):  # the same prompt again reuses its prefix: progress starts at cache
        events, progress = _progress_run(http, "/v1/chat/completions", body)
        _check_progress(events, progress, cached)
        visible = [e for e in events if e["choices"] and ({"content", "reasoning_content"}
                                                          & {k for k, v in e["choices"][0]["delta"].items() if v})]
        assert visible and all("timings" in e for e in visible)
        counts = [e["timings"]["predicted_n"] for e in visible]
        assert counts == sorted(counts) and counts[0] >= 1
        assert "prompt_progress" not in events[0]  # the role chunk comes first, before admission


def test_without_the_options_no_progress_or_live_timings(http):
    events = sse_events(http.post("/v1/chat/completions", json={"messages": LONG, "stream": True,
                                                                "max_tokens": 4}).text)
    assert not any("prompt_progress" in e for e in events)
    assert ["timings" in e for e in events].count(True) == 1  # the terminal one only


def test_llamacpp_completion_progress(http):
    body = {"prompt": "apple banana cherry " * 40, "n_predict": 6, "stream": True, "return_progress": True,
            "timings_per_token": True, "temperature": 0}
    events, progress = _progress_run(http, "/completion", body)
    _check_progress(events, progress, cached=False)


# -- the MCP relay -----------------------------------------------------------------------------------------

class _Target(BaseHTTPRequestHandler):
    seen: list = []

    def _answer(self):
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n) if n else b""
        _Target.seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        out = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"ok": True}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("mcp-session-id", "s-1")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def target():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Target)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    _Target.seen = []
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_mcp_relay(server, target):
    with httpx.Client(base_url=server.base_url, timeout=30) as anon:  # the relay takes no API key
        r = anon.post("/cors-proxy", params={"url": target + "/mcp?x=1"}, content=b'{"jsonrpc":"2.0"}',
                      headers={"x-llama-server-proxy-header-authorization": "Bearer upstream",
                               "x-llama-server-proxy-header-content-type": "application/json",
                               "x-other": "not forwarded"})
        assert r.status_code == 200 and r.json()["result"] == {"ok": True}
        assert r.headers["mcp-session-id"] == "s-1"
        method, path, headers, body = _Target.seen[-1]
        assert (method, path, body) == ("POST", "/mcp?x=1", b'{"jsonrpc":"2.0"}')
        assert headers["authorization"] == "Bearer upstream" and "x-other" not in headers
        assert anon.get("/cors-proxy", params={"url": target + "/sse"}).status_code == 200
        assert _Target.seen[-1][0] == "GET"
        assert_error(anon.get("/cors-proxy", params={"url": "https://example.com/mcp"}), 400,
                     "unsupported_url_scheme", "url")
        assert_error(anon.get("/cors-proxy"), 400, "invalid_value", "url")
        assert_error(anon.get("/cors-proxy", params={"url": "http://u:p@127.0.0.1/"}), 400, "invalid_value", "url")
        dead = anon.get("/cors-proxy", params={"url": "http://127.0.0.1:9/"})
        assert_error(dead, 502, "upstream_unreachable", None, type_="server_error")
