"""The context-cache series of GET /metrics (spec "Metrics"), rendered from an engine snapshot.

`context_cache_metrics(snapshot)` returns Prometheus text-format lines for the metrics route to
append. Written by hand because prometheus_client is not a dependency of ninfer-core; the series
are a handful of counters and gauges read from an already published snapshot.
"""

from __future__ import annotations

from typing import Any

from ninfer_core.engine.checkpoints import SOURCES

PRESSURE_EVENTS = ("private_owner_evicted", "private_owner_degraded", "shared_owner_evicted",
                   "shared_owner_degraded", "checkpoint_dropped")


def _family(name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> list[str]:
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"{name}{{{lab}}} {value:g}" if lab else f"{name} {value:g}")
    return lines


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
    out += _family("ninfer:context_selections_total", "counter",
                   "admissions by the context-cache source they started from",
                   [({"source": s}, sel.get(s, 0)) for s in SOURCES])
    out += _family("ninfer:reused_prompt_tokens_total", "counter",
                   "prompt tokens restored from the context cache instead of prefilled",
                   [({}, cc.get("reused_prompt_tokens", 0))])
    out += _family("ninfer:context_pressure_events_total", "counter",
                   "what pressure planning did to inactive owners",
                   [({"event": e}, pressure.get(e, 0)) for e in PRESSURE_EVENTS])
    out += _family("ninfer:context_transfer_bytes_total", "counter",
                   "context-cache bytes moved between Device and Host",
                   [({"object": "state", "direction": "d2h"}, moved.get("state_d2h", 0)),
                    ({"object": "state", "direction": "h2d"}, moved.get("state_h2d", 0)),
                    ({"object": "main_kv", "direction": "d2h"}, 0),
                    ({"object": "main_kv", "direction": "h2d"}, 0)])
    out += _family("ninfer:context_occupancy", "gauge", "context-cache pools in use",
                   [({"pool": "device_state_slots"}, lanes_used + cc.get("device_state_slots_used", 0)),
                    ({"pool": "host_state_slots"}, cc.get("host_state_slots_used", 0)),
                    ({"pool": "device_main_kv_pages"}, used_pages),
                    ({"pool": "device_backend_kv_pages"}, 0),
                    ({"pool": "host_kv_bytes"}, cc.get("host_kv_bytes_used", 0))])
    return "\n".join(out) + "\n"
