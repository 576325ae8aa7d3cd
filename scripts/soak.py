"""Soak a live `ninfer serve`: clients on every protocol, random cancels and disconnects, then idle.

    python scripts/soak.py --seconds 600 [--clients 8] [--artifact PATH] [--json OUT]

Starts a server (the default model unless --artifact; 2 lanes, so requests also queue) and runs
`--clients` concurrent clients for `--seconds`. Each client loops over a random protocol (Chat
Completions, legacy Completions, llama.cpp /completion, Responses, Anthropic Messages, streamed or
not, tokenize and count routes) and a random fate: read to the end, cancel a stream after a few
events (the connection closed), or abandon a non-streamed request mid-flight (a disconnect).
Conversations are sometimes continued so the context cache is exercised.

At the end it waits for the server to be idle and checks:
- GET /v1/load reports admitted, running and waiting 0 (nothing leaked);
- the server's RSS grew by less than --max-rss-growth (10%) from the end of the warm-up (the first
  --warmup-seconds, by default 10% of the run, at least 20 s) to the idle end;
- no answer was a 5xx other than a cancelled request's, and the server is still serving.
It prints one JSON summary (counts per protocol and fate, statuses, RSS, idle state) and exits 1
when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

WORDS = ("cache", "lane", "token", "page", "prefix", "engine", "stream", "tool", "answer", "count", "model",
         "round", "draft", "queue", "state", "slot")
PROTOCOLS = ("chat", "chat_stream", "completions", "completions_stream", "llamacpp", "llamacpp_stream",
             "responses", "responses_stream", "messages", "messages_stream", "tokenize", "count_tokens")
FATES = ("complete", "complete", "cancel", "disconnect")


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _request(rng: random.Random, protocol: str, history: list) -> tuple[str, dict, bool]:
    """(path, body, streams) of one request."""
    n = rng.randint(4, 40)
    prompt = _text(rng, rng.randint(3, 60))
    if history and rng.random() < 0.4:  # continue an earlier conversation: the cache's reuse path
        messages = history[rng.randrange(len(history))] + [{"role": "user", "content": prompt}]
    else:
        messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": prompt}]
    stream = protocol.endswith("_stream")
    base = protocol.removesuffix("_stream")
    if base == "chat":
        return "/v1/chat/completions", {"messages": messages, "max_tokens": n, "stream": stream,
                                        "temperature": rng.choice([0, 0.7])}, stream
    if base == "completions":
        return "/v1/completions", {"prompt": prompt, "max_tokens": n, "stream": stream}, stream
    if base == "llamacpp":
        return "/completion", {"prompt": prompt, "n_predict": n, "stream": stream}, stream
    if base == "responses":
        return "/v1/responses", {"model": "", "input": prompt, "max_output_tokens": n, "stream": stream,
                                 "store": rng.random() < 0.5}, stream
    if base == "messages":
        return "/v1/messages", {"model": "any", "max_tokens": n, "stream": stream,
                                "messages": [m for m in messages if m["role"] != "system"]}, stream
    if base == "tokenize":
        return "/tokenize", {"content": prompt}, False
    return "/v1/messages/count_tokens", {"model": "any", "messages": [{"role": "user", "content": prompt}]}, False


class Tally:
    def __init__(self):
        self.by = Counter()
        self.statuses = Counter()
        self.server_errors: list[str] = []


async def client(idx: int, base: str, model: str, deadline: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed * 1000 + idx)
    history: list = []
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(120.0)) as http:
        while time.monotonic() < deadline:
            protocol = rng.choice(PROTOCOLS)
            fate = rng.choice(FATES)
            path, body, streams = _request(rng, protocol, history)
            if "model" in body:
                body["model"] = model
            tally.by[(protocol, fate)] += 1
            try:
                if streams:
                    await _stream(http, path, body, fate, rng, tally)
                elif fate == "disconnect":
                    task = asyncio.create_task(http.post(path, json=body))
                    await asyncio.sleep(rng.uniform(0.01, 0.5))
                    task.cancel()  # the connection is closed under the request
                    try:
                        r = await task
                        tally.statuses[r.status_code] += 1
                    except (asyncio.CancelledError, httpx.HTTPError):
                        tally.statuses["disconnected"] += 1
                else:
                    r = await http.post(path, json=body)
                    tally.statuses[r.status_code] += 1
                    if r.status_code >= 500:
                        tally.server_errors.append(f"{path} {r.status_code} {r.text[:200]}")
                    elif r.status_code == 200 and path == "/v1/chat/completions" and rng.random() < 0.5:
                        reply = r.json()["choices"][0]["message"].get("content") or ""
                        history.append(body["messages"] + [{"role": "assistant", "content": reply}])
                        del history[:-4]
            except httpx.HTTPError as e:
                tally.statuses[f"transport:{type(e).__name__}"] += 1


async def _stream(http: httpx.AsyncClient, path: str, body: dict, fate: str, rng: random.Random,
                  tally: Tally) -> None:
    stop_after = rng.randint(1, 6) if fate in ("cancel", "disconnect") else None
    async with http.stream("POST", path, json=body) as r:
        tally.statuses[r.status_code] += 1
        if r.status_code >= 500:
            tally.server_errors.append(f"{path} {r.status_code} {(await r.aread())[:200]!r}")
            return
        events = 0
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                events += 1
                if '"error"' in line and '"type":"error"' in line.replace(" ", ""):
                    tally.statuses["stream_error_event"] += 1
            if stop_after is not None and events >= stop_after:
                tally.statuses["cancelled_stream"] += 1
                return  # leaving the block closes the connection mid-stream


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def start_server(artifact: str | None, flags: list[str], log_path: Path):
    from fuzz_openapi import start_server as start

    return start(artifact, flags, log_path)


async def wait_idle(base: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        while True:
            load = (await http.get("/v1/load")).json()
            req = load["requests"]
            if req["admitted"] == 0 and req["running"] == 0 and req["waiting"] == 0:
                return load
            if time.monotonic() > deadline:
                return load
            await asyncio.sleep(0.5)


async def run(a, proc, base: str) -> dict:
    pid = proc.pid
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
    tally = Tally()
    t0 = time.monotonic()
    deadline = t0 + a.seconds
    warmup = a.warmup_seconds if a.warmup_seconds is not None else max(20.0, 0.1 * a.seconds)
    clients = [asyncio.create_task(client(i, base, model, deadline, tally, a.seed)) for i in range(a.clients)]
    await asyncio.sleep(min(warmup, a.seconds))
    rss_warm = rss(pid)
    samples = [rss_warm]
    while time.monotonic() < deadline:
        await asyncio.sleep(min(10.0, max(0.1, deadline - time.monotonic())))
        samples.append(rss(pid))
    await asyncio.gather(*clients)
    load = await wait_idle(base, 120)
    await asyncio.sleep(2)
    rss_end = rss(pid)
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        alive = (await http.get("/health")).status_code == 200
        chat = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0})
    growth = (rss_end - rss_warm) / rss_warm
    req = load["requests"]
    idle = req["admitted"] == 0 and req["running"] == 0 and req["waiting"] == 0
    counters = load["counters"]
    return {
        "seconds": round(time.monotonic() - t0, 1), "clients": a.clients,
        "requests": sum(tally.by.values()),
        "by_protocol": dict(Counter({p: sum(v for (pp, _), v in tally.by.items() if pp == p) for p in PROTOCOLS})),
        "by_fate": dict(Counter({f: sum(v for (_, ff), v in tally.by.items() if ff == f) for f in set(FATES)})),
        "statuses": {str(k): v for k, v in tally.statuses.items()},
        "server_errors": tally.server_errors[:20],
        "engine": {k: counters.get(k) for k in ("requests_completed", "requests_cancelled", "requests_failed",
                                                 "requests_timed_out", "computed_prefill_tokens",
                                                 "committed_decode_tokens", "reused_prompt_tokens")},
        "idle": {"admitted": req["admitted"], "running": req["running"], "waiting": req["waiting"],
                 "kv_pages_in_use": load["occupancy"]["device_main_kv_pages"]},
        "rss_mib": {"after_warmup": round(rss_warm / 2**20, 1), "peak": round(max(samples) / 2**20, 1),
                    "end_idle": round(rss_end / 2**20, 1), "growth": round(growth, 4)},
        "serving_after": alive and chat.status_code == 200,
        "ok": idle and growth < a.max_rss_growth and not tally.server_errors and alive and chat.status_code == 200,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=600.0, help="length of the soak (default 600: 10 minutes)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--artifact", default=None, help="artifact to serve (default: the default model)")
    p.add_argument("--warmup-seconds", type=float, default=None,
                   help="RSS baseline after this long (default: 10%% of the run, at least 20 s)")
    p.add_argument("--max-rss-growth", type=float, default=0.10, help="allowed RSS growth (default 0.10)")
    p.add_argument("--seed", type=int, default=19)
    p.add_argument("--json", default=None, help="also write the summary here")
    p.add_argument("--log", default=None, help="server log path (default: a temporary file)")
    a = p.parse_args()
    log_path = Path(a.log or f"/tmp/ninfer-soak-{os.getpid()}.log")
    proc, base = start_server(a.artifact, ["--max-concurrency", "2", "--max-pending-requests", "32",
                                           "--max-context", "2048"], log_path)
    try:
        summary = asyncio.run(run(a, proc, base))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    summary["server_exit"] = proc.returncode
    summary["server_log_tracebacks"] = log_path.read_text(errors="replace").count("Traceback (most recent")
    summary["ok"] = summary["ok"] and summary["server_exit"] == 0 and not summary["server_log_tracebacks"]
    text = json.dumps(summary, indent=1)
    print(text, flush=True)
    if a.json:
        Path(a.json).write_text(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
