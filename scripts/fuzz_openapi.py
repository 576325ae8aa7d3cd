"""Fuzz every route of a live `ninfer serve` from its own /openapi.json with schemathesis.

    python scripts/fuzz_openapi.py [--max-examples 25] [--artifact PATH] [--report-dir DIR]

Starts a server (the default model unless --artifact, a short --max-context and --default-max-tokens
8; scripts/fuzz_hooks.py caps a fuzzed output limit at 8 tokens, so generation stays cheap on a
CPU), waits until /health answers 200, then runs

    schemathesis run http://HOST:PORT/openapi.json --checks not_a_server_error,
        response_schema_conformance,status_code_conformance,content_type_conformance

with a bounded number of examples per operation (positive and negative data). Every answer must
be a non-5xx in its route's documented envelope. Prints schemathesis's summary and, from its
NDJSON events, the number of requests sent and of failures per check; exits non-zero on any
failure. Stops the server (SIGTERM) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
CHECKS = "not_a_server_error,response_schema_conformance,status_code_conformance,content_type_conformance"
_LISTEN = re.compile(r"listening on http://([0-9.]+):(\d+)")


def start_server(artifact: str | None, flags: list[str], log_path: Path, timeout: float = 300.0):
    cmd = [sys.executable, "-m", "ninfer_core.cli", "serve", *([artifact] if artifact else []),
           "--host", "127.0.0.1", "--port", "0", *flags]
    with open(log_path, "wb") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=str(REPO),
                                env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + timeout
    port = None
    while port is None:
        m = _LISTEN.search(log_path.read_text(errors="replace"))
        if m:
            port = int(m.group(2))
        elif proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start:\n{log_path.read_text(errors='replace')}")
        else:
            time.sleep(0.1)
    base = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not become ready:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.2)


def summarize(ndjson: Path) -> dict:
    """Requests sent and failures per check, from schemathesis's NDJSON event stream."""
    requests, failures = 0, {}
    if not ndjson.exists():
        return {"requests": None, "failures": None}
    for line in ndjson.read_text(errors="replace").splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        body = next(iter(ev.values())) if isinstance(ev, dict) and len(ev) == 1 else ev
        recorder = body.get("recorder") if isinstance(body, dict) else None
        if not isinstance(recorder, dict):
            continue
        requests += len(recorder.get("interactions") or {})
        for checks in (recorder.get("checks") or {}).values():
            for c in checks:
                if c.get("status") == "FAILURE":
                    failures[c.get("name")] = failures.get(c.get("name"), 0) + 1
    return {"requests": requests, "failures": failures}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--artifact", default=None, help="artifact to serve (default: the default model)")
    p.add_argument("--max-examples", type=int, default=25, help="test cases per operation (default 25)")
    p.add_argument("--max-context", type=int, default=512, help="--max-context of the fuzzed server (default 512)")
    p.add_argument("--report-dir", default=None, help="keep the server log and schemathesis reports here")
    p.add_argument("--seed", type=int, default=19, help="schemathesis seed (default 19)")
    p.add_argument("--phases", default="examples,coverage,fuzzing", help="schemathesis phases")
    a = p.parse_args()
    out = Path(a.report_dir or (REPO / ".fuzz-report"))
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "server.log"
    # a default output limit of 8 keeps requests that name none cheap; fuzz_hooks caps those that do
    # --slot-save-path: POST /slots/{id} runs (without it every call is the spec's 501, a 5xx)
    slots = out / "slots"
    slots.mkdir(exist_ok=True)
    # the pool is exactly one context: a request whose output limit is -1 (the derived budget, the
    # whole pool) is admitted only once the pressure planner makes room past retained conversations
    proc, base = start_server(a.artifact, ["--max-context", str(a.max_context), "--max-pending-requests", "64",
                                           "--default-max-tokens", "8", "--slot-save-path", str(slots)], log_path)
    ndjson = out / "events.ndjson"
    t0 = time.monotonic()
    try:
        cmd = ["schemathesis", "run", f"{base}/openapi.json", "--checks", CHECKS, "--max-examples",
               str(a.max_examples), "--workers", "1", "--seed", str(a.seed), "--phases", a.phases,
               "--request-timeout", "600", "--report", "ndjson", "--report-ndjson-path", str(ndjson),
               "--generation-database", "none", "--no-color", "--suppress-health-check", "all"]
        print("+", " ".join(cmd), flush=True)
        # the hooks module caps fuzzed output limits (scripts/fuzz_hooks.py)
        env = dict(os.environ, SCHEMATHESIS_HOOKS="fuzz_hooks",
                   PYTHONPATH=os.pathsep.join([str(REPO / "scripts"), os.environ.get("PYTHONPATH", "")]))
        rc = subprocess.call(cmd, cwd=str(out), env=env)
        alive = proc.poll() is None and httpx.get(base + "/health", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    facts = summarize(ndjson)
    print(json.dumps({"schemathesis_exit": rc, "seconds": round(time.monotonic() - t0, 1), **facts,
                      "server_alive_after": alive}), flush=True)
    server_log = log_path.read_text(errors="replace")
    tracebacks = server_log.count("Traceback (most recent call last)")
    if tracebacks:
        print(f"the server log has {tracebacks} traceback(s): {log_path}", flush=True)
    return 0 if rc == 0 and alive and not tracebacks else 1


if __name__ == "__main__":
    sys.exit(main())
