"""`--metrics-compat vllm|sglang`: the gauges an inference gateway schedules by, under vLLM's or
SGLang's names (docs/scale-out.md).

The Gateway API Inference Extension's model-server protocol (its endpoint picker, and llm-d's)
reads three gauges and an optional info series from each replica's /metrics:

| protocol metric        | vLLM name                   | SGLang name               | NInfer source            |
|------------------------|-----------------------------|---------------------------|--------------------------|
| TotalQueuedRequests    | vllm:num_requests_waiting   | sglang:num_queue_reqs     | requests in the FIFO     |
| TotalRunningRequests   | vllm:num_requests_running   | sglang:num_running_reqs   | requests holding a lane  |
| KVCacheUtilization     | vllm:kv_cache_usage_perc    | sglang:token_usage        | KV pages running requests hold, of the pool |
| BlockSize, NumGPUBlocks| vllm:cache_config_info{block_size, num_gpu_blocks} | sglang:cache_config_info{page_size, num_pages} | page size, pool pages |

KV usage counts the pages running requests hold, not the retained prefixes the context cache may
evict at any admission: vLLM counts its cached-but-unreferenced blocks as free the same way, so a
replica full of reusable conversations is not read as full. vLLM also exposes the usage under its
older name vllm:gpu_cache_usage_perc, the default of endpoint pickers before v1.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from ninfer_core.server.context import ServerContext


def _num(d: Any, key: str) -> float:
    v = d.get(key, 0) if isinstance(d, dict) else 0
    return float(v) if isinstance(v, (int, float)) else 0.0


def kv_usage(snap: dict[str, Any]) -> float:
    total = _num(snap, "pages_total")
    return min(1.0, _num(snap, "pages_in_lanes") / total) if total > 0 else 0.0


def _gauge(name: str, help_: str, labels: dict[str, str], value: float) -> Metric:
    fam = GaugeMetricFamily(name, help_, labels=list(labels))
    fam.add_metric(list(labels.values()), value)
    return fam


def gateway_families(ctx: ServerContext, snap: dict[str, Any], compat: list[str]) -> list[Metric]:
    model = ctx.model.id if ctx.model is not None else ""
    waiting, running = _num(snap, "pending"), _num(snap, "lanes_active")
    usage = kv_usage(snap)
    page, pages = int(_num(snap, "page_size") or 64), int(_num(snap, "pages_total"))
    out: list[Metric] = []
    if "vllm" in compat:
        m = {"model_name": model}
        out += [
            _gauge("vllm:num_requests_waiting", "requests queued for admission (NInfer: the engine FIFO)", m, waiting),
            _gauge("vllm:num_requests_running", "requests holding an execution lane", m, running),
            _gauge("vllm:kv_cache_usage_perc", "share of the KV pool held by running requests (0..1)", m, usage),
            _gauge("vllm:gpu_cache_usage_perc", "the same share under vLLM's older name",
                   m, usage),
            _gauge("vllm:cache_config_info", "KV cache geometry (value 1; the labels carry it)",
                   {"block_size": str(page), "num_gpu_blocks": str(pages), "num_cpu_blocks": "0",
                    "cache_dtype": ctx.options.engine.kv_dtype,
                    "enable_prefix_caching": str(bool(ctx.options.engine.prefix_reuse))}, 1.0),
        ]
    if "sglang" in compat:
        m = {"model_name": model}
        out += [
            _gauge("sglang:num_queue_reqs", "requests queued for admission (NInfer: the engine FIFO)", m, waiting),
            _gauge("sglang:num_running_reqs", "requests holding an execution lane", m, running),
            _gauge("sglang:token_usage", "share of the KV pool held by running requests (0..1)", m, usage),
            _gauge("sglang:cache_config_info", "KV cache geometry (value 1; the labels carry it)",
                   {"page_size": str(page), "num_pages": str(pages)}, 1.0),
        ]
    return out
