"""CPU measurement of the HTTP server path's overhead (issue 6), without a device.

Runs `ninfer bench`'s own HTTP-vs-engine comparison (`ninfer_core.bench.http_compare.http_vs_engine`: the
real FastAPI/uvicorn server on a loopback port, httpx streaming clients in a process of their own,
the same requests submitted straight to the engine) over a stand-in runner whose forwards cost a
fixed time with the GIL released (`time.sleep`), the way a CUDA-graph replay plus the token read
back do on the device. The engine's and the server's host work are the real code.

    python scripts/http_overhead.py                           # 8 streams, 128 tokens, 6 ms rounds
    python scripts/http_overhead.py --clients 1,8 --step-ms 0 # rounds as fast as the host allows
    python scripts/http_overhead.py --no-text                 # what the random-weight bench sends

`--text` (default): every token decodes to one printable character, so every token becomes one SSE
event per stream (what a real model does). `--no-text`: the sampled ids are outside the tokenizer
(as with `ninfer bench --shape`'s random weights over a 248k vocabulary and a 265-token tokenizer),
so the streams carry no delta events at all and only the fixed per-request cost shows.
Prints one JSON object per client count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# the byte-level tokenizer fixture with the Qwen3.5 format the tests use (tests/qwen_format.py)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch
from qwen_format import QWEN35_TEMPLATE, byte_tokenizer_section, sampling_presets, with_format

from ninfer_core.testing import ToyRunner

TEXT = b"the quick brown fox jumps over the lazy dog "


class _DeviceTensor(torch.Tensor):
    """Logits "on the device": reading values back (`tolist`, as the sampler does) waits until the
    forward that made them is done, with the GIL released, as a CUDA copy to the host does."""

    ready_at = 0.0

    def tolist(self):
        wait = _DeviceTensor.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return torch.Tensor.tolist(self.as_subclass(torch.Tensor))


class SleepRunner(ToyRunner):
    """A ToyRunner whose forwards skip the toy model: each is "launched" and returns at once, and its
    logits can be read `step_s` (decode) or `prefill_s` later, the way a CUDA-graph replay followed
    by the sampler's read-back behaves. Tokens come from the position; cache bookkeeping (slots,
    pages, state images) stays the toy's."""

    launches_async = True  # forwards return at launch, as a CUDA runner's do

    def __init__(self, vocab: int, step_s: float, prefill_s: float, text: bool):
        super().__init__(vocab_size=vocab, eos_token_ids=())
        self.step_s, self.prefill_s, self.text = step_s, prefill_s, text
        self._rows = {}

    def _row(self, pos: int) -> torch.Tensor:
        tok = TEXT[pos % len(TEXT)] if self.text else 300 + pos % (self.info.vocab_size - 300)
        row = self._rows.get(tok)
        if row is None:
            row = torch.zeros(self.info.vocab_size)
            row[tok] = 1.0
            self._rows[tok] = row
        return row

    @staticmethod
    def _launch(rows: torch.Tensor, seconds: float) -> torch.Tensor:
        _DeviceTensor.ready_at = max(_DeviceTensor.ready_at, time.perf_counter()) + seconds
        return rows.as_subclass(_DeviceTensor)

    def forward(self, batch):
        from ninfer_core.engine.model_api import SegmentOutput

        segs = batch.segments
        if segs[0].kind == "prefill":
            (seg,) = segs
            n = seg.end
            self.state[seg.slot] = torch.tensor([n, 0])
            rows = (torch.stack([self._row(seg.start + i + 1) for i in range(len(seg.tokens))])
                    if seg.logits == "all" else self._row(n).clone())
            return [SegmentOutput(self._launch(rows, self.prefill_s))]
        rows = self._launch(torch.stack([self._row(s.start + 1) for s in segs]), self.step_s)
        return [SegmentOutput(rows[i]) for i in range(len(segs))]


def serve(runner, clients: int, tokens: int):
    """The bench's server set-up (`ninfer_core.bench.http_compare.http_vs_engine`) over `runner`: returns
    (engine, server, thread, port, tokenizer, template)."""
    import threading

    import uvicorn

    from ninfer_core.config import EngineOptions, ServeOptions
    from ninfer_core.engine.engine import Engine
    from ninfer_core.plugins import PluginHost, PluginSelection
    from ninfer_core.server.app import create_app
    from ninfer_core.server.context import ServedModel, ServerContext
    from ninfer_core.server.serve import bind_socket
    from ninfer_core.tokenizer import Tokenizer
    from ninfer_core.tokenizer.chat_template import ChatTemplate

    host = PluginHost(PluginSelection(autoload=False))
    host.load()
    tok = with_format(Tokenizer.from_section(byte_tokenizer_section()))
    template = ChatTemplate(QWEN35_TEMPLATE)
    prompt_len = len(tok.encode(template.render([{"role": "user", "content": "Benchmark prompt number 0: say anything."}])))
    max_context = prompt_len + tokens + 64
    eng_opts = EngineOptions(max_context=max_context, kv_capacity=clients * max_context, max_concurrency=clients,
                             prefill_chunk=1024, device="cpu", cuda_graph=False)
    engine = Engine(runner, tok, eng_opts)
    engine.start()
    ctx = ServerContext(options=ServeOptions(engine=eng_opts, log_level="warning"), plugins=host)
    ctx.model = ServedModel(id="bench", artifact_path="stand-in", architecture="qwen3_5",
                            max_model_len=eng_opts.max_context, n_vocab=tok.vocab_size)
    ctx.tokenizer, ctx.chat_template, ctx.engine = tok, template, engine
    ctx.sampling_presets = sampling_presets()
    ctx.mark_ready()
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(ctx), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return engine, server, thread, sock.getsockname()[1], tok, template


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="8", help="comma-separated stream counts (1..8)")
    p.add_argument("--tokens", type=int, default=128, help="tokens each request generates")
    p.add_argument("--step-ms", type=float, default=6.0, help="device time of one decode round")
    p.add_argument("--prefill-ms", type=float, default=10.0, help="device time of one prefill chunk")
    p.add_argument("--text", dest="text", action="store_true", default=True)
    p.add_argument("--no-text", dest="text", action="store_false")
    p.add_argument("--repeats", type=int, default=3, help="measured rounds of each path (after one warm-up)")
    p.add_argument("--http-loop", type=float, default=0.0,
                   help="only repeat HTTP rounds for this many seconds (attach a profiler meanwhile)")
    a = p.parse_args(argv)

    import asyncio
    import subprocess

    from ninfer_core.bench.http_load import messages as msgs
    from ninfer_core.engine.api import GenerationRequest, SamplingParams

    torch.set_num_threads(1)
    clients = [int(x) for x in a.clients.split(",") if x]
    runner = SleepRunner(512, a.step_ms / 1000, a.prefill_ms / 1000, a.text)
    engine, server, thread, port, tok, template = serve(runner, max(clients), a.tokens)

    async def one_engine(i):
        ids = tok.encode(template.render(msgs(i)))
        req = GenerationRequest(prompt_ids=ids, sampling=SamplingParams(greedy=True, temperature=0.0),
                                max_tokens=a.tokens, ignore_eos=True, request_id=f"bench-{i}")
        n = 0
        async for ev in engine.submit(req).events():
            if ev.kind == "error":
                raise RuntimeError(ev.error.message)
            if ev.kind == "finish":
                n = ev.usage.completion_tokens if ev.usage else n
        return n

    async def engine_gather(k):
        return sum(await asyncio.gather(*(one_engine(i) for i in range(k))))

    def cpu() -> tuple[float, float]:
        """CPU seconds so far of the engine thread, and of the server's threads (event loop, workers)."""
        eng = srv = 0.0
        for t in threading.enumerate():
            if t is threading.main_thread() or t.ident is None:
                continue
            try:
                sec = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, ProcessLookupError):
                continue
            if t is engine._thread:
                eng += sec
            else:
                srv += sec
        return eng, srv

    def engine_round(k):
        c0, t0 = cpu(), time.perf_counter()
        n = asyncio.run(engine_gather(k))
        t = time.perf_counter() - t0
        c1 = cpu()
        return n, t, c1[0] - c0[0], c1[1] - c0[1]

    def http_round(k):
        c0 = cpu()
        r = subprocess.run([sys.executable, "-m", "ninfer_core.bench.http_load", str(port), str(k), str(a.tokens)],
                           capture_output=True, text=True, timeout=600, check=False)
        c1 = cpu()
        if r.returncode != 0:
            raise RuntimeError(f"HTTP load failed: {r.stderr[-500:]}")
        got = json.loads(r.stdout.strip().splitlines()[-1])
        return got["tokens"], got["seconds"], c1[0] - c0[0], c1[1] - c0[1]

    def med(xs):
        return sorted(xs)[len(xs) // 2]

    def us(rounds, i):  # median CPU microseconds per generated token of column i
        return round(med([r[i] / r[0] for r in rounds]) * 1e6, 1)

    try:
        if a.http_loop:
            end = time.monotonic() + a.http_loop
            while time.monotonic() < end:
                http_round(max(clients))
            return 0
        for k in clients:
            engine_round(k)
            http_round(k)
            e = [engine_round(k) for _ in range(a.repeats)]
            h = [http_round(k) for _ in range(a.repeats)]
            e_rate, h_rate = med([r[0] / r[1] for r in e]), med([r[0] / r[1] for r in h])
            print(json.dumps({
                "streams": k, "tokens": h[0][0], "text": a.text, "step_ms": a.step_ms,
                "http_tok_s": round(h_rate, 1), "engine_tok_s": round(e_rate, 1), "ratio": round(h_rate / e_rate, 3),
                # CPU per generated token: the engine thread (bare / under HTTP), the server's threads
                "engine_thread_us": [us(e, 2), us(h, 2)], "server_threads_us": us(h, 3)}), flush=True)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
