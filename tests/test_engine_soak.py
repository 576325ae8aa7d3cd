"""A randomized mix of every way a request can end; afterwards the engine must be exactly idle,
its counters must add up, and every request that completed must match a run of its own."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import EngineError, GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.testing import ToyRunner, ToyTokenizer, collect, run_async

TOK = ToyTokenizer()
PREFILL_POISON = 251  # a prompt holding it fails in prefill
DECODE_POISON = 252  # feeding it at a position divisible by 5 fails the decode batch


def poisoned(kind, views, tokens):
    if kind == "prefill":
        return PREFILL_POISON in tokens
    return any(t == DECODE_POISON and v.num_cached % 5 == 0 for v, t in zip(views, tokens))


def random_request(rng: random.Random, max_context: int) -> tuple[GenerationRequest, str | None]:
    n = rng.choice([1, rng.randint(1, 40), rng.randint(1, 300)])
    prompt = [rng.randrange(0, 250) for _ in range(n)]
    if rng.random() < 0.05:
        prompt[rng.randrange(n)] = PREFILL_POISON
    if rng.random() < 0.03:
        prompt = [] if rng.random() < 0.5 else [1] * (max_context + rng.randint(0, 5))
    sampling = (SamplingParams(temperature=0.0) if rng.random() < 0.4 else
                SamplingParams(temperature=rng.choice([0.5, 1.0, 1.5]), top_p=rng.choice([1.0, 0.9]),
                               top_k=rng.choice([0, 5, 40]), min_p=rng.choice([0.0, 0.05]),
                               presence_penalty=rng.choice([0.0, 0.7]),
                               frequency_penalty=rng.choice([0.0, 0.2]),
                               seed=rng.randint(-(2**63), 2**63 - 1)))
    deadline = None
    r = rng.random()
    if r < 0.08:
        deadline = time.monotonic() - 1.0
    elif r < 0.16:
        deadline = time.monotonic() + rng.uniform(0.0, 0.02)
    request = GenerationRequest(
        prompt_ids=prompt, sampling=sampling,
        max_tokens=rng.choice([None, 0, 1, rng.randint(1, 120), rng.randint(1, 40), 1000]),
        stop=rng.choice([[], [], ["e"], ["ab", "\x00\x01"], ["hello"]]), ignore_eos=rng.random() < 0.5,
        deadline=deadline)
    cancel = rng.choice([None, None, None, "now", "soon", "later"])
    return request, cancel


async def soak(seed: int) -> None:
    rng = random.Random(seed)
    opts = EngineOptions(max_context=384, kv_capacity=rng.choice([384, 640, 1024]),
                         max_concurrency=rng.choice([1, 2, 3, 4]), max_pending_requests=rng.randint(1, 6),
                         prefill_chunk=rng.choice([16, 48, 100]),
                         decode_rounds_per_prefill=rng.choice([0, 1, 3]))
    runner = ToyRunner()
    runner.fail_if = poisoned
    eng = Engine(runner, TOK, opts)
    eng.start()
    tasks: list[tuple[GenerationRequest, object, asyncio.Task]] = []
    rejected = invalid = 0
    try:
        for _ in range(90):
            request, cancel = random_request(rng, opts.max_context)
            running = [t for _, _, t in tasks if not t.done()]
            if running and eng.snapshot()["outstanding"] >= eng.capacity and rng.random() < 0.85:
                await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            try:
                handle = eng.submit(request)
            except EngineError as e:
                assert e.status in (400, 429), e
                rejected += e.status == 429
                invalid += e.status == 400
                continue
            after = rng.randint(1, 6)

            def on_event(ev, handle=handle, after=after, plan=cancel, seen=[0]):
                seen[0] += 1
                if plan == "soon" and seen[0] == 1 or plan == "later" and seen[0] == after:
                    handle.cancel()

            if cancel == "now":
                handle.cancel()
            tasks.append((request, handle, asyncio.create_task(collect(handle, on_event))))
            for _ in range(rng.randint(0, 4)):
                await asyncio.sleep(0)
            if rng.random() < 0.3:
                await tasks[rng.randrange(len(tasks))][2]
        outcomes = [(r, h, await t) for r, h, t in tasks]
        snap = eng.snapshot()
    finally:
        runner.resume()
        eng.shutdown(timeout=30)

    # every stream: admitted at most once and first, exactly one terminal event, last
    count = dict(completed=0, cancelled=0, timed_out=0, failed=0)
    for request, handle, out in outcomes:
        kinds = out.kinds
        assert kinds[-1] in ("finish", "error") and sum(k in ("finish", "error") for k in kinds) == 1
        assert kinds.count("admitted") <= 1 and ("admitted" not in kinds or kinds[0] == "admitted")
        assert "delta" not in kinds or "admitted" in kinds
        if out.error is not None:
            if out.error.code == "request_queue_timeout":
                assert "admitted" not in kinds and out.error.status == 503
                count["timed_out"] += 1
            else:
                assert out.error.status == 500 and "injected" in out.error.message, out.error.message
                count["failed"] += 1
            continue
        fin = out.finish
        assert fin.usage.prompt_tokens == len(request.prompt_ids)
        if fin.finish_reason == "cancelled":
            count["cancelled"] += 1
            assert fin.usage.completion_tokens >= len(out.token_ids)
            continue
        count["completed"] += 1
        assert fin.usage.completion_tokens == len(out.token_ids) <= handle.max_tokens
        if fin.finish_reason == "length":
            assert len(out.token_ids) == handle.max_tokens
        if request.max_tokens is not None:
            assert handle.max_tokens == min(request.max_tokens, opts.max_context - len(request.prompt_ids))

    assert snap["lanes_active"] == 0 and snap["pending"] == 0 and snap["outstanding"] == 0, snap
    assert snap["pages_free"] == snap["pages_total"] and snap["slots_free"] == snap["slots_total"], snap
    c = snap["counters"]
    assert c["requests_completed"] == count["completed"] and c["requests_cancelled"] == count["cancelled"]
    assert c["requests_timed_out"] == count["timed_out"] and c["requests_failed"] == count["failed"]
    assert c["requests_rejected"] == rejected
    assert count["completed"] >= 10 and sum(count.values()) + rejected + invalid == 90

    # a completed request gives what it gives alone on a one-lane engine
    ref = Engine(ToyRunner(), TOK, EngineOptions(max_context=opts.max_context, kv_capacity=opts.kv_capacity,
                                                 prefill_chunk=1024, max_pending_requests=0))
    ref.start()
    try:
        for request, handle, out in outcomes:
            if out.finish is None or out.finish.finish_reason == "cancelled":
                continue
            alone = GenerationRequest(prompt_ids=request.prompt_ids, sampling=request.sampling,
                                      max_tokens=handle.max_tokens, stop=request.stop,
                                      ignore_eos=request.ignore_eos)
            again = await collect(ref.submit(alone))
            assert (again.token_ids, again.text) == (out.token_ids, out.text)
            assert again.finish.stop_reason == out.finish.stop_reason
    finally:
        ref.shutdown(timeout=30)


@pytest.mark.parametrize("seed", range(6))
def test_soak(seed):
    run_async(soak(seed), timeout=300)
