"""The context-cache series of GET /metrics (spec "Metrics"), rendered from an engine snapshot.

`context_cache_metrics(snapshot)` returns Prometheus text-format lines that GET /metrics
(ninfer_core.server.metrics) appends to the request and token series. Written by hand because prometheus_client is not a dependency of ninfer-core; the series
are a handful of counters and gauges read from an already published snapshot.
"""

from __future__ import annotations

from typing import Any

from ninfer_core.engine.checkpoints import SOURCES

# The spec's five events, and private_owner_demoted (a subset of private_owner_degraded: the
# degradation moved the owner's KV or StateImage to Host, spec JSONL pressure.private_owners_demoted).
PRESSURE_EVENTS = ("private_owner_evicted", "private_owner_degraded", "shared_owner_evicted",
                   "shared_owner_degraded", "checkpoint_dropped", "private_owner_demoted")


def family(name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> list[str]:
    """One metric family: HELP, TYPE and one sample line per label set."""
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
        text = _value(value)
        lines.append(f"{name}{{{lab}}} {text}" if lab else f"{name} {text}")
    return lines


def _value(v: float) -> str:
    """Integers exactly (a token counter passes 2**53 long before :g would round it), floats in full."""
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 2**63):
        return str(int(v))
    return repr(float(v))


def context_cache_metrics(snapshot: dict[str, Any]) -> str:
    """Prometheus text for the context-cache series; empty without a context cache."""
    cc = snapshot.get("context_cache")
    if not isinstance(cc, dict):
        return ""
    sel = cc.get("selections", {})
    pressure = cc.get("pressure", {})
    moved = cc.get("transfer_bytes", {})
    used_pages = int(snapshot.get("pages_total", 0)) - int(snapshot.get("pages_free", 0))
    lanes_used = int(snapshot.get("slots_total", 0)) - int(snapshot.get("slots_free", 0))
    out: list[str] = []
    out += family("ninfer:context_selections_total", "counter",
                   "admissions by the context-cache source they started from",
                   [({"source": s}, sel.get(s, 0)) for s in SOURCES])
    out += family("ninfer:reused_prompt_tokens_total", "counter",
                   "prompt tokens restored from the context cache instead of prefilled",
                   [({}, cc.get("reused_prompt_tokens", 0))])
    out += family("ninfer:context_pressure_events_total", "counter",
                   "what pressure planning did to inactive owners",
                   [({"event": e}, pressure.get(e, 0)) for e in PRESSURE_EVENTS])
    out += family("ninfer:context_transfer_bytes_total", "counter",
                   "context-cache bytes moved between Device and Host",
                   [({"object": "state", "direction": "d2h"}, moved.get("state_d2h", 0)),
                    ({"object": "state", "direction": "h2d"}, moved.get("state_h2d", 0)),
                    ({"object": "main_kv", "direction": "d2h"}, moved.get("main_kv_d2h", 0)),
                    ({"object": "main_kv", "direction": "h2d"}, moved.get("main_kv_h2d", 0)),
                    ({"object": "backend_kv", "direction": "d2h"}, moved.get("backend_kv_d2h", 0)),
                    ({"object": "backend_kv", "direction": "h2d"}, moved.get("backend_kv_h2d", 0))])
    counters = snapshot.get("counters") if isinstance(snapshot.get("counters"), dict) else {}
    out += family("ninfer:context_transfer_seconds_total", "counter",
                  "time admissions waited for context-cache transfers",
                  [({}, counters.get("context_transfer_seconds", 0))])
    searches = cc.get("searches") if isinstance(cc.get("searches"), dict) else {}
    out += family("ninfer:context_pressure_searches_total", "counter", "pressure planning searches",
                  [({"result": r}, searches.get(r, 0)) for r in ("started", "budget_exhausted", "maximal_fallback")])
    # A fork of a historical checkpoint: a private resume from anything but the latest endpoint.
    forks = sum(sel.get(s, 0) for s in SOURCES if s.startswith("private_") and s != "private_endpoint")
    out += family("ninfer:context_historical_fork_hits_total", "counter",
                  "admissions that forked a historical checkpoint instead of the latest endpoint",
                  [({}, cc.get("historical_fork_hits", forks))])
    out += family("ninfer:context_occupancy", "gauge", "context-cache pools in use",
                   [({"pool": "device_state_slots"}, lanes_used + cc.get("device_state_slots_used", 0)),
                    ({"pool": "host_state_slots"}, cc.get("host_state_slots_used", 0)),
                    ({"pool": "device_main_kv_pages"}, used_pages),
                    ({"pool": "device_backend_kv_pages"}, 0),
                    ({"pool": "host_kv_bytes"}, cc.get("host_kv_bytes_used", 0))])
    return "\n".join(out) + "\n"
