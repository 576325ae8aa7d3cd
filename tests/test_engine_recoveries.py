"""ninfer:engine_recoveries_total: a worker iteration that fails outside any one forward fails the
requests it holds, is counted, and the Engine goes on serving."""

from __future__ import annotations

from ninfer_core.config import EngineOptions, ServeOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.server.context import ServerContext
from ninfer_core.server.metrics import render_metrics
from ninfer_core.testing import ToyRunner, ToyTokenizer, collect, run_async


def _generate(eng, prompt):
    async def go():
        return await collect(eng.submit(GenerationRequest(prompt_ids=prompt, max_tokens=4,
                                                          sampling=SamplingParams(temperature=0.0))))

    return run_async(go())


def _series(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
    return float(line.split()[1])


def test_a_failed_iteration_is_a_recovery_and_the_engine_serves_on():
    eng = Engine(ToyRunner(), ToyTokenizer(), EngineOptions(max_context=512))
    real = eng.scheduler.pick_prefill
    broken = {"left": 1}

    def pick_prefill():
        if broken["left"]:
            broken["left"] -= 1
            raise RuntimeError("invariant broken")
        return real()

    eng.scheduler.pick_prefill = pick_prefill
    eng.start()
    ctx = ServerContext(options=ServeOptions(), engine=eng)
    try:
        assert _series(render_metrics(ctx), "ninfer:engine_recoveries_total") == 0
        first = _generate(eng, [5, 6, 7, 8])
        assert first.error is not None and first.error.status == 500  # the request it held failed
        second = _generate(eng, [5, 6, 7, 8])
        assert second.error is None and second.finish is not None and len(second.token_ids) == 4
        snap = eng.snapshot()["counters"]
        assert snap["engine_recoveries"] == 1 and snap["requests_failed"] == 1
        assert _series(render_metrics(ctx), "ninfer:engine_recoveries_total") == 1
    finally:
        eng.shutdown(timeout=30)
