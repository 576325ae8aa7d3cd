"""The streaming fast paths (issue 6): the chat chunk encoder is byte-identical to encoding the
whole chunk object, engine events reach asyncio in order with one wakeup per decode round, the
deferred delivery of launch-only (CUDA-like) runners changes no output, and the listening socket
turns Nagle off for the connections it accepts."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading

import pytest

from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import EngineEvent, GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.request import RequestHandle, post_batch
from ninfer_core.protocols.openai_chat import ChunkEncoder
from ninfer_core.server.serve import bind_socket
from ninfer_core.server.sse import event_batches, sse_data, with_keepalive
from ninfer_core.testing import ToyRunner, ToyTokenizer, collect, run_async

TEXTS = ["", "a", "hello world", 'quote " and \\ backslash', "tab\tnew\nline\r\x00\x1f\x7f", "é€😀 中文",
         "\u2028\u2029", "</think>\n\n", "\ufffd", "{\"json\": [1, 2]}", " " * 5]


def _previous(obj) -> str:
    """The encoding the stream used before the fast path (json.dumps per chunk object)."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _chunk_obj(cid, created, model, include_usage, delta, lp, finish=None) -> dict:
    obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}
    if include_usage:
        obj["usage"] = None
    return obj


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("model", ["bench", 'm"odel/é'])
def test_text_delta_is_byte_identical_to_the_object_encoding(include_usage, model):
    rng = random.Random(6)
    texts = TEXTS + ["".join(chr(rng.choice([rng.randrange(0x20, 0x7f), rng.randrange(0, 0x20),
                                             rng.randrange(0xa0, 0x3000), rng.randrange(0x1f300, 0x1f600)]))
                             for _ in range(rng.randrange(1, 12))) for _ in range(200)]
    enc = ChunkEncoder("chatcmpl-0f", 1764547200, model, include_usage)
    record = {"token": "a\"b", "logprob": -0.25, "bytes": [97, 34, 98], "top_logprobs": []}
    for text in texts:
        for key in ("content", "reasoning_content"):
            for lp in (None, {"content": [], "refusal": None}, {"content": [record], "refusal": None}):
                want = _previous(_chunk_obj("chatcmpl-0f", 1764547200, model, include_usage, {key: text}, lp))
                assert enc.text_delta(key, text, lp) == want
                assert enc.chunk({key: text}, None, lp) == want
    want = _previous(dict(_chunk_obj("chatcmpl-0f", 1764547200, model, include_usage, {}, None, "stop"),
                          timings={"predicted_n": 3}))
    assert enc.chunk({}, "stop", None, timings={"predicted_n": 3}) == want


def test_sse_data_matches_json_dumps():
    for obj in [{"a": TEXTS, "b": None, "c": 1.5, "d": [True, False], "e": {"x": -1}}, [], "s", 3]:
        assert sse_data(obj) == _previous(obj)


def test_batched_delivery_is_ordered_with_one_wakeup_per_loop():
    async def go():
        loop = asyncio.get_running_loop()
        handles = [RequestHandle(f"r{i}", loop, lambda: None, 1, 8) for i in range(3)]
        calls = []
        original = loop.call_soon_threadsafe

        def counting(*args):
            calls.append(args[0])
            return original(*args)

        loop.call_soon_threadsafe = counting
        streams = [h.events().batches(None) for h in handles]
        items = []
        for i, h in enumerate(handles):
            items += [(h, EngineEvent("delta", token_ids=[i, j], text=f"{i}.{j}")) for j in range(3)]
        items.append((handles[0], EngineEvent("finish", finish_reason="stop")))
        thread = threading.Thread(target=post_batch, args=(items,))
        thread.start()
        thread.join()
        got = [await s.__anext__() for s in streams]
        loop.call_soon_threadsafe = original
        return calls, got

    calls, got = run_async(go())
    assert len(calls) == 1  # one wakeup carried the whole round
    assert [e.text for e in got[0]] == ["0.0", "0.1", "0.2", ""] and got[0][-1].kind == "finish"
    assert [e.text for e in got[1]] == ["1.0", "1.1", "1.2"]
    assert [e.token_ids for e in got[2]] == [[2, 0], [2, 1], [2, 2]]


def test_keepalive_then_events_through_both_readers():
    async def go():
        loop = asyncio.get_running_loop()
        h = RequestHandle("r", loop, lambda: None, 1, 8)
        seen = []

        async def read():
            async for item in with_keepalive(h.events(), 0.001):
                seen.append(item)
                if item is None and seen.count(None) == 1:  # after the first keep-alive: deliver
                    h.post(EngineEvent("delta", text="x"))
                    h.post(EngineEvent("finish", finish_reason="stop"))

        await read()
        h2 = RequestHandle("r2", loop, lambda: None, 1, 8)
        h2.post(EngineEvent("delta", text="y"))
        h2.post(EngineEvent("finish", finish_reason="length"))
        batches = [b async for b in event_batches(h2.events(), 10.0)]
        plain = RequestHandle("r3", loop, lambda: None, 1, 8)
        plain.post(EngineEvent("finish", finish_reason="stop"))
        one_by_one = [e async for e in plain.events()]
        return seen, batches, one_by_one

    seen, batches, one_by_one = run_async(go())
    assert seen[0] is None and [e.kind for e in seen if e is not None] == ["delta", "finish"]
    assert [[e.text for e in b] for b in batches] == [["y", ""]]
    assert [e.finish_reason for e in one_by_one] == ["stop"]


class _LaunchRunner(ToyRunner):
    launches_async = True  # the engine delivers a round's events after the next forward's launch


def _run_mix(runner: ToyRunner, prefix_reuse: bool) -> list:
    tok = ToyTokenizer()
    eng = Engine(runner, tok, EngineOptions(max_context=256, max_concurrency=4, prefix_reuse=prefix_reuse))
    eng.start()
    rng = random.Random(3)
    reqs = [GenerationRequest(prompt_ids=[rng.randrange(0, 256) for _ in range(rng.randrange(3, 40))],
                              sampling=SamplingParams(temperature=0.0), max_tokens=n, stop=stop,
                              ignore_eos=True, logprobs=lp)
            for n, stop, lp in [(12, [], None), (0, [], None), (20, ["e"], 2), (7, [], 0), (30, [], None)]]

    async def go():
        outs = await asyncio.gather(*(collect(eng.submit(r)) for r in reqs))
        outs += await asyncio.gather(*(collect(eng.submit(r)) for r in reqs[:2]))  # again: cache hits
        return [(o.kinds, o.token_ids, o.text, o.finish.finish_reason, o.finish.usage.completion_tokens,
                 [[(r.token_id, r.logprob) for r in (e.logprobs or [])] for e in o.events if e.kind == "delta"])
                for o in outs]

    try:
        return run_async(go())
    finally:
        eng.shutdown(timeout=30)


@pytest.mark.parametrize("prefix_reuse", [False, True])
def test_launch_only_runner_delivery_changes_no_output(prefix_reuse):
    assert _run_mix(_LaunchRunner(), prefix_reuse) == _run_mix(ToyRunner(), prefix_reuse)


def test_accepted_connections_have_nagle_off():
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]

    async def go():
        flags = []

        async def on_conn(reader, writer):
            flags.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_conn, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            while not flags:
                await asyncio.sleep(0.01)
            writer.close()
        return flags

    assert run_async(go()) == [1]


@pytest.mark.parametrize("runner_cls", [ToyRunner, _LaunchRunner])
def test_engine_wakes_the_loop_once_per_round_not_per_token(runner_cls):
    tok = ToyTokenizer()
    # every token prints: the toy's logits pick among the printable bytes only
    runner = runner_cls(policy=lambda prefix: 97 + (len(prefix) * 7) % 26)
    eng = Engine(runner, tok, EngineOptions(max_context=256, max_concurrency=4))

    async def go():
        loop = asyncio.get_running_loop()
        calls = []
        original = loop.call_soon_threadsafe

        def counting(*args):
            calls.append(args[0])
            return original(*args)

        loop.call_soon_threadsafe = counting
        handles = [eng.submit(GenerationRequest(prompt_ids=[1, 2, 3 + i], sampling=SamplingParams(temperature=0.0),
                                                max_tokens=24, ignore_eos=True)) for i in range(4)]
        # all four wait before the worker starts, so they run in the same rounds on any machine
        # (started first, a busy CI host let the worker run a lane alone before the next arrived)
        eng.start()
        outs = await asyncio.gather(*(collect(h) for h in handles))
        loop.call_soon_threadsafe = original
        return calls, outs

    try:
        calls, outs = run_async(go())
    finally:
        eng.shutdown(timeout=30)
    deltas = sum(o.kinds.count("delta") for o in outs)
    assert all(len(o.token_ids) == 24 and o.finish is not None for o in outs)
    assert deltas >= 4 * 20  # one event per token per stream...
    assert len(calls) <= deltas // 2  # ...but a wakeup carries every lane's event of a round (per token: > deltas)
