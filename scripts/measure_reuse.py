#!/usr/bin/env python3
"""Measure the admission alternatives on real client request sequences (CPU, ninfer-tiny).

    PYTHONPATH=. python scripts/measure_reuse.py [--clients codex,claude-code,webui] [--out FILE]

For each admission configuration a fresh `ninfer serve --max-context 65536 --drop-hosted-tools`
replays each sequence: the captured Codex and Claude Code fixtures (tests/e2e/fixtures/clients) and
the llama.cpp WebUI's chat request (its 328-token prompt with its two built-in tools and
max_tokens -1) sent twice, as its regenerate button does, then continued. Every request is sent
greedy (temperature 0) so outputs can be compared. It prints, per configuration and request, the
prompt tokens, the reused tokens and the time to the end of the response, and whether each later
request's output equals the output a cold server (nothing cached) gives for the same request.

Configurations: `reserve` (--reserve-continuation-pages: the whole entitlement reserved up front,
the admission before own-pages leases), `lease-growth` (--reserve-continuation-pages
--kv-lease-growth), `own-pages` (the default).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "e2e" / "fixtures" / "clients"
SERVER = ["--max-context", "65536", "--drop-hosted-tools"]
CONFIGS = {"reserve": ["--reserve-continuation-pages"],
           "lease-growth": ["--reserve-continuation-pages", "--kv-lease-growth"],
           "own-pages": []}
WEBUI_TOOLS = [
    {"type": "function", "function": {"name": "get_datetime", "description": "Returns the current local date and "
     "time in ISO 8601 format, with the IANA time zone name", "parameters": {"type": "object", "properties": {},
                                                                          "required": []}}},
    {"type": "function", "function": {"name": "get_info", "description": "Get runtime info (OS name), may call "
     "when user asks about local files or shell commands", "parameters": {"type": "object", "properties": {},
                                                                       "required": []}}}]


def webui_sequence() -> list[dict]:
    def body(messages):
        return {"messages": messages, "stream": True, "return_progress": True, "timings_per_token": True,
                "reasoning_control": True, "reasoning_format": "auto", "sse_ping_interval": 1, "max_tokens": -1,
                "tools": WEBUI_TOOLS}
    q = [{"role": "user", "content": "What is 38 + 47?"}]
    follow = q + [{"role": "assistant", "content": "85", "reasoning_content":
                   "No tool is needed. 8 + 7 = 15; 3 + 4 + 1 = 8. So 38 + 47 = 85."},
                  {"role": "user", "content": "What is 12 + 30?"}]
    return [{"method": "POST", "path": "/v1/chat/completions", "headers": {}, "body": b}
            for b in (body(q), body(q), body(follow))]


def fixture_sequence(name: str) -> list[dict]:
    doc = json.loads((FIXTURES / f"{name}.json").read_text())
    return [r for t in doc["turns"] for r in t["requests"] if r["method"] == "POST"]


def start(flags: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    out = open(log, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "ninfer_core.cli", "serve", "--port", "0", *SERVER, *flags],
                            stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + 600
    while True:
        m = re.search(r"listening on (http://[0-9.]+:\d+)", log.read_text(errors="replace"))
        if m:
            base = m.group(1)
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    return proc, base
            except httpx.TransportError:
                pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(log.read_text())
        time.sleep(0.2)


def send(base: str, req: dict) -> tuple[int, int, str, float]:
    """(prompt tokens, reused tokens, output text, seconds) of one greedy request."""
    body = dict(req["body"])
    body["temperature"] = 0
    headers = {k: v for k, v in req.get("headers", {}).items()
               if k.lower() not in ("host", "content-length", "accept-encoding", "connection")}
    t0 = time.monotonic()
    r = httpx.post(base + req["path"], params=req.get("query") or None, headers=headers,
                   content=json.dumps(body).encode(), timeout=3600)
    dt = time.monotonic() - t0
    r.raise_for_status()
    text, prompt, reused = [], 0, 0
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        kind = ev.get("type")
        if kind == "content_block_start" and ev["content_block"]["type"] == "tool_use":
            text.append(ev["content_block"]["name"])  # its id is random
        elif kind == "content_block_delta":
            text.append(ev["delta"].get("text") or ev["delta"].get("thinking") or ev["delta"].get("partial_json") or "")
        elif kind == "message_delta":
            u = ev["usage"]
            prompt, reused = u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta",
                      "response.function_call_arguments.delta"):
            text.append(ev["delta"])
        elif kind in ("response.completed", "response.incomplete"):
            u = ev["response"]["usage"]
            prompt, reused = u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
        elif kind is None and ev.get("choices") is not None:
            if ev["choices"]:
                d = ev["choices"][0].get("delta") or {}
                calls = [{k: v for k, v in c.items() if k != "id"} for c in d.get("tool_calls") or []]
                text.append((d.get("reasoning_content") or "") + (d.get("content") or "")
                            + (json.dumps(calls) if calls else ""))  # call ids are random
            if ev.get("usage"):
                prompt = ev["usage"]["prompt_tokens"]
            if ev.get("timings") and ev["choices"] and ev["choices"][0].get("finish_reason"):
                t = ev["timings"]
                prompt, reused = t["cache_n"] + t["prompt_n"], t["cache_n"]
    return prompt, reused, "".join(text), dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="codex,claude-code,webui")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default=None, help="also write the report here")
    p.add_argument("--logs", default="/tmp/ninfer-measure-reuse")
    a = p.parse_args()
    logs = Path(a.logs)
    logs.mkdir(parents=True, exist_ok=True)
    seqs = {c: (webui_sequence() if c == "webui" else fixture_sequence(c)) for c in a.clients.split(",")}
    lines = [f"# measure_reuse: {time.strftime('%Y-%m-%d %H:%M')}, ninfer-tiny on CPU, "
             f"ninfer serve {' '.join(SERVER)} + the configuration's flags; greedy requests", ""]
    results: dict[str, dict[str, list]] = {}
    for cname in a.configs.split(","):
        results[cname] = {}
        for client, seq in seqs.items():
            proc, base = start(CONFIGS[cname], logs / f"{cname}-{client}.log")
            try:
                results[cname][client] = [send(base, r) for r in seq]
            finally:
                proc.terminate()
                proc.wait(60)
    cold: dict[str, list] = {}
    for client, seq in seqs.items():  # each later request on a fresh server: nothing to reuse
        cold[client] = [None]
        for i, r in enumerate(seq[1:], 1):
            proc, base = start([], logs / f"cold-{client}-{i}.log")
            try:
                cold[client].append(send(base, r))
            finally:
                proc.terminate()
                proc.wait(60)
    lines.append(f"{'config':<13} {'client':<12} {'req':>3} {'prompt':>7} {'reused':>7} {'ratio':>6} "
                 f"{'seconds':>8} {'= cold':>7}")
    for cname, per in results.items():
        for client, rows in per.items():
            for i, (prompt, reused, text, dt) in enumerate(rows):
                same = "-" if i == 0 else ("yes" if text == cold[client][i][2] else "NO")
                ratio = reused / prompt if prompt else 0.0
                lines.append(f"{cname:<13} {client:<12} {i + 1:>3} {prompt:>7} {reused:>7} {ratio:>6.3f} "
                             f"{dt:>8.1f} {same:>7}")
    for client, rows in cold.items():
        for i, row in enumerate(rows[1:], 2):
            lines.append(f"{'cold':<13} {client:<12} {i:>3} {row[0]:>7} {row[1]:>7} {'':>6} {row[3]:>8.1f}")
    report = "\n".join(lines)
    print(report)
    if a.out:
        Path(a.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
