"""`ninfer bench`'s HTTP row: the same streaming chat requests through the real FastAPI/uvicorn
server (httpx clients on loopback) and straight into the engine, over one runner."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from typing import Any

# ---- HTTP vs the bare engine ---------------------------------------------------------------------------
# Below this fraction of the model's ids decoding to text, the HTTP row uses a covering tokenizer.
MIN_TEXT_COVERAGE = 0.99


def http_vs_engine(runner, family, art, host, args, device) -> dict:
    """The same streaming chat requests through the real FastAPI/uvicorn server (httpx clients on
    loopback) and straight into the engine; total generated tokens over wall time for each."""
    import uvicorn

    from ninfer_core.bench.text_tokenizer import covering_section, template_controls, text_coverage
    from ninfer_core.config import EngineOptions, ServeOptions
    from ninfer_core.engine.api import GenerationRequest, SamplingParams
    from ninfer_core.engine.engine import Engine
    from ninfer_core.server.app import create_app
    from ninfer_core.server.context import ServedModel, ServerContext
    from ninfer_core.server.prepare import default_sampling_presets
    from ninfer_core.server.serve import bind_socket
    from ninfer_core.tokenizer import Tokenizer
    from ninfer_core.tokenizer.chat_format import attach
    from ninfer_core.tokenizer.chat_template import ChatTemplate

    template_source = art.chat_template or getattr(family, "chat_template", None)
    if not template_source:
        raise RuntimeError("the artifact has no chat template and its family bundles none")
    tok = Tokenizer.from_section(art.tokenizer_section)
    # Random weights sample ids over the whole vocabulary: with a tokenizer that leaves most of
    # them without text (the small one of the named shapes, a tiny test artifact) the streams would
    # carry almost no per-token events. Then every id gets a printable token of its own.
    vocab = runner.info.vocab_size
    coverage = text_coverage(tok, vocab)
    tokenizer_used = "artifact"
    template = ChatTemplate(template_source)
    messages = [{"role": "user", "content": "Benchmark prompt number {i}: say anything."}]
    if coverage < MIN_TEXT_COVERAGE:
        # only the control tokens the bench's own prompts render (with thinking on and off)
        rendered = template.render(messages) + template.render(messages, enable_thinking=False)
        tok = Tokenizer.from_section(covering_section(vocab, template_controls(art.tokenizer_section, rendered)))
        tokenizer_used = f"bench (every id a printable token; the artifact's gives text for {coverage:.1%})"
    if hasattr(family, "chat_format"):  # the family's markup, as the server's loader attaches it
        attach(tok, family.chat_format(art))
    clients = max(args.http_clients)
    prompt_len = len(tok.encode(template.render(messages)))
    max_context = prompt_len + args.http_tokens + 64
    eng_opts = EngineOptions(max_context=max_context, kv_capacity=clients * max_context, max_concurrency=clients,
                             prefill_chunk=1024, device=str(device), cuda_graph=not args.no_cuda_graph)
    runner.free_cache()  # graphs and cache go before the engine sizes its own pool
    engine = Engine(runner, tok, eng_opts)
    engine.start()
    ctx = ServerContext(options=ServeOptions(engine=eng_opts, log_level="warning"), plugins=host)
    ctx.model = ServedModel(id="bench", artifact_path=art.path, architecture=art.architecture,
                            max_model_len=eng_opts.max_context, n_vocab=tok.vocab_size)
    ctx.tokenizer, ctx.chat_template, ctx.engine = tok, template, engine
    ctx.sampling_presets = default_sampling_presets(art.architecture, family)
    ctx.mark_ready()
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(ctx), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    from ninfer_core.bench.http_load import messages as msgs

    async def one_engine(i):
        ids = tok.encode(template.render(msgs(i)))
        req = GenerationRequest(prompt_ids=ids, sampling=SamplingParams(greedy=True, temperature=0.0),
                                max_tokens=args.http_tokens, ignore_eos=True, request_id=f"bench-{i}")
        n = texts = 0
        async for ev in engine.submit(req).events():
            if ev.kind == "delta":
                texts += 1 if ev.text else 0
            elif ev.kind == "error":
                raise RuntimeError(ev.error.message)
            elif ev.kind == "finish":
                n = ev.usage.completion_tokens if ev.usage else n
        return n, texts

    def http_round(k):
        """The streaming clients run in their own process (ninfer_core.bench.http_load)."""
        p = subprocess.run([sys.executable, "-m", "ninfer_core.bench.http_load", str(port), str(k),
                            str(args.http_tokens)], capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"HTTP load failed: {p.stderr[-500:]}")
        got = json.loads(p.stdout.strip().splitlines()[-1])
        return got["tokens"], got["seconds"], got["text_events"]

    async def engine_round(k):
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one_engine(i) for i in range(k)))
        return sum(c[0] for c in counts), time.perf_counter() - t0, sum(c[1] for c in counts)

    out: dict[Any, Any] = {"tokenizer": tokenizer_used}
    try:
        for k in args.http_clients:
            asyncio.run(engine_round(k))  # warm-up (graphs of this width)
            n_e, t_e, x_e = asyncio.run(engine_round(k))
            http_round(k)  # warm-up of the server path (first requests, client process start)
            n_h, t_h, x_h = http_round(k)
            out[k] = {"engine_tok_s": n_e / t_e, "http_tok_s": n_h / t_h, "ratio": (n_h / t_h) / (n_e / t_e),
                      "tokens": n_h, "engine_tokens": n_e, "text_events": x_h, "engine_text_events": x_e}
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()
        snap = engine.snapshot() if hasattr(engine, "snapshot") else {}
        out["idle_after"] = snap
    return out
