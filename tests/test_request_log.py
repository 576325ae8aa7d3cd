"""--request-log-jsonl: the structured request log of a real server, rotation, startup failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ninfer_core.server.request_log import RequestLog, materialization, redact_argv

REPO = Path(__file__).resolve().parent.parent
SECRET = "sk-test-Zq9verysecretkey"
PROMPT = "Quokka marmalade telescopes whisper at dawn"


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def logged_run(tiny_artifact, tmp_path_factory, launch):
    """One server with the log and an API key: a plain chat, a streamed chat, a rejected prompt,
    a completion; stopped, so the log holds its last throughput interval."""
    import httpx

    d = tmp_path_factory.mktemp("reqlog")
    path = d / "server.requests.jsonl"
    server = launch(tiny_artifact, "--request-log-jsonl", str(path), "--api-key", SECRET, "--max-context", "512",
                    log_dir=d)
    headers = {"Authorization": f"Bearer {SECRET}"}
    statuses = []
    try:
        with httpx.Client(base_url=server.base_url, headers=headers, timeout=120) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
                    "temperature": 0}
            statuses.append(c.post("/v1/chat/completions", json=body).status_code)
            with c.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as r:
                statuses.append(r.status_code)
                for _ in r.iter_lines():
                    pass
            long_body = dict(body, messages=[{"role": "user", "content": PROMPT + " word" * 900}])
            statuses.append(c.post("/v1/chat/completions", json=long_body).status_code)
            # not a measurement request: schema validation fails before preparation
            statuses.append(c.post("/v1/chat/completions", json={"model": model}).status_code)
            statuses.append(c.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 4,
                                                             "temperature": 0}).status_code)
            # a stream the client drops after its first chunk: the engine cancels it (request_error)
            with c.stream("POST", "/completion", json={"prompt": PROMPT, "n_predict": 450, "ignore_eos": True,
                                                       "stream": True, "temperature": 0}) as r:
                statuses.append(r.status_code)
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        break
            deadline = time.monotonic() + 60  # until the engine has noticed and cancelled it
            while '"request_error"' not in path.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        rc = server.stop()
    return {"path": path, "records": _records(path), "statuses": statuses, "rc": rc, "server_log": server.log()}


def test_every_line_is_one_json_record_in_order(logged_run):
    assert logged_run["statuses"] == [200, 200, 400, 400, 200, 200]
    assert logged_run["rc"] == 0
    recs = logged_run["records"]
    assert recs[0]["event"] == "server_start"
    instance = recs[0]["server_instance_id"]
    for r in recs:
        assert r["server_instance_id"] == instance
        assert isinstance(r["timestamp_unix_ms"], int)
    times = [r["timestamp_unix_ms"] for r in recs]
    assert times == sorted(times)
    events = [r["event"] for r in recs if r["event"] != "throughput"]
    assert events == ["server_start", "request_start", "request_done", "request_start", "request_done",
                      "request_rejected", "request_start", "request_done", "request_start", "request_error"]
    ids = [r["request_id"] for r in recs if r["event"].startswith("request_")]
    assert ids == [1, 1, 2, 2, 3, 4, 4, 5, 5]


def test_request_records(logged_run):
    recs = [r for r in logged_run["records"] if r["event"].startswith("request_")]
    start, done = recs[0], recs[1]
    assert start["endpoint"] == "/v1/chat/completions" and start["protocol"] == "openai_chat"
    assert start["requested_output_tokens"] == 6 and start["prompt_tokens"] > 5
    assert start["sampler"]["greedy"] is True
    assert start["timings_seconds"]["prepare"] >= 0
    assert done["finish_reason"] in ("stop", "length")
    assert done["prompt_tokens"] == start["prompt_tokens"]
    assert 1 <= done["completion_tokens"] <= 6
    assert done["prefix_reuse_path"] == "root"
    assert done["cached_tokens"] == 0
    assert done["computed_prefill_tokens"] == done["prompt_tokens"]
    t = done["timings_seconds"]
    assert t["total"] >= t["ttft"] >= t["prepare"] >= 0 and t["queue_wait"] >= 0
    assert t["prefill"] > 0
    mat = done["materialization"]
    assert mat["stop_reason"] == "no_pressure"
    assert mat["best_reuse_prompt_tokens"] == 0 and mat["planning_elapsed_ns"] >= 0
    assert "selected_maximal_fallback" in mat and "budget_exhausted" in mat
    # the same prompt again (streamed): served from the first request's checkpoint
    again = recs[3]
    assert again["prefix_reuse_path"] != "root" and again["cached_tokens"] > 0
    assert again["materialization"]["best_reuse_prompt_tokens"] == again["cached_tokens"]
    rejected = recs[4]
    assert rejected["phase"] == "prepare" and rejected["status"] == 400
    assert rejected["code"] == "context_length_exceeded"
    assert "message" not in rejected  # error texts can quote client values
    comp = recs[6]
    assert comp["endpoint"] == "/v1/completions" and recs[5]["requested_output_tokens"] == 4
    assert recs[5]["explicit_output_limit"] is True
    cancelled = recs[8]
    assert cancelled["endpoint"] == "/completion" and cancelled["phase"] == "cancelled"
    assert cancelled["finish_reason"] == "cancelled" and cancelled["completion_tokens"] < 450


def test_throughput_records(logged_run):
    thr = [r for r in logged_run["records"] if r["event"] == "throughput"]
    assert thr, "the stop writes the last interval"
    done = [r for r in logged_run["records"] if r["event"] in ("request_done", "request_error")]
    # decode commits every output token but the first, which prefill produced
    assert sum(r["tokens"]["decode"] for r in thr) == sum(max(0, d["completion_tokens"] - 1) for d in done)
    assert sum(r["tokens"]["prefill"] for r in thr) == sum(d["computed_prefill_tokens"] for d in done)
    rounds = sum(r["decode_batch"]["rounds"] for r in thr)
    assert rounds == sum(r["decode_batch"]["row_rounds"] for r in thr)  # one lane: one row a round
    for r in thr:
        assert r["engine_recoveries"] == 0
        assert r["decode_batch"]["average_size"] in (None, 1.0)
        cc = r["context_cache"]
        assert "occupancy" in cc and "selections" in cc
    assert sum(r["context_cache"]["selections"].get("private_endpoint", 0) +
               r["context_cache"]["selections"].get("private_turn_closure", 0) for r in thr) >= 1


def test_no_prompt_output_or_key_in_the_log(logged_run):
    text = logged_run["path"].read_text()
    assert SECRET not in text
    assert "Quokka" not in text and "marmalade" not in text
    start = logged_run["records"][0]
    assert "<redacted>" in start["argv"] and start["options"]["api_key"] == "<redacted>"
    assert start["schema"] == "ninfer_serve_request_log"
    assert start["engine"]["context_cache"]["max_private_continuations"] >= 1
    assert start["context_cost"]["source"] == "compiled_defaults"
    assert start["public_name"] and start["architecture"]


def test_rotation_keeps_keep_files_each_starting_with_server_start(tmp_path):
    path = tmp_path / "r.jsonl"
    rlog = RequestLog(str(path), keep=2, max_bytes=600)
    rlog.start({"build": "x"})
    for i in range(40):
        rlog.write("throughput", n=i, pad="p" * 50)
    rlog.close()
    assert path.exists() and (tmp_path / "r.jsonl.1").exists() and (tmp_path / "r.jsonl.2").exists()
    assert not (tmp_path / "r.jsonl.3").exists()
    seen = []
    for p in (tmp_path / "r.jsonl.2", tmp_path / "r.jsonl.1", path):
        recs = _records(p)
        assert recs[0]["event"] == "server_start"
        assert p.stat().st_size < 600 + 200
        seen += [r["n"] for r in recs if r["event"] == "throughput"]
    assert seen == list(range(seen[0], 40))  # the newest records, in order, none lost between files


def test_rotation_keep_zero_keeps_no_copy(tmp_path):
    path = tmp_path / "r.jsonl"
    rlog = RequestLog(str(path), keep=0, max_bytes=300)
    rlog.start({"build": "x"})
    for i in range(20):
        rlog.write("throughput", n=i, pad="p" * 50)
    rlog.close()
    assert sorted(os.listdir(tmp_path)) == ["r.jsonl"]


def test_append_mode_keeps_earlier_campaign_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"event":"earlier"}\n')
    rlog = RequestLog(str(path))
    rlog.start({"build": "x"})
    rlog.close()
    assert [r["event"] for r in _records(path)] == ["earlier", "server_start"]


def test_redact_argv():
    assert redact_argv(["serve", "--api-key", "k1", "--api-key=k2", "--port", "1"]) == [
        "serve", "--api-key", "<redacted>", "--api-key=<redacted>", "--port", "1"]


def test_materialization_names_only_what_the_planner_computed():
    got = materialization({"degradation_tokens": 3, "maximal_fallback": True, "stop_reason": "work_budget",
                           "unknown": 1})
    assert got == {"selected_degradation_units": 3, "selected_maximal_fallback": True,
                   "stop_reason": "work_budget"}
    assert materialization(None) is None


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer_core.cli", "serve", *args, "--port", "0"],
                          check=False, capture_output=True, text=True, timeout=120, cwd=str(REPO),
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_startup_fails_without_the_parent_directory(tiny_artifact, tmp_path):
    r = _serve(tiny_artifact, "--request-log-jsonl", str(tmp_path / "missing" / "log.jsonl"))
    assert r.returncode == 1
    assert "error: --request-log-jsonl" in r.stderr and "does not exist" in r.stderr
    assert "listening on" not in r.stderr


def test_startup_refuses_the_artifact_path(tiny_artifact, tmp_path):
    before = Path(tiny_artifact).read_bytes()
    link = tmp_path / "alias.ninfer"
    link.symlink_to(tiny_artifact)
    r = _serve(tiny_artifact, "--request-log-jsonl", str(link))
    assert r.returncode == 1 and "resolves to the model artifact" in r.stderr
    assert Path(tiny_artifact).read_bytes() == before


def test_max_mib_requires_the_log():
    r = _serve("--request-log-max-mib", "4")
    assert r.returncode == 1 and "requires --request-log-jsonl" in r.stderr


class _FakeEngine:
    def __init__(self):
        self.snap = {"lanes_active": 1, "prefilling": 0, "decode_ready": 1, "pending": 2,
                     "counters": {"computed_prefill_tokens": 10, "committed_decode_tokens": 5, "decode_rounds": 5,
                                  "decode_row_rounds": 5, "engine_recoveries": 0},
                     "context_cache": {"selections": {"root": 1, "private_endpoint": 0}, "checkpoints": 3,
                                       "max_private_continuations": 4}}

    def snapshot(self):
        return json.loads(json.dumps(self.snap))


def test_throughput_interval_deltas_and_idle_omission(tmp_path):
    from ninfer_core.server.request_log import ThroughputReporter

    path = tmp_path / "t.jsonl"
    rlog = RequestLog(str(path))
    eng = _FakeEngine()
    rep = ThroughputReporter(rlog, eng, interval_s=3600)  # reports only when told to
    rep.report()  # nothing moved since it started: an idle interval is omitted
    c = eng.snap["counters"]
    c.update(committed_decode_tokens=11, decode_rounds=8, decode_row_rounds=14, engine_recoveries=1)
    eng.snap["context_cache"]["selections"]["private_endpoint"] = 2
    eng.snap["context_cache"]["checkpoints"] = 5
    rep.report()
    rep.report()  # idle again
    eng.snap["context_cache"]["selections"]["root"] = 2  # cache activity alone is not idle
    rep.report()
    rlog.close()
    recs = _records(path)
    assert [r["event"] for r in recs] == ["throughput", "throughput"]
    r = recs[0]
    assert r["tokens"]["decode"] == 6 and r["tokens"]["prefill"] == 0
    assert r["decode_batch"] == {"rounds": 3, "row_rounds": 9, "average_size": 3.0}
    assert r["engine_recoveries"] == 1
    assert r["scheduler"] == {"running": 1, "prefilling": 0, "decode_ready": 1, "waiting": 2}
    cc = r["context_cache"]
    assert cc["selections"] == {"root": 0, "private_endpoint": 2}
    assert cc["occupancy"]["checkpoints"] == 5 and "max_private_continuations" not in cc
    assert recs[1]["decode_batch"]["average_size"] is None
    assert recs[1]["context_cache"]["selections"]["root"] == 1
