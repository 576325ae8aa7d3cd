"""GET /metrics, GET /v1/load and llama.cpp's cache_prompt on a real server (tiny Qwen3.5, httpx).

The scrape is parsed as Prometheus text and checked against the spec's "Metrics" table, then the
counters are followed across requests: a second chat turn moves context_selections_total to
private_turn_closure, token counters agree with the responses' timings and with /v1/load.
"""

from __future__ import annotations

import re

import httpx
import pytest

pytestmark = pytest.mark.timeout(600)

KEY = "metrics-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}

# Every series of the spec's Metrics table, with its type.
SPEC_SERIES = {
    "llamacpp:prompt_tokens_total": "counter", "llamacpp:prompt_seconds_total": "counter",
    "llamacpp:tokens_predicted_total": "counter", "llamacpp:tokens_predicted_seconds_total": "counter",
    "llamacpp:prompt_tokens_seconds": "gauge", "llamacpp:predicted_tokens_seconds": "gauge",
    "llamacpp:n_decode_total": "counter", "llamacpp:n_busy_slots_per_decode": "gauge",
    "llamacpp:kv_cache_usage_ratio": "gauge", "llamacpp:kv_cache_tokens": "gauge",
    "llamacpp:requests_processing": "gauge", "llamacpp:requests_deferred": "gauge",
    "ninfer:requests_total": "counter", "ninfer:requests_failed_total": "counter",
    "ninfer:requests_rejected_total": "counter", "ninfer:requests_admitted": "gauge",
    "ninfer:prefix_cache_hit_tokens_total": "counter", "ninfer:reused_prompt_tokens_total": "counter",
    "ninfer:draft_tokens_total": "counter", "ninfer:draft_accepted_tokens_total": "counter",
    "ninfer:context_cache_exhausted_requests_total": "counter", "ninfer:engine_recoveries_total": "counter",
    "ninfer:uptime_seconds": "gauge", "ninfer:waiting_cancelled_requests_total": "counter",
    "ninfer:waiting_expired_requests_total": "counter", "ninfer:waiting_abandoned_seconds_total": "counter",
    "ninfer:cancelled_prefills_total": "counter", "ninfer:cancelled_prefill_computed_tokens_total": "counter",
    "ninfer:cancelled_prefills_salvaged_total": "counter", "ninfer:context_selections_total": "counter",
    "ninfer:context_pressure_events_total": "counter", "ninfer:context_pressure_searches_total": "counter",
    "ninfer:context_transfer_bytes_total": "counter", "ninfer:context_transfer_seconds_total": "counter",
    "ninfer:context_historical_fork_hits_total": "counter", "ninfer:context_occupancy": "gauge",
}
LABELS = {
    "ninfer:context_selections_total": ("source", {"root", "private_endpoint", "private_turn_closure",
                                                   "private_response_replay", "private_long_anchor",
                                                   "shared_stable_prefix"}),
    "ninfer:context_pressure_events_total": ("event", {"private_owner_evicted", "private_owner_degraded",
                                                       "shared_owner_evicted", "shared_owner_degraded",
                                                       "checkpoint_dropped"}),
    "ninfer:context_pressure_searches_total": ("result", {"started", "budget_exhausted", "maximal_fallback"}),
    "ninfer:context_occupancy": ("pool", {"device_state_slots", "host_state_slots", "device_main_kv_pages",
                                          "device_backend_kv_pages", "host_kv_bytes"}),
}
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$')


def parse(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """Prometheus text -> ({'name{labels}': value}, {name: type}), read by prometheus_client's parser as a
    scraper reads it (labels in name order); any malformed line fails. Every sample line must also
    be a plain `name{labels} value` line."""
    from prometheus_client.parser import text_string_to_metric_families

    for line in text.splitlines():
        assert line.startswith("#") or not line or _SAMPLE.match(line), f"not a Prometheus sample line: {line!r}"
    samples, types = {}, {}
    for fam in text_string_to_metric_families(text):
        types[fam.name + ("_total" if fam.type == "counter" else "")] = fam.type
        for smp in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(smp.labels.items()))
            samples[smp.name + (f"{{{labels}}}" if labels else "")] = smp.value
    return samples, types


def scrape(base: str) -> dict[str, float]:
    r = httpx.get(base + "/metrics", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse(r.text)[0]


def chat(base: str, messages: list[dict], **extra) -> dict:
    body = {"model": "", "messages": messages, "max_tokens": 8, "temperature": 0, **extra}
    r = httpx.post(base + "/v1/chat/completions", json=body, headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def completion(base: str, prompt, **extra) -> dict:
    r = httpx.post(base + "/completion", json={"prompt": prompt, "n_predict": 4, "temperature": 0, **extra},
                   headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def server(tiny_artifact, tmp_path_factory, launch):
    s = launch(tiny_artifact, "--api-key", KEY, "--max-context", "4096",
                      "--max-private-continuations", "4", log_dir=tmp_path_factory.mktemp("metrics-logs"))
    yield s
    s.stop()


def test_scrape_has_every_spec_series_and_needs_the_key(server):
    base = server.base_url
    assert httpx.get(base + "/metrics", timeout=30).status_code == 401
    assert httpx.get(base + "/metrics", headers={"x-api-key": "wrong"}, timeout=30).status_code == 401
    r = httpx.get(base + "/metrics", headers={"x-api-key": KEY}, timeout=30)
    samples, types = parse(r.text)
    for name, kind in SPEC_SERIES.items():
        assert types.get(name) == kind, name
        if name == "ninfer:context_transfer_bytes_total":
            for obj in ("state", "main_kv", "backend_kv"):
                for d in ("d2h", "h2d"):
                    assert f'{name}{{direction="{d}",object="{obj}"}}' in samples, (obj, d)
        elif name in LABELS:
            label, values = LABELS[name]
            for v in values:
                assert f'{name}{{{label}="{v}"}}' in samples, (name, v)
        else:
            assert name in samples, name
    assert all(v >= 0 for v in samples.values())
    assert samples["ninfer:uptime_seconds"] > 0
    props = httpx.get(base + "/props", headers=AUTH, timeout=30).json()
    assert props["endpoint_metrics"] is True and props["endpoint_slots"] is True


def test_counters_follow_requests(server):
    base = server.base_url
    before = scrape(base)
    turn1 = [{"role": "system", "content": "Answer in one short sentence."},
             {"role": "user", "content": "What does a context cache keep between turns?"}]
    one = chat(base, turn1)
    turn2 = turn1 + [{"role": "assistant", "content": one["choices"][0]["message"]["content"] or ""},
                     {"role": "user", "content": "And what does it cost?"}]
    two = chat(base, turn2)
    after = scrape(base)

    def moved(key):
        return after[key] - before.get(key, 0)

    sel = 'ninfer:context_selections_total{source="%s"}'
    assert two["timings"]["cache_n"] > 0
    assert moved(sel % "root") == 1 and moved(sel % "private_turn_closure") == 1
    assert sum(moved(k) for k in after if k.startswith("ninfer:context_selections_total")) == 2
    assert moved("ninfer:requests_total") == 2 and moved("ninfer:requests_failed_total") == 0
    computed = one["timings"]["prompt_n"] + two["timings"]["prompt_n"]
    assert moved("llamacpp:prompt_tokens_total") == computed
    assert moved("ninfer:reused_prompt_tokens_total") == two["timings"]["cache_n"]
    assert moved("ninfer:prefix_cache_hit_tokens_total") == two["usage"]["prompt_tokens_details"]["cached_tokens"]
    predicted = one["usage"]["completion_tokens"] + two["usage"]["completion_tokens"]
    assert moved("llamacpp:tokens_predicted_total") == predicted - 2  # each first token comes from prefill
    assert moved("llamacpp:n_decode_total") == predicted - 2
    assert moved("llamacpp:prompt_seconds_total") > 0 and moved("llamacpp:tokens_predicted_seconds_total") > 0
    assert after["llamacpp:n_busy_slots_per_decode"] == 1.0  # one lane
    assert after["ninfer:requests_admitted"] == 0 and after["llamacpp:requests_processing"] == 0
    assert 0 < after["llamacpp:kv_cache_usage_ratio"] <= 1  # the retained checkpoints hold pages

    # /v1/load reads the same counters.
    load = httpx.get(base + "/v1/load", headers=AUTH, timeout=30).json()
    assert load["counters"]["computed_prefill_tokens"] == after["llamacpp:prompt_tokens_total"]
    assert load["counters"]["reused_prompt_tokens"] == after["ninfer:reused_prompt_tokens_total"]
    assert load["counters"]["committed_decode_tokens"] == after["llamacpp:tokens_predicted_total"]
    assert load["counters"]["decode_rounds"] == after["llamacpp:n_decode_total"]
    assert set(load["requests"]) == {"admitted", "running", "prefilling", "decode_ready", "waiting",
                                     "materializing"}
    assert set(load["occupancy"]) == {"device_main_kv_pages", "device_main_kv_tokens", "device_state_slots",
                                      "host_state_slots", "host_kv_bytes"}
    assert load["occupancy"]["device_main_kv_pages"] * 64 == after["llamacpp:kv_cache_tokens"]
    assert load["occupancy"]["device_state_slots"] == after['ninfer:context_occupancy{pool="device_state_slots"}']


def test_rejections_count_and_server_keeps_serving(server):
    base = server.base_url
    before = scrape(base)["ninfer:requests_rejected_total"]
    long = {"role": "user", "content": "word " * 5000}
    r = httpx.post(base + "/v1/chat/completions", json={"model": "", "messages": [long], "max_tokens": 4},
                   headers=AUTH, timeout=300)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # A schema error is not a preparation rejection.
    r = httpx.post(base + "/v1/chat/completions", json={"model": "", "messages": "nope"}, headers=AUTH, timeout=60)
    assert r.status_code == 400
    assert scrape(base)["ninfer:requests_rejected_total"] == before + 1
    chat(base, [{"role": "user", "content": "Still there?"}])


def test_cache_prompt_false_neither_reuses_nor_publishes(server):
    base = server.base_url
    # A raw prompt of at least 512 tokens keeps a checkpoint one token short of its end.
    prompt = " ".join(f"item{i}" for i in range(400))
    first = completion(base, prompt)
    n = first["tokens_evaluated"]
    assert n >= 512 and first["tokens_cached"] == 0
    again = completion(base, prompt)
    assert again["tokens_cached"] == n - 1 and again["timings"]["cache_n"] == n - 1
    assert again["content"] == first["content"]
    assert again["id_slot"] >= 0  # the retained session's /slots cell

    before = scrape(base)
    off = completion(base, prompt, cache_prompt=False)
    assert off["tokens_cached"] == 0 and off["timings"]["cache_n"] == 0 and off["timings"]["prompt_n"] == n
    assert off["content"] == first["content"] and off["id_slot"] == -1
    assert off["generation_settings"]["cache_prompt"] is False
    after = scrape(base)
    assert after['ninfer:context_selections_total{source="root"}'] == \
        before['ninfer:context_selections_total{source="root"}'] + 1

    # Nothing was captured from it: the same new prompt sent normally afterwards starts from root.
    fresh = " ".join(f"other{i}" for i in range(400))
    assert completion(base, fresh, cache_prompt=False)["tokens_cached"] == 0
    assert completion(base, fresh)["tokens_cached"] == 0
    assert completion(base, fresh)["tokens_cached"] > 0


def test_stats_port_serves_health_load_and_metrics_under_the_same_rules(start_server):
    s = start_server("--api-key", KEY, "--stats-port", "0")
    m = re.search(r"stats listening on http://127\.0\.0\.1:(\d+)", s.log())
    assert m, s.log()
    stats = f"http://127.0.0.1:{m.group(1)}"
    assert httpx.get(stats + "/health", timeout=30).json()["status"] == "ok"
    assert httpx.get(stats + "/metrics", timeout=30).status_code == 401
    assert httpx.get(stats + "/v1/load", timeout=30).status_code == 401
    chat(s.base_url, [{"role": "user", "content": "Hi"}])
    samples = scrape(stats)
    assert samples['ninfer:context_selections_total{source="root"}'] >= 1
    load = httpx.get(stats + "/v1/load", headers=AUTH, timeout=30).json()
    assert load["object"] == "ninfer.load" and load["counters"]["computed_prefill_tokens"] > 0
    assert httpx.get(stats + "/stats", headers=AUTH, timeout=30).json()["object"] == "ninfer.stats"
    # Only those routes: generation stays on the main port.
    r = httpx.post(stats + "/v1/chat/completions", headers=AUTH, timeout=30,
                   json={"model": "", "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert s.stop() == 0


def test_stats_reports_the_queue_and_the_ingress_peak(server):
    import threading
    import time

    base = server.base_url
    body = {"model": "", "messages": [{"role": "user", "content": "Count."}], "max_tokens": 600,
            "ignore_eos": True, "temperature": 0}
    results = []

    def send():
        results.append(httpx.post(base + "/v1/chat/completions", json=body, headers=AUTH, timeout=300).status_code)

    first = threading.Thread(target=send)
    first.start()
    deadline = time.monotonic() + 60
    while httpx.get(base + "/v1/load", headers=AUTH, timeout=30).json()["requests"]["running"] == 0:
        assert time.monotonic() < deadline and first.is_alive()
    second = threading.Thread(target=send)
    second.start()
    seen = None
    while seen is None and first.is_alive():
        stats = httpx.get(base + "/stats", headers=AUTH, timeout=30).json()
        if stats["queue"]["depth"] == 1 and stats["queue"]["entries"]:
            seen = stats
    first.join()
    second.join()
    assert results == [200, 200]
    assert seen is not None, "the second request was never seen waiting"
    entry = seen["queue"]["entries"][0]
    assert entry["position"] == 0 and entry["wait_seconds"] >= 0 and isinstance(entry["request_id"], str)
    assert seen["object"] == "ninfer.stats" and seen["requests"]["peak_admitted"] >= 2
    after = httpx.get(base + "/stats", headers=AUTH, timeout=30).json()
    assert after["queue"] == {"depth": 0, "entries": []}
    assert after["tokens"]["prefill"] == after["counters"]["computed_prefill_tokens"]
    assert after["decode_batch"]["rounds"] == after["counters"]["decode_rounds"]
    assert after["context_cache"]["selections"]["root"] >= 1
