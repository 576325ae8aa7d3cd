"""Operations on a real server (issue 19): bad inputs, Retry-After, HEAD /health, /openapi.json and
/docs, NINFER_API_KEY, /metrics parsed by prometheus_client with the gateway gauges moving under
load, the per-request log line, and llama.cpp's /metrics additions. Every refusal is checked for
status, code and param, and the server is checked to still serve afterwards."""

from __future__ import annotations

import json
import threading
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(600)

KEY = "ops-secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def ops(launch, tiny_artifact, tmp_path_factory):
    s = launch(tiny_artifact, "--metrics-compat", "vllm,sglang", "--max-concurrency", "1", "--max-pending-requests",
               "1", "--api-docs", "--log-stats-interval-ms", "300", log_dir=tmp_path_factory.mktemp("ops"),
               env={"NINFER_API_KEY": KEY})
    yield s
    s.stop()


def _metrics(base: str) -> dict[str, float]:
    r = httpx.get(base + "/metrics", headers=AUTH, timeout=30)
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for smp in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(smp.labels.items()))
            out[smp.name + (f"{{{labels}}}" if labels else "")] = smp.value
    return out


def _serves(base: str) -> None:
    r = httpx.post(base + "/v1/chat/completions", headers=AUTH, timeout=120,
                   json={"messages": HI, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"


def _openai_error(r, status, code, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code and err["param"] == param, err


def _anthropic_error(r, status, type_, code=None, param=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == type_ and body["request_id"].startswith("req_")
    assert body["error"].get("code") == code and body["error"].get("param") == param, body
    assert r.headers["request-id"] == body["request_id"]


def test_the_key_comes_from_the_environment_and_health_needs_none(ops):
    assert httpx.get(ops.base_url + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(ops.base_url + "/v1/models", headers=AUTH, timeout=30).status_code == 200
    h = httpx.head(ops.base_url + "/health", timeout=30)
    assert h.status_code == 200 and h.content == b"" and h.headers["x-ninfer-version"]
    assert httpx.head(ops.base_url + "/v1/health", timeout=30).status_code == 200
    assert KEY not in ops.log()


def test_openapi_lists_every_route_and_docs_are_served(ops):
    doc = httpx.get(ops.base_url + "/openapi.json", headers=AUTH, timeout=30).json()
    index = httpx.get(ops.api_base, headers=AUTH, timeout=30).json()["endpoints"]
    paths = doc["paths"]
    for e in index:
        path = e["path"].replace("{model_id:path}", "{model_id}")
        assert e["method"].lower() in paths[path], (e, sorted(paths))
    chat = paths["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    msgs = paths["/v1/messages"]["post"]
    assert msgs["responses"]["default"]["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicError")
    assert paths["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/CreateResponseRequest")
    assert "bearer" in doc["components"]["securitySchemes"]
    docs = httpx.get(ops.base_url + "/docs", headers=AUTH, timeout=30)
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


DEEP = "[" * 10_000 + "]" * 10_000


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/v1/responses", "/completion"])
def test_json_nested_10000_deep_is_a_400(ops, path):
    body = f'{{"messages": {DEEP}, "content": {DEEP}, "input": {DEEP}, "prompt": {DEEP}}}'
    r = httpx.post(ops.base_url + path, content=body, headers={**AUTH, "content-type": "application/json"},
                   timeout=60)
    _openai_error(r, 400, "invalid_json")
    assert "deeper than 128" in r.json()["error"]["message"]
    _serves(ops.base_url)


def test_deep_json_nan_and_infinite_numbers_on_messages_are_anthropic_400s(ops):
    headers = {**AUTH, "content-type": "application/json"}
    r = httpx.post(ops.base_url + "/v1/messages", content=f'{{"model": "m", "messages": {DEEP}}}', headers=headers,
                   timeout=60)
    _anthropic_error(r, 400, "invalid_request_error", "invalid_json")
    for value in ("NaN", "Infinity", "-Infinity", "1e999"):
        body = '{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], "temperature": ' + value
        r = httpx.post(ops.base_url + "/v1/messages", content=body + "}", headers=headers, timeout=60)
        _anthropic_error(r, 400, "invalid_request_error", "invalid_json")
    r = httpx.post(ops.base_url + "/v1/messages", headers=AUTH, timeout=60, json={
        "model": "m", "max_tokens": 4, "messages": HI, "top_p": 0})
    _anthropic_error(r, 400, "invalid_request_error", "invalid_value", "top_p")
    r = httpx.post(ops.base_url + "/v1/chat/completions", content='{"messages": [], "temperature": NaN}',
                   headers=headers, timeout=60)
    _openai_error(r, 400, "invalid_json")
    _serves(ops.base_url)


def _hold(base: str, path: str, body: dict, started: threading.Event, stop: threading.Event, seen: list):
    with httpx.Client(timeout=120) as c, c.stream("POST", base + path, headers=AUTH, json=body) as r:
        seen.append(r.status_code)
        for _ in r.iter_lines():
            started.set()
            if stop.is_set():
                return


def _busy(base: str):
    """Two long streams: one running, one waiting (1 lane, 1 pending place)."""
    stop = threading.Event()
    seen: list = []
    threads = []
    body = {"messages": HI, "max_tokens": 400, "stream": True, "ignore_eos": True, "temperature": 0}
    for _ in range(2):
        started = threading.Event()
        t = threading.Thread(target=_hold, args=(base, "/v1/chat/completions", body, started, stop, seen), daemon=True)
        t.start()
        threads.append((t, started))
    return stop, threads, seen


def test_overload_is_429_on_openai_and_529_on_messages_with_retry_after_and_gateway_gauges_move(ops):
    base = ops.base_url
    stop, threads, seen = _busy(base)
    try:
        for t, started in threads:
            assert started.wait(120)
        deadline = time.monotonic() + 60
        while True:  # the second stream waits in the engine FIFO once both are submitted
            m = _metrics(base)
            running = next(v for k, v in m.items() if k.startswith("vllm:num_requests_running"))
            waiting = next(v for k, v in m.items() if k.startswith("vllm:num_requests_waiting"))
            if running == 1 and waiting == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert (running, waiting) == (1, 1)
        usage = next(v for k, v in m.items() if k.startswith("vllm:kv_cache_usage_perc"))
        assert 0 < usage <= 1
        assert next(v for k, v in m.items() if k.startswith("sglang:num_running_reqs")) == 1
        assert next(v for k, v in m.items() if k.startswith("sglang:num_queue_reqs")) == 1
        assert next(v for k, v in m.items() if k.startswith("sglang:token_usage")) == usage
        assert m["llamacpp:requests_processing"] == 1 and m["llamacpp:requests_deferred"] == 1
        info = next(k for k in m if k.startswith("vllm:cache_config_info"))
        assert 'block_size="64"' in info and 'num_gpu_blocks="' in info
        r = httpx.post(base + "/v1/chat/completions", headers=AUTH, timeout=60, json={"messages": HI, "max_tokens": 2})
        _openai_error(r, 429, "server_overloaded")
        assert r.headers["retry-after"] == "1"
        r = httpx.post(base + "/v1/messages", headers=AUTH, timeout=60,
                       json={"model": "m", "max_tokens": 2, "messages": HI})
        _anthropic_error(r, 529, "overloaded_error", "server_overloaded")
        assert r.headers["retry-after"] == "1"
    finally:
        stop.set()
        for t, _ in threads:
            t.join(120)
    assert seen == [200, 200]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = _metrics(base)
        if all(v == 0 for k, v in m.items() if k.startswith(("vllm:num_requests", "sglang:num_"))):
            break
        time.sleep(0.2)
    assert all(v == 0 for k, v in m.items() if k.startswith(("vllm:num_requests", "sglang:num_"))), m
    assert next(v for k, v in m.items() if k.startswith("vllm:kv_cache_usage_perc")) == 0
    _serves(base)


def test_metrics_header_and_the_llamacpp_additions(ops):
    base = ops.base_url
    r = httpx.get(base + "/metrics", headers=AUTH, timeout=30)
    start = int(r.headers["process-start-time-unix"])
    assert abs(start - psutil.Process(ops.proc.pid).create_time()) <= 2
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    convo = [{"role": "system", "content": "You are a terse assistant. " * 20}, {"role": "user", "content": "One"}]
    first = httpx.post(base + "/v1/chat/completions", headers=AUTH, timeout=120,
                       json={"messages": convo, "max_tokens": 6, "temperature": 0}).json()
    used = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    before = _metrics(base)
    assert before["llamacpp:n_tokens_max"] >= used - 1
    convo += [{"role": "assistant", "content": first["choices"][0]["message"]["content"] or ""},
              {"role": "user", "content": "Two"}]
    second = httpx.post(base + "/v1/chat/completions", headers=AUTH, timeout=120,
                        json={"messages": convo, "max_tokens": 4, "temperature": 0}).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    after = _metrics(base)
    assert cached > 0
    assert after["llamacpp:prompt_tokens_cached_total"] - before["llamacpp:prompt_tokens_cached_total"] == cached
    assert after["llamacpp:n_tokens_max"] >= before["llamacpp:n_tokens_max"]


def test_every_request_logs_one_line_with_its_outcome_and_never_its_text(ops):
    secret = "a-very-particular-prompt-text"
    r = httpx.post(ops.base_url + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"messages": [{"role": "user", "content": secret}], "temperature": 7})
    _openai_error(r, 400, "invalid_value", "temperature")
    rid = r.headers["x-request-id"]
    ok = httpx.post(ops.base_url + "/v1/chat/completions", headers=AUTH, timeout=120,
                    json={"messages": [{"role": "user", "content": secret}], "max_tokens": 2})
    time.sleep(0.5)
    log = ops.log()
    assert f"{rid} POST /v1/chat/completions 400 code=invalid_value param=temperature in " in log
    assert f"{ok.headers['x-request-id']} POST /v1/chat/completions 200 in " in log
    assert secret not in log and KEY not in log
    assert "stats | prefill" in log  # the --log-stats-interval-ms line
    assert "\x1b[" not in log  # a redirected stderr is plain
    line = next(ln for ln in log.splitlines() if rid in ln)
    assert line.startswith("[20") and "] [info] " in line  # [YYYY-MM-DD HH:MM:SS.mmm] [level]


def test_an_artifact_window_below_max_context_warns(launch, tiny_artifact, tmp_path):
    s = launch(tiny_artifact, "--max-context", "40000", "--kv-capacity", "1024", log_dir=tmp_path)
    try:
        assert "--max-context 40000 is above the model's native window of 32768 tokens" in s.log()
        r = httpx.post(s.base_url + "/v1/chat/completions", timeout=120, json={"messages": HI, "max_tokens": 2})
        assert r.status_code == 200
    finally:
        assert s.stop() == 0


def test_json_bodies_round_trip(ops):
    """A request with every number form JSON allows still parses (the strict parser refuses only
    what JSON does not have)."""
    body = json.dumps({"messages": HI, "max_tokens": 2, "temperature": 0.0, "top_p": 1e0, "seed": -5})
    r = httpx.post(ops.base_url + "/v1/chat/completions", content=body,
                   headers={**AUTH, "content-type": "application/json"}, timeout=120)
    assert r.status_code == 200


def test_an_artifact_without_a_template_is_served_with_its_familys(launch, tmp_path):
    testing = pytest.importorskip("ninfer_qwen35.testing")
    from qwen_format import qwen35_tokenizer_section

    path = testing.build_tiny_artifact(str(tmp_path / "no-template.ninfer"), kind="dense",
                                       tokenizer_section=qwen35_tokenizer_section(), chat_template=None)
    s = launch(path, log_dir=tmp_path)
    try:
        assert "the artifact has no chat template: using the qwen3_5 model family's template" in s.log()
        r = httpx.post(s.base_url + "/v1/chat/completions", timeout=120, json={"messages": HI, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    finally:
        assert s.stop() == 0
