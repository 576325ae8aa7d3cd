"""The context-cache series of GET /metrics (spec "Metrics"), built from an engine snapshot.

`context_cache_families(snapshot)` returns prometheus_client metric families that the server's
/metrics collector (ninfer_core.server.metrics) yields after the request and token series;
prometheus_client writes the text format (label values escaped). `context_cache_metrics` renders
them alone, for tests and tools.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ninfer_core.engine.checkpoints import SOURCES

# The spec's five events, and private_owner_demoted (a subset of private_owner_degraded: the
# degradation moved the owner's KV or StateImage to Host, spec JSONL pressure.private_owners_demoted).
PRESSURE_EVENTS = ("private_owner_evicted", "private_owner_degraded", "shared_owner_evicted",
                   "shared_owner_degraded", "checkpoint_dropped", "private_owner_demoted")


def labelled(kind: str, name: str, help_: str, label: str | list[str], samples: list[tuple[Any, float]]) -> Metric:
    """One family with a sample per label value (a value tuple when `label` names several)."""
    labels = [label] if isinstance(label, str) else list(label)
    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    fam = cls(name, help_, labels=labels)
    for values, v in samples:
        fam.add_metric([str(x) for x in (values if isinstance(values, tuple) else (values,))], float(v))
    return fam


def _num(d: Any, key: str) -> float:
    v = d.get(key, 0) if isinstance(d, dict) else 0
    return float(v) if isinstance(v, (int, float)) else 0.0


def context_cache_families(snapshot: dict[str, Any]) -> list[Metric]:
    """The context-cache metric families; empty without a context cache."""
    cc = snapshot.get("context_cache")
    if not isinstance(cc, dict):
        return []
    sel = cc.get("selections", {})
    pressure = cc.get("pressure", {})
    moved = cc.get("transfer_bytes", {})
    used_pages = _num(snapshot, "pages_total") - _num(snapshot, "pages_free")
    lanes_used = _num(snapshot, "slots_total") - _num(snapshot, "slots_free")
    counters = snapshot.get("counters") if isinstance(snapshot.get("counters"), dict) else {}
    searches = cc.get("searches") if isinstance(cc.get("searches"), dict) else {}
    # A fork of a historical checkpoint: a private resume from anything but the latest endpoint.
    forks = sum(sel.get(s, 0) for s in SOURCES if s.startswith("private_") and s != "private_endpoint")
    transfers = [((obj, way), _num(moved, f"{obj}_{way}")) for obj in ("state", "main_kv", "backend_kv")
                 for way in ("d2h", "h2d")]
    return [
        labelled("counter", "ninfer:context_selections_total",
                 "admissions by the context-cache source they started from", "source",
                 [(s, sel.get(s, 0)) for s in SOURCES]),
        CounterMetricFamily("ninfer:reused_prompt_tokens_total",
                            "prompt tokens restored from the context cache instead of prefilled",
                            value=_num(cc, "reused_prompt_tokens")),
        labelled("counter", "ninfer:context_pressure_events_total", "what pressure planning did to inactive owners",
                 "event", [(e, pressure.get(e, 0)) for e in PRESSURE_EVENTS]),
        labelled("counter", "ninfer:context_transfer_bytes_total", "context-cache bytes moved between Device and Host",
                 ["object", "direction"], transfers),
        CounterMetricFamily("ninfer:context_transfer_seconds_total", "time admissions waited for context-cache "
                            "transfers", value=_num(counters, "context_transfer_seconds")),
        labelled("counter", "ninfer:context_pressure_searches_total", "pressure planning searches", "result",
                 [(r, searches.get(r, 0)) for r in ("started", "budget_exhausted", "maximal_fallback")]),
        CounterMetricFamily("ninfer:context_historical_fork_hits_total",
                            "admissions that forked a historical checkpoint instead of the latest endpoint",
                            value=float(cc.get("historical_fork_hits", forks))),
        labelled("gauge", "ninfer:context_occupancy", "context-cache pools in use", "pool",
                 [("device_state_slots", lanes_used + _num(cc, "device_state_slots_used")),
                  ("host_state_slots", _num(cc, "host_state_slots_used")),
                  ("device_main_kv_pages", used_pages),
                  ("device_backend_kv_pages", 0),
                  ("host_kv_bytes", _num(cc, "host_kv_bytes_used"))]),
    ]


def render(families: list[Metric]) -> str:
    """Families in the Prometheus text format, through prometheus_client's writer."""
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    class _Once:
        def collect(self):
            return iter(families)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Once())
    return generate_latest(registry).decode("utf-8")


def context_cache_metrics(snapshot: dict[str, Any]) -> str:
    """The context-cache series alone as Prometheus text; empty without a context cache."""
    families = context_cache_families(snapshot)
    return render(families) if families else ""
