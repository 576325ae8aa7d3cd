"""HTTP load for `ninfer bench`: k concurrent streaming chat requests against a running server,
run in a separate process (`python -m ninfer_core.bench.http_load PORT K TOKENS`) so the clients'
parsing does not compete with the server and engine for one interpreter. Prints one JSON line:
{"tokens": generated tokens summed over the streams, "seconds": wall time of the round}; the
clock starts once the client is warm (a GET /health per stream first).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Benchmark prompt number {i}: say anything."}]


async def _one(client, port: int, i: int, tokens: int) -> int:
    body = {"model": "bench", "messages": messages(i), "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0, "ignore_eos": True}
    parts: list[bytes] = []
    async with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        # The stream is read as it arrives but parsed once at its end (only the usage chunk says
        # anything the load needs): per-event parsing would make this process, not the server,
        # the bottleneck on a host with few cores.
        async for part in r.aiter_raw():
            parts.append(part)
    used = None
    for event in b"".join(parts).split(b"\n\n"):
        if event.startswith(b"data: {") and b'"usage":{' in event:
            used = json.loads(event[6:])["usage"]["completion_tokens"]
    return used or 0


async def load(port: int, k: int, tokens: int) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=k)) as client:
        # Before the clock starts: this process's first-request work (lazy imports, connection
        # set-up), which the bare-engine side of the comparison does not pay either.
        await asyncio.gather(*(client.get(f"http://127.0.0.1:{port}/health") for _ in range(k)))
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(_one(client, port, i, tokens) for i in range(k)))
        return {"tokens": sum(counts), "seconds": time.perf_counter() - t0}


def main(argv: list[str]) -> int:
    port, k, tokens = (int(x) for x in argv[:3])
    print(json.dumps(asyncio.run(load(port, k, tokens))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
