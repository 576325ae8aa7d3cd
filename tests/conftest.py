"""Shared fixtures: a session-scoped tiny Qwen3.5 artifact and live `ninfer serve` processes.

`live_server` is one real server (subprocess, loopback, a port the OS picked) shared by the
session; `start_server(*flags)` starts a short-lived one for option-specific tests. Both need the
qwen35 plugin; without it (core-only CI) the tests that use them are skipped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from qwen_format import byte_tokenizer_section, with_format  # noqa: F401 - used by fixtures below

REPO = Path(__file__).resolve().parent.parent
_LISTEN = re.compile(r"listening on http://([0-9.]+|\[[0-9a-f:]+\]):(\d+)")


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory) -> str:
    """A tiny random dense Qwen3.5 artifact with the real Qwen tokenizer and chat template."""
    testing = pytest.importorskip("ninfer_qwen35.testing")
    from qwen_format import qwen35_tokenizer_section

    path = tmp_path_factory.mktemp("artifact") / "tiny-dense.ninfer"
    return testing.build_tiny_artifact(str(path), kind="dense", tokenizer_section=qwen35_tokenizer_section())


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    log_path: Path
    port: int = 0
    # Every /health answer seen while waiting for readiness: (status, headers, body).
    health_while_loading: list = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_base(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Stop the server (SIGTERM stops at once; one SIGINT only asks for a second one)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def launch_server(artifact: str | None, *flags: str, log_dir: Path, wait_ready: bool = True,
                  timeout: float = 180.0, env: dict | None = None) -> ServerProcess:
    """Start `python -m ninfer_core.cli serve` and wait for its port (and, by default, readiness)."""
    import httpx

    log_path = log_dir / f"server-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "ninfer_core.cli", "serve"]
    if artifact:
        cmd.append(artifact)
    cmd += ["--host", "127.0.0.1", "--port", "0", *flags]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=str(REPO), env=full_env)
    server = ServerProcess(proc, log_path)
    deadline = time.monotonic() + timeout
    while server.port == 0:
        m = _LISTEN.search(server.log())
        if m:
            server.port = int(m.group(2))
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"server did not start (rc={proc.returncode}):\n{server.log()}")
        time.sleep(0.02)
    if not wait_ready:
        return server
    with httpx.Client(timeout=10) as client:
        while True:
            try:
                r = client.get(server.base_url + "/health")
                if r.status_code == 200:
                    break
                server.health_while_loading.append((r.status_code, dict(r.headers), r.json()))
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"server did not become ready (rc={proc.returncode}):\n{server.log()}")
            time.sleep(0.05)
    return server


@pytest.fixture(scope="session")
def live_server(tiny_artifact, tmp_path_factory):
    server = launch_server(tiny_artifact, log_dir=tmp_path_factory.mktemp("server-logs"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def launch():
    """launch_server itself, for module-scoped server fixtures (`from conftest import` is ambiguous
    once several conftest.py files are loaded)."""
    return launch_server


@pytest.fixture
def start_server(tiny_artifact, tmp_path):
    """Factory for short-lived servers with their own flags; all are stopped after the test."""
    started: list[ServerProcess] = []

    def start(*flags: str, **kw) -> ServerProcess:
        server = launch_server(tiny_artifact, *flags, log_dir=tmp_path, **kw)
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


# -- unit-test doubles for the HTTP layer (never used by tests/e2e) ---------------------------------

class FakeHandle:
    """Replays scripted EngineEvents; cancel() ends the stream with finish_reason "cancelled"."""

    def __init__(self, request, script, delay_s: float = 0.0):
        self.request_id = request.request_id
        self.script = list(script)
        self.delay_s = delay_s
        self.cancelled = False

    async def events(self):
        import asyncio

        from ninfer_core.engine.api import EngineEvent, Usage

        for ev in self.script:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.cancelled:
                yield EngineEvent("finish", finish_reason="cancelled", usage=Usage())
                return
            yield ev

    def cancel(self) -> None:
        self.cancelled = True


class FakeEngine:
    """An EngineClient double: records submitted requests and replays `script(request)`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests = []
        self.handles = []
        self.submit_error = None
        self.delay_s = 0.0
        self.pieces = ["Let me think.", "</think>\n\n", "Hello", " there."]
        self.finish_reason = "stop"
        self.extra_events = []

    def script(self, request):
        from ninfer_core.engine.api import EngineEvent, Usage

        events = [EngineEvent("admitted")]
        n = 0
        for text in self.pieces:
            ids = self.tokenizer.encode(text)
            n += len(ids)
            events.append(EngineEvent("delta", token_ids=ids, text=text))
        events += self.extra_events
        events.append(EngineEvent("finish", finish_reason=self.finish_reason, stop_reason="eos",
                                  usage=Usage(len(request.prompt_ids), n, 0),
                                  timings={"cache_n": 0, "prompt_n": len(request.prompt_ids), "predicted_n": n}))
        return events

    def submit(self, request):
        if self.submit_error is not None:
            raise self.submit_error
        self.requests.append(request)
        handle = FakeHandle(request, self.script(request), self.delay_s)
        self.handles.append(handle)
        return handle

    def snapshot(self):
        return {"lanes_active": 0, "lanes_total": 1, "prefilling": 0, "decode_ready": 0, "pages_total": 128,
                "pages_free": 128, "page_size": 64, "slots_total": 1, "slots_free": 1, "pending": 0,
                "counters": {"requests_completed": len(self.requests)}}

    def default_output_limit(self, prompt_tokens: int) -> int:
        return 8192 - prompt_tokens


@pytest.fixture
def make_app():
    """make_app(**serve_options) -> (TestClient, ctx, fake engine): a ready app over a FakeEngine."""
    from fastapi.testclient import TestClient
    from qwen_format import QWEN35_TEMPLATE
    from qwen_format import sampling_presets as qwen_sampling_presets

    from ninfer_core.config import EngineOptions, ServeOptions
    from ninfer_core.plugins import PluginHost, PluginSelection
    from ninfer_core.server.app import create_app
    from ninfer_core.server.context import ServedModel, ServerContext
    from ninfer_core.tokenizer import Tokenizer
    from ninfer_core.tokenizer.chat_template import ChatTemplate

    clients = []

    def make(ready: bool = True, engine_options: dict | None = None, builtins=None, **options):
        opts = ServeOptions(artifact="/models/test.ninfer", engine=EngineOptions(**(engine_options or {})),
                            **options)
        tok = with_format(Tokenizer.from_section(byte_tokenizer_section()))
        engine = FakeEngine(tok)
        host = PluginHost(PluginSelection(autoload=False), builtins=builtins)
        ctx = ServerContext(options=opts, plugins=host, tokenizer=tok, chat_template=ChatTemplate(QWEN35_TEMPLATE),
                            engine=engine, sampling_presets=qwen_sampling_presets())
        ctx.model = ServedModel(id=opts.model_id or "test-model", artifact_path=opts.artifact,
                                architecture="qwen3_5", max_model_len=opts.engine.max_context,
                                n_vocab=tok.vocab_size, n_ctx_train=32768, n_embd=64, n_params=1000, size=4000,
                                ftype="f32")
        if ready:
            ctx.mark_ready()
        client = TestClient(create_app(ctx))
        clients.append(client)
        return client, ctx, engine

    yield make
    for c in clients:
        c.close()
