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
    lines = samples(text)
    assert lines['ninfer:context_selections_total{source="root"}'] == 1
    assert lines['ninfer:context_selections_total{source="private_endpoint"}'] == 1
    assert lines['ninfer:context_selections_total{source="shared_stable_prefix"}'] == 0
    assert lines["ninfer:reused_prompt_tokens_total"] == len(p) + len(out.token_ids) - 1
    assert lines['ninfer:context_occupancy{pool="device_main_kv_pages"}'] > 0  # retained checkpoints
    assert "# TYPE ninfer:context_selections_total counter" in text
    assert context_cache_metrics({"context_cache": None}) == ""


def samples(text: str) -> dict[str, float]:
    """{'name{label="v",...}': value} as a Prometheus scraper reads the text (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_label_values_are_escaped_and_large_counters_parse():
    from ninfer_core.engine.cache_metrics import labelled, render

    text = render([labelled("counter", "x_total", "h", "a", [('q"uo\\te', 2**53 + 1), ("b", 0.25)])])
    assert 'x_total{a="q\\"uo\\\\te"}' in text  # the quote and the backslash escaped
    lines = samples(text)
    assert lines['x_total{a="q"uo\\te"}'] == float(2**53 + 1) and lines['x_total{a="b"}'] == 0.25
