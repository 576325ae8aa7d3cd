"""`ninfer serve|convert|bench` options (issue 19): help text and default on every option, the
request's ranges checked at startup (exit 1 with `error: ...`, no traceback), NINFER_<OPTION>
environment variables, and the plugin-added options still listed."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from ninfer_core.cli import _serve_host, _serve_parser, build_parser
from ninfer_core.cli_support import env_arguments, env_name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _subparsers(parser):
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_serve_convert_bench_option_has_help_and_shows_its_default():
    host, err = _serve_host([])
    assert err is None
    subs = _subparsers(build_parser(host))
    for name in ("serve", "convert", "bench", "inspect", "plugins"):
        parser = subs[name]
        fmt = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest} has no help text"
            if action.option_strings:
                shown = fmt._get_help_string(action)
                assert "default" in shown, f"{name} {action.option_strings[0]}: no default shown: {shown!r}"
                d = action.default
                if d not in (None, False, [], argparse.SUPPRESS) and not isinstance(action, argparse._StoreFalseAction):
                    want = ",".join(map(str, d)) if isinstance(d, list) else str(d)
                    assert want in shown or f"default {want}" in shown, (action.option_strings, shown)


def test_serve_help_lists_plugin_options_and_environment_variables():
    host, err = _serve_host([])
    assert err is None
    text = " ".join(_serve_parser(build_parser(host)).format_help().split())  # help lines wrap
    assert "[env NINFER_API_KEY]" in text and "[env NINFER_MAX_CONTEXT]" in text
    assert "(default: 8192)" in text  # --max-context
    if any(o.plugin == "spec_mtp" for o in host.serve_options()):
        assert "--draft-tokens" in text and "[env NINFER_DRAFT_TOKENS]" in text
    r = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "serve", "--help"], capture_output=True, text=True, check=False,
                       cwd=REPO, timeout=120)
    assert r.returncode == 0 and "--metrics-compat" in r.stdout and "--recover-invariant-failures" in r.stdout


def test_environment_variables_stand_before_the_command_line():
    parser = _serve_parser(build_parser(None))
    env = {"NINFER_API_KEY": "k1", "NINFER_PORT": "9000", "NINFER_CORS": "1", "NINFER_GREEDY": "off",
           "NINFER_MAX_CONTEXT": "4096", "NINFER_METRICS_COMPAT": "vllm"}
    argv = env_arguments(parser, env)
    assert argv[:0] == [] and "--api-key" in argv and "--cors" in argv and "--greedy" not in argv
    a = parser.parse_args(argv + ["--port", "9100"])  # the command line wins
    assert (a.api_key, a.port, a.cors, a.max_context, a.metrics_compat) == ("k1", 9100, True, 4096, ["vllm"])
    assert env_name(next(x for x in parser._actions if "--plugin" in x.option_strings)) is None


BAD = [
    (["--port", "99999"], "--port"), (["--port", "-5"], "--port"), (["--temperature", "-3"], "--temperature"),
    (["--temperature", "nan"], "--temperature"), (["--top-p", "5"], "--top-p"), (["--min-p", "-1"], "--min-p"),
    (["--presence-penalty", "99"], "--presence-penalty"), (["--frequency-penalty", "inf"], "--frequency-penalty"),
    (["--top-k", "21"], "--top-k"), (["--post-thinking-sampler", "temp=3"], "--post-thinking-sampler"),
    (["--log-colours", "maybe"], "--log-colours"), (["--metrics-compat", "tgi"], "--metrics-compat"),
    (["--seed", str(2**64)], "--seed"), (["--suspend-snapshot", "locked"], "--suspend-snapshot"),
    (["--suspend-weights", "disk"], "--suspend-weights"),
]


@pytest.mark.parametrize("argv,flag", BAD)
def test_an_out_of_range_option_fails_startup_with_status_1(argv, flag):
    r = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "serve", *argv], capture_output=True, text=True, check=False,
                       cwd=REPO, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("error: argument " + flag), r.stderr
    assert "Traceback" not in r.stderr


def test_a_bad_environment_value_fails_startup_naming_the_variable():
    env = dict(os.environ, NINFER_PORT="99999")
    r = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "serve"], capture_output=True, text=True, check=False, cwd=REPO,
                       timeout=120, env=env)
    assert r.returncode == 1 and r.stderr.startswith("error: NINFER_PORT: must be in 0..65535"), r.stderr
