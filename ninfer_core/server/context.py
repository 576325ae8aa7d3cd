"""ServerContext: everything one server instance knows, passed explicitly (no module state).

`create_app(ctx)` builds the FastAPI app around it; protocols receive it in `mount(router, ctx)`.
The model fields are filled by the loader once weights are loaded and warm; until `ready` is set
the middleware answers every route with 503 model_loading, so handlers may assume a loaded model.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ninfer_core.config import ServeOptions
from ninfer_core.engine.api import EngineError

_IMPORTED_AT = time.time()


def process_start_time() -> float:
    """Unix time this process started (Linux: /proc), else when the server module was imported."""
    try:
        with open("/proc/self/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])  # field 22, starttime, after "pid (comm)"
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        import os

        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


@dataclass
class ServedModel:
    """Facts about the loaded model that /v1/models, /props and the protocols report."""

    id: str  # the public OpenAI model id (--model-id, else the artifact's identity)
    artifact_path: str
    architecture: str
    max_model_len: int  # --max-context
    n_vocab: int = 0
    n_ctx_train: int = 0
    n_embd: int = 0
    n_params: int = 0
    size: int = 0
    ftype: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    vision: bool = False
    aliases: tuple[str, ...] = ()  # further names requests may use (--alias), besides `id`
    tags: tuple[str, ...] = ()  # informational (--tags), reported by /v1/models


class Ingress:
    """The generation-request lifetime bound: max_concurrency + max_pending_requests.

    A request holds one unit from preparation until its response is released; a full ingress
    answers 429 server_overloaded (spec: Execution behavior). Touched only on the event loop.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.admitted = 0
        self.peak = 0

    def acquire(self):
        """Take one unit; returns an idempotent callable that gives it back."""
        if self.admitted >= self.capacity:
            raise EngineError(
                429, "server_overloaded",
                f"The server is at capacity ({self.capacity} requests admitted or waiting). Retry shortly.",
            )
        self.admitted += 1
        self.peak = max(self.peak, self.admitted)
        done = False

        def release_once() -> None:
            nonlocal done
            if not done:
                done = True
                self.release()

        return release_once

    def release(self) -> None:
        self.admitted = max(0, self.admitted - 1)


@dataclass
class ServerContext:
    options: ServeOptions
    plugins: Any = None  # ninfer_core.plugins.PluginHost
    model: ServedModel | None = None
    tokenizer: Any = None  # ninfer_core.tokenizer.Tokenizer
    chat_template: Any = None  # ninfer_core.tokenizer.chat_template.ChatTemplate
    engine: Any = None  # ninfer_core.engine.api.EngineClient
    # Sampling presets of the loaded model: {"thinking": {...}, "non_thinking": {...}}.
    sampling_presets: dict | None = None
    # Seconds without an engine event before an SSE stream sends ": keep-alive" (spec: 5 s).
    keepalive_s: float = 5.0
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    load_error: str | None = None
    ingress: Ingress | None = None
    requests_rejected: int = 0  # generation requests refused in preparation (ninfer:requests_rejected_total)
    request_log: Any = None  # ninfer_core.server.request_log.RequestLog with --request-log-jsonl
    structured: Any = None  # ninfer_core.structured.compiler.StructuredOutput with --structured-output
    media: Any = None  # ninfer_core.media.prompt.MediaService with --vision
    # The WebUI's server side (ninfer_core.protocols.webui mounts them): streamed Chat Completions
    # by id (for the reasoning_end control), the resumable stream sessions (X-Conversation-Id), and
    # the static WebUI (ninfer_core.server.webui.WebUI) when one is served.
    live_completions: dict | None = None
    stream_sessions: Any = None
    webui: Any = None
    # The engine's failure once it latched unavailable (spec "Stop the server"): every route then
    # answers 503 engine_failed and a single-model server exits with status 2.
    engine_failure: str | None = None
    # Model suspend (ninfer_core.router.residency.Residency) when the model can be put to sleep
    residency: Any = None
    gate: Any = None  # ninfer_core.router.single.SingleGate: ServerMiddleware hands it each request
    process_start_unix: float = field(default_factory=lambda: process_start_time())  # /metrics header
    _ready: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        if self.ingress is None:
            eng = self.options.engine
            self.ingress = Ingress(eng.max_concurrency + eng.max_pending_requests)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def mark_ready(self) -> None:
        self.ready_at = time.monotonic()
        self._ready.set()

    def serves_model(self, name: str) -> bool:
        """Whether a request naming `name` is served: the public id or an --alias, or any name with
        --accept-any-model (llama-server answers every name with its one model)."""
        if self.options.accept_any_model:
            return True
        m = self.model
        return m is not None and (name == m.id or name in m.aliases)

    def uptime_s(self) -> float:
        return 0.0 if self.ready_at is None else time.monotonic() - self.ready_at
