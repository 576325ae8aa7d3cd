"""Worker failures (spec "Startup readiness", "Stop the server"): out of memory and, with
--recover-invariant-failures, a broken invariant are recovered (the running requests fail, the
queue is served, ninfer:engine_recoveries_total counts); any other worker failure, or eight
recoveries in a row, latches the engine failed: everything pending fails with 503 engine_failed,
new requests are refused, the server's listener is told."""

from __future__ import annotations

import torch

from ninfer_core.config import EngineOptions, ServeOptions
from ninfer_core.engine.api import EngineError, GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.recovery import MAX_CONSECUTIVE, is_out_of_memory
from ninfer_core.server.context import ServerContext
from ninfer_core.server.metrics import render_metrics
from ninfer_core.testing import ToyRunner, ToyTokenizer, collect, run_async


def _request(prompt, max_tokens=4):
    return GenerationRequest(prompt_ids=prompt, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0))


def _submit_refused(eng, prompt) -> EngineError | None:
    async def go():
        try:
            eng.submit(_request(prompt))
        except EngineError as e:
            return e
        return None

    return run_async(go())


def _generate(eng, prompt):
    async def go():
        return await collect(eng.submit(_request(prompt)))

    return run_async(go())


def _series(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
    return float(line.split()[1])


def _broken_pick_prefill(eng, times: int):
    real = eng.scheduler.pick_prefill
    broken = {"left": times}

    def pick_prefill():
        if broken["left"]:
            broken["left"] -= 1
            raise RuntimeError("invariant broken")
        return real()

    eng.scheduler.pick_prefill = pick_prefill


def test_a_broken_invariant_is_recovered_with_the_flag_and_the_engine_serves_on():
    eng = Engine(ToyRunner(), ToyTokenizer(), EngineOptions(max_context=512, recover_invariant_failures=True))
    _broken_pick_prefill(eng, 1)
    eng.start()
    ctx = ServerContext(options=ServeOptions(), engine=eng)
    try:
        assert _series(render_metrics(ctx), "ninfer:engine_recoveries_total") == 0
        first = _generate(eng, [5, 6, 7, 8])
        assert first.error is not None and first.error.status == 500  # the request it held failed
        assert first.error.code == "internal_error"
        second = _generate(eng, [5, 6, 7, 8])
        assert second.error is None and second.finish is not None and len(second.token_ids) == 4
        snap = eng.snapshot()
        assert snap["counters"]["engine_recoveries"] == 1 and snap["counters"]["requests_failed"] == 1
        assert snap["failed"] is None
        assert _series(render_metrics(ctx), "ninfer:engine_recoveries_total") == 1
    finally:
        eng.shutdown(timeout=30)


def test_without_the_flag_a_broken_invariant_latches_the_engine_failed():
    eng = Engine(ToyRunner(), ToyTokenizer(), EngineOptions(max_context=512))
    _broken_pick_prefill(eng, 1)
    told: list[str] = []
    eng.recovery.on_failure(told.append)
    eng.start()
    try:
        first = _generate(eng, [5, 6, 7, 8])
        assert first.error is not None and first.error.status == 503 and first.error.code == "engine_failed"
        assert told and "invariant broken" in told[0]
        e = _submit_refused(eng, [1, 2, 3])
        assert e is not None and (e.status, e.code) == (503, "engine_failed")
        snap = eng.snapshot()
        assert "invariant broken" in snap["failed"] and snap["counters"]["engine_recoveries"] == 0
        late: list[str] = []
        eng.recovery.on_failure(late.append)  # a listener added afterwards is told at once
        assert late == told
    finally:
        eng.shutdown(timeout=30)


def test_out_of_memory_in_a_forward_fails_the_running_requests_and_serves_the_queue():
    runner = ToyRunner()
    eng = Engine(runner, ToyTokenizer(), EngineOptions(max_context=1024, max_concurrency=1, prefix_reuse=True))
    real_forward = runner.forward
    state = {"armed": False}

    def forward(batch):
        if state["armed"]:
            state["armed"] = False
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_forward(batch)

    runner.forward = forward
    eng.start()
    ctx = ServerContext(options=ServeOptions(), engine=eng)
    try:
        warm_prompt = list(range(1, 80))
        warm = _generate(eng, warm_prompt)  # leaves a retained conversation in the cache
        assert warm.error is None
        assert eng.snapshot()["context_cache"]["private_continuations"] == 1
        follow = warm_prompt + warm.token_ids + [3, 4]

        async def two():
            runner.pause()
            a = eng.submit(_request(list(range(100, 140)), max_tokens=8))
            b = eng.submit(_request(list(range(200, 240)), max_tokens=8))  # waits: one lane
            runner.entered.wait(10)
            state["armed"] = True
            runner.resume()
            return await collect(a), await collect(b)

        a, b = run_async(two())
        assert a.error is not None and (a.error.status, a.error.code) == (503, "out_of_memory")
        assert b.error is None and len(b.token_ids) == 8  # the queued request was served after the recovery
        snap = eng.snapshot()
        assert snap["counters"]["engine_recoveries"] == 1 and snap["failed"] is None
        assert snap["lanes_active"] == 0 and snap["pending"] == 0
        with eng._cv:
            eng.cache.audit([])  # pages and slots match their holders after the release
        assert _series(render_metrics(ctx), "ninfer:engine_recoveries_total") == 1
        again = _generate(eng, follow)  # the recovery released the warm conversation: no reuse
        assert again.error is None and again.finish.usage.cached_tokens == 0
    finally:
        eng.shutdown(timeout=30)


def test_eight_recoveries_in_a_row_latch_the_engine():
    eng = Engine(ToyRunner(), ToyTokenizer(), EngineOptions(max_context=512, recover_invariant_failures=True))
    _broken_pick_prefill(eng, 10 * MAX_CONSECUTIVE)
    told: list[str] = []
    eng.recovery.on_failure(told.append)
    eng.start()
    try:
        outcomes = []
        for _ in range(MAX_CONSECUTIVE):
            outcomes.append(_generate(eng, [5, 6, 7, 8]))
        codes = [o.error.code for o in outcomes]
        assert codes[: MAX_CONSECUTIVE - 1] == ["internal_error"] * (MAX_CONSECUTIVE - 1)
        assert codes[-1] == "engine_failed"  # the eighth failure in a row latches instead
        assert told and "consecutive recoveries" in told[0]
        assert eng.snapshot()["counters"]["engine_recoveries"] == MAX_CONSECUTIVE
        e = _submit_refused(eng, [1])
        assert e is not None and e.code == "engine_failed"
    finally:
        eng.shutdown(timeout=30)


def test_out_of_memory_is_recognised():
    assert is_out_of_memory(torch.OutOfMemoryError("x"))
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("invariant broken"))
