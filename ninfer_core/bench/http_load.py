"""HTTP load for `ninfer bench`: k concurrent streaming chat requests against a running server,
run in a separate process (`python -m ninfer_core.bench.http_load PORT K TOKENS`) so the clients'
parsing does not compete with the server and engine for one interpreter. Prints one JSON line:
{"tokens": generated tokens summed over the streams, "seconds": wall time of the round,
"text_events": stream events carrying text (content or reasoning), summed}; the
clock starts once the client is warm (a GET /health per stream first) and stops when the last
stream ends; the streams are parsed after that.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Benchmark prompt number {i}: say anything."}]


async def _one(client, port: int, i: int, tokens: int) -> bytes:
    body = {"model": "bench", "messages": messages(i), "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0, "ignore_eos": True}
    parts: list[bytes] = []
    async with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        # The stream is read as it arrives but parsed only after the clock stops: per-event
        # parsing would make this process, not the server, the bottleneck on a host with few cores.
        async for part in r.aiter_raw():
            parts.append(part)
    return b"".join(parts)


def _count(stream: bytes) -> tuple[int, int]:
    """(completion tokens from the usage chunk, events whose delta carries text)."""
    used, texts = None, 0
    for event in stream.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        if b'"usage":{' in event:
            used = json.loads(event[6:])["usage"]["completion_tokens"]
        if b'content":"' in event:  # a content or reasoning_content delta
            for choice in json.loads(event[6:]).get("choices") or []:
                delta = choice.get("delta") or {}
                texts += 1 if (delta.get("content") or delta.get("reasoning_content")) else 0
    return used or 0, texts


async def load(port: int, k: int, tokens: int) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=k)) as client:
        # Before the clock starts: this process's first-request work (lazy imports, connection
        # set-up), which the bare-engine side of the comparison does not pay either.
        await asyncio.gather(*(client.get(f"http://127.0.0.1:{port}/health") for _ in range(k)))
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(_one(client, port, i, tokens) for i in range(k)))
        seconds = time.perf_counter() - t0
    counts = [_count(s) for s in streams]
    return {"tokens": sum(c[0] for c in counts), "seconds": seconds, "text_events": sum(c[1] for c in counts)}


def main(argv: list[str]) -> int:
    port, k, tokens = (int(x) for x in argv[:3])
    print(json.dumps(asyncio.run(load(port, k, tokens))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
