"""The context-cache Prometheus series rendered from a real engine's snapshot (toy runner)."""

from __future__ import annotations

from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.cache_metrics import context_cache_metrics
from ninfer_core.engine.engine import Engine
from ninfer_core.testing import ToyRunner, ToyTokenizer, collect, run_async


def test_series_follow_the_engine_counters():
    eng = Engine(ToyRunner(), ToyTokenizer(), EngineOptions(max_context=1024, prefix_reuse=True))
    eng.start()
    try:
        async def go(p):
            return await collect(eng.submit(GenerationRequest(prompt_ids=p, sampling=SamplingParams(temperature=0),
                                                              max_tokens=4)))

        p = list(range(1, 100))
        out = run_async(go(p))
        run_async(go(p + out.token_ids + [5, 6]))
        text = context_cache_metrics(eng.snapshot())
    finally:
        eng.shutdown(timeout=30)
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert lines['ninfer:context_selections_total{source="root"}'] == "1"
    assert lines['ninfer:context_selections_total{source="private_endpoint"}'] == "1"
    assert lines['ninfer:context_selections_total{source="shared_stable_prefix"}'] == "0"
    assert lines["ninfer:reused_prompt_tokens_total"] == str(len(p) + len(out.token_ids) - 1)
    assert int(lines['ninfer:context_occupancy{pool="device_main_kv_pages"}']) > 0  # retained checkpoints
    assert "# TYPE ninfer:context_selections_total counter" in text
    assert context_cache_metrics({"context_cache": None}) == ""


def test_counters_render_exactly():
    from ninfer_core.engine.cache_metrics import family

    big = 2**53 + 1  # a token counter past float precision stays exact
    lines = family("x_total", "counter", "h", [({}, big), ({"a": "b"}, 0.25), ({"a": "c"}, 3.0)])
    assert lines == ["# HELP x_total h", "# TYPE x_total counter", f"x_total {big}", 'x_total{a="b"} 0.25',
                     'x_total{a="c"} 3']
