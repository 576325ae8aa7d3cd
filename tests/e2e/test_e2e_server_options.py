"""End-to-end tests of serve options, each on its own short-lived real server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(300)

HI = [{"role": "user", "content": "Count to three."}]


def test_four_concurrent_streams_complete(start_server):
    server = start_server("--max-concurrency", "4")
    results: dict[int, tuple] = {}

    def run(i: int) -> None:
        with openai.OpenAI(base_url=server.api_base, api_key="x", max_retries=0, timeout=120) as c:
            chunks = list(c.chat.completions.create(
                messages=HI, model="", max_tokens=32, stream=True, seed=i,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
            results[i] = (chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    most_running = 0
    with httpx.Client(timeout=10) as poll:
        while any(t.is_alive() for t in threads):
            most_running = max(most_running, poll.get(server.base_url + "/v1/load").json()["requests"]["running"])
            threading.Event().wait(0.01)
    for t in threads:
        t.join(180)
    assert results == {i: ("length", 32) for i in range(4)}
    assert most_running >= 2  # the streams shared the engine's lanes, not one after another
    load = httpx.get(server.base_url + "/v1/load").json()
    assert load["capacity"]["max_concurrency"] == 4
    assert load["requests"]["running"] == 0 and load["requests"]["admitted"] == 0


def test_api_key_cors_alias_overload_and_clean_exit(start_server):
    server = start_server("--api-key", "s3cret", "--cors", "--model-id", "my-alias",
                          "--max-concurrency", "1", "--max-pending-requests", "0", "--usage-chunk-choice")
    assert "s3cret" not in server.log()
    base = server.base_url

    # Authentication: /health is open, everything else needs the key (Bearer or x-api-key).
    assert httpx.get(base + "/health").status_code == 200
    with openai.OpenAI(base_url=server.api_base, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
    assert e.value.status_code == 401
    assert e.value.body["code"] == "invalid_api_key" and e.value.body["type"] == "authentication_error"
    r = httpx.get(base + "/v1/models")
    assert r.status_code == 401 and r.headers["x-ninfer-version"] and r.headers["x-request-id"]
    assert httpx.get(base + "/v1/load").status_code == 401
    assert httpx.get(base + "/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200

    # CORS preflight needs no key and allows the headers the browser asks for; as llama-server's,
    # it answers 200 and reflects the Origin with credentials allowed.
    pre = httpx.options(base + "/v1/chat/completions", headers={
        "Origin": "http://example.test", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, x-conversation-id"})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "http://example.test"
    assert pre.headers["access-control-allow-credentials"] == "true"
    assert "x-conversation-id" in pre.headers["access-control-allow-headers"]
    assert "POST" in pre.headers["access-control-allow-methods"]
    cors = httpx.get(base + "/health", headers={"Origin": "http://example.test"})
    assert cors.headers["access-control-allow-origin"] == "http://example.test"

    client = openai.OpenAI(base_url=server.api_base, api_key="s3cret", max_retries=0, timeout=120)
    # The public id is the --model-id alias; the artifact's own name is not accepted.
    assert [m.id for m in client.models.list().data] == ["my-alias"]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="tiny-qwen35-dense", messages=HI, max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"

    # --usage-chunk-choice gives the usage chunk one zero-delta choice.
    chunks = list(client.chat.completions.create(model="my-alias", messages=HI, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert len(chunks[-1].choices) == 1 and chunks[-1].usage.completion_tokens == 2

    # Overload: one request in flight fills max_concurrency 1 + max_pending 0.
    long = client.chat.completions.create(model="my-alias", messages=HI, max_tokens=4000, stream=True,
                                          extra_body={"ignore_eos": True})
    it = iter(long)
    next(it)
    next(it)
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="my-alias", messages=HI, max_tokens=1)
    assert e.value.status_code == 429 and e.value.body["code"] == "server_overloaded"
    assert e.value.response.headers["x-request-id"].startswith("req_")
    long.close()
    for _ in range(200):
        load = httpx.get(base + "/v1/load", headers={"authorization": "Bearer s3cret"}).json()
        if load["requests"]["admitted"] == 0 and load["requests"]["running"] == 0:
            break
        threading.Event().wait(0.05)
    assert client.chat.completions.create(model="my-alias", messages=HI, max_tokens=1).choices
    client.close()

    assert server.stop(signal.SIGTERM) == 0
    log = server.log()
    assert "s3cret" not in log and "Traceback" not in log


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer_core.cli", "serve", *args], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_startup_errors_exit_1(live_server, tiny_artifact, tmp_path):
    missing = _cli(str(tmp_path / "nope.ninfer"), "--port", "0")
    assert missing.returncode == 1 and missing.stderr.startswith("error: ") and "nope.ninfer" in missing.stderr
    plugin = _cli(tiny_artifact, "--port", "0", "--plugin", "no_such_plugin")
    assert plugin.returncode == 1 and "no_such_plugin" in plugin.stderr
    clash = _cli(tiny_artifact, "--port", str(live_server.port))
    assert clash.returncode == 1 and "cannot listen" in clash.stderr
    kv = _cli(tiny_artifact, "--port", "0", "--kv-dtype", "int3")
    assert kv.returncode == 1 and "int3" in kv.stderr
    template = _cli(tiny_artifact, "--port", "0", "--chat-template", str(tmp_path / "missing.jinja"))
    assert template.returncode == 1 and "missing.jinja" in template.stderr


def test_missing_model_family_names_the_package(tmp_path):
    # An architecture the catalog names whose family plugin is not installed here: which one depends
    # on what CI installed (it installs every first-party family it tests), so it is picked, not fixed.
    minimal_tokenizer_section = pytest.importorskip("ninfer_qwen35.testing").minimal_tokenizer_section
    from ninfer_catalog import FAMILY_PACKAGES
    from ninfer_core.artifact import write_artifact
    from ninfer_core.plugins import MissingFamilyError, PluginHost, PluginSelection

    host = PluginHost(PluginSelection.from_sources()).load()

    def served(arch):
        try:
            host.family_for_architecture(arch)
            return True
        except MissingFamilyError:
            return False

    missing = [(arch, pkg) for arch, pkg in FAMILY_PACKAGES.items() if not served(arch)]
    if not missing:
        pytest.skip("every family the catalog names is installed")
    arch, pkg = missing[0]
    path = str(tmp_path / "missing.ninfer")
    write_artifact(path, {"name": "g", "architecture": arch, "config": {}, "chat_template": None,
                          "tokenizer": minimal_tokenizer_section(), "identity": {"model_id": "g"},
                          "generation": {}}, [])
    r = _cli(path, "--port", "0")
    assert r.returncode == 1
    assert f"'{arch}'" in r.stderr and pkg in r.stderr


def test_model_load_failure_after_bind_exits_1(tiny_artifact):
    # The port is served (503) first; a load failure then stops the server with status 1.
    r = _cli(tiny_artifact, "--port", "0", "--device", "cuda:7")
    assert r.returncode == 1
    assert "listening on http://127.0.0.1:" in r.stderr
    assert "error: loading the model failed" in r.stderr
