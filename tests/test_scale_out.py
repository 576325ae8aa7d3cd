"""docs/scale-out.md: its manifest is valid (the InferencePool against the v1 schema in
tests/data), consistent (the pool selects the NInfer pods on their port, the pods expose the gateway
gauges), and a server started with the manifest's flags serves every series the endpoint picker
reads. No cluster is needed."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ninfer_core.config import options_from_args
from ninfer_core.serve_options import add_serve_arguments

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "scale-out.md"
SCHEMA = json.loads((REPO / "tests" / "data" / "inferencepool_v1.schema.json").read_text())
# What the GIE model-server protocol reads, under vLLM's names (the endpoint picker's defaults)
PICKER_SERIES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:cache_config_info")


def _objects() -> list[dict]:
    text = DOC.read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```yaml\n")[1:]]
    assert blocks, "docs/scale-out.md has no yaml block"
    return [o for b in blocks for o in yaml.safe_load_all(b) if o]


def _one(kind: str, name: str | None = None) -> dict:
    found = [o for o in _objects() if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, found)
    return found[0]


def test_the_inference_pool_is_valid_against_its_schema():
    pool = _one("InferencePool")
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.validate(pool, SCHEMA, cls=jsonschema.Draft202012Validator)


@pytest.mark.parametrize("broken", [
    {"targetPorts": [{"number": 0}]}, {"targetPorts": []}, {"targetPorts": [{"number": 80}, {"number": 80}]},
    {"selector": {"matchLabels": {}}}, {"endpointPickerRef": {"name": "x"}},
    {"endpointPickerRef": {"name": "x", "port": {"number": 9002}, "failureMode": "Sometimes"}},
    {"targetPort": [{"number": 8080}]},
])
def test_the_schema_refuses_what_the_crd_refuses(broken):
    pool = _one("InferencePool")
    spec = dict(pool["spec"], **broken)
    if "targetPort" in broken:
        spec.pop("targetPorts")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(dict(pool, spec=spec), SCHEMA, cls=jsonschema.Draft202012Validator)


def test_the_pool_selects_the_ninfer_pods_on_their_port_and_the_picker_service():
    pool, dep = _one("InferencePool"), _one("Deployment", "ninfer")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    container = dep["spec"]["template"]["spec"]["containers"][0]
    ports = {p["containerPort"] for p in container["ports"]}
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= ports
    args = container["args"]
    assert args[0] == "serve" and args[args.index("--metrics-compat") + 1] == "vllm"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    svc = _one("Service", pool["spec"]["endpointPickerRef"]["name"])
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] in {p["port"] for p in svc["spec"]["ports"]}
    epp = _one("Deployment", "ninfer-epp")
    assert svc["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    eargs = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert eargs[eargs.index("--pool-name") + 1] == pool["metadata"]["name"]
    route = _one("HTTPRoute")
    ref = route["spec"]["rules"][0]["backendRefs"][0]
    assert (ref["group"], ref["kind"], ref["name"]) == ("inference.networking.k8s.io", "InferencePool",
                                                        pool["metadata"]["name"])


def test_a_server_with_the_manifests_flags_serves_what_the_picker_reads(make_app):
    import argparse

    container = _one("Deployment", "ninfer")["spec"]["template"]["spec"]["containers"][0]
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    opts = options_from_args(p.parse_args(container["args"][1:]))  # the args after "serve"
    assert opts.metrics_compat == ["vllm"] and opts.host == "0.0.0.0"
    client, _, _ = make_app(metrics_compat=opts.metrics_compat)
    names = {s.name for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples}
    assert set(PICKER_SERIES) <= names
