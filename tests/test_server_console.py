"""The console of `ninfer serve` (issue 19): the Ctrl+C policy, the log line format, colours, the
throughput line and the rich statistics panel, and the gateway gauges of --metrics-compat."""

from __future__ import annotations

import io
import logging
import signal
import time

from prometheus_client.parser import text_string_to_metric_families

from ninfer_core.server.console import Console, ConsoleFormatter, StatsReporter, colours_wanted
from ninfer_core.server.lifecycle import PROMPT, StopControl


class _Recorder:
    def __init__(self):
        self.prompts = []
        self.panel = None

    def prompt(self, text):
        self.prompts.append(text)


def _control(ready=True, window=0.3):
    exits = []
    c = StopControl(lambda: ready, _Recorder(), window_s=window, force_exit=exits.append)
    stopped = []
    c.on_stop(lambda: stopped.append(True))
    return c, stopped, exits


def test_the_first_ctrl_c_prompts_the_second_within_the_window_stops():
    c, stopped, _ = _control()
    c.handle(signal.SIGINT)
    assert c.console.prompts == [PROMPT] and not stopped
    c.handle(signal.SIGINT)
    assert stopped == [True] and c.stopping.is_set()


def test_a_prompt_that_expires_leaves_the_server_running():
    c, stopped, _ = _control(window=0.2)
    c.handle(signal.SIGINT)
    time.sleep(0.35)
    c.handle(signal.SIGINT)  # a first press again
    assert not stopped and c.console.prompts == [PROMPT, PROMPT]


def test_sigterm_and_a_press_during_startup_stop_at_once_and_a_press_while_stopping_exits_130():
    c, stopped, exits = _control()
    c.handle(signal.SIGTERM)
    assert stopped == [True]
    c.handle(signal.SIGINT)
    assert exits == [130]
    c2, stopped2, _ = _control(ready=False)
    c2.handle(signal.SIGINT)
    assert stopped2 == [True] and c2.console.prompts == []
    late = []
    c2.on_stop(lambda: late.append(1))  # registered after the stop: run at once
    assert late == [1]


def test_console_lines_have_the_spec_timestamp_and_plain_levels_when_redirected():
    rec = logging.LogRecord("ninfer", logging.WARNING, __file__, 1, "engine | hello %d", (3,), None)
    line = ConsoleFormatter(False).format(rec)
    assert line.endswith("] [warning] engine | hello 3") and line[0] == "[" and line[24:26] == "] "
    assert "\x1b[33mwarning\x1b[0m" in ConsoleFormatter(True).format(rec)
    assert not colours_wanted(None, io.StringIO()) and not colours_wanted(True, io.StringIO())


class _Tty(io.StringIO):
    def isatty(self):
        return True


class _Engine:
    def __init__(self):
        self.n = 0

    def snapshot(self):
        self.n += 100
        return {"lanes_active": 1, "pending": 2, "counters": {
            "computed_prefill_tokens": self.n, "committed_decode_tokens": self.n // 2, "decode_rounds": self.n // 10,
            "decode_row_rounds": self.n // 5, "requests_completed": 3}, "context_cache": {"reused_prompt_tokens": 7}}


def test_the_stats_line_and_the_panel():
    stream = _Tty()
    console = Console("info", colours=False, panel=True, stream=stream)
    try:
        assert console.panel is not None
        rep = StatsReporter(_Engine(), 10.0, console)
        line = rep.report()
        assert line.startswith("stats | prefill 100 tok") and "running 1, waiting 2" in line
        logging.getLogger("ninfer").info("a record above the panel")
        console.prompt(PROMPT)
        console.panel.live.refresh()
        text = stream.getvalue()
        assert "a record above the panel" in text and "prefill 200 tok" in text and PROMPT in text
    finally:
        console.close()
        logging.getLogger("ninfer").handlers.clear()


def test_gateway_gauges_of_metrics_compat(make_app):
    client, _, engine = make_app(metrics_compat=["vllm", "sglang"])
    snap = engine.snapshot()
    engine.snapshot = lambda: {**snap, "lanes_active": 1, "pending": 3, "pages_in_lanes": 32, "pages_total": 128}
    r = client.get("/metrics")
    assert r.status_code == 200 and int(r.headers["process-start-time-unix"]) > 0
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    one = {name: fams[name].samples[0] for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                                                    "vllm:kv_cache_usage_perc", "sglang:num_queue_reqs",
                                                    "sglang:token_usage", "vllm:cache_config_info",
                                                    "sglang:cache_config_info")}
    assert one["vllm:num_requests_waiting"].value == 3 and one["vllm:num_requests_running"].value == 1
    assert one["vllm:kv_cache_usage_perc"].value == 0.25 == one["sglang:token_usage"].value
    assert one["vllm:num_requests_waiting"].labels == {"model_name": "test-model"}
    assert one["vllm:cache_config_info"].labels["block_size"] == "64"
    assert one["vllm:cache_config_info"].labels["num_gpu_blocks"] == "128"
    assert one["sglang:cache_config_info"].labels == {"page_size": "64", "num_pages": "128"}
    plain, _, _ = make_app()
    assert "vllm:" not in plain.get("/metrics").text
