"""Responses: --drop-hosted-tools (Codex offers web_search by default) and the context-length
error naming the Responses field `input`.

Over TestClient and the FakeEngine; tests/e2e/test_e2e_client_fixtures.py replays Codex itself.
"""

from __future__ import annotations

import json
import logging

import pytest

from ninfer_core.engine.api import EngineError

from test_responses import BUILTINS, FN, post, prompt_text

# What Codex 0.171.0 puts beside its functions, and the other hosted tools the option removes.
HOSTED = [{"type": "web_search", "external_web_access": False}, {"type": "file_search", "vector_store_ids": ["v"]},
          {"type": "code_interpreter", "container": {"type": "auto"}}, {"type": "image_generation"},
          {"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"},
          {"type": "mcp", "server_label": "x", "server_url": "http://x"}, {"type": "local_shell"},
          {"type": "web_search_preview"}]


@pytest.fixture
def app(make_app):
    def make(**options):
        return make_app(builtins=BUILTINS, **options)

    return make


def test_hosted_tools_stay_refused_by_default(app):
    client, ctx, engine = app()
    r = post(client, tools=[FN, HOSTED[0]])
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "tool_type_not_supported" and err["param"] == "tools[1].type"
    assert not engine.requests
    assert post(client).status_code == 200


def test_drop_hosted_tools_removes_them_says_so_and_keeps_the_functions(app, caplog):
    client, ctx, engine = app(drop_hosted_tools=True)
    with caplog.at_level(logging.INFO, logger="ninfer.server"):
        r = post(client, tools=[FN, *HOSTED])
    assert r.status_code == 200, r.text
    dropped = [t["type"] for t in HOSTED]
    assert r.headers["x-ninfer-dropped-tools"] == ", ".join(dropped)
    assert [t["name"] for t in r.json()["tools"]] == ["get_weather"]
    text = prompt_text(ctx, engine.requests[-1])
    assert "get_weather" in text and "web_search" not in text
    assert any("dropped hosted tools web_search" in rec.getMessage() for rec in caplog.records)
    # streaming carries the header too; a request without hosted tools has none
    s = post(client, tools=[FN, HOSTED[0]], stream=True)
    assert s.status_code == 200 and s.headers["x-ninfer-dropped-tools"] == "web_search"
    assert "x-ninfer-dropped-tools" not in post(client, tools=[FN]).headers
    # a tool the option does not cover (a custom free-form tool) is still refused
    bad = post(client, tools=[FN, HOSTED[0], {"type": "custom", "name": "x"}])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[1].type"


def test_input_tokens_accepts_the_same_tools(app):
    client, ctx, engine = app(drop_hosted_tools=True)
    r = client.post("/v1/responses/input_tokens", json={"model": "test-model", "input": "Hi", "tools": [FN, *HOSTED]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("param, want", [("messages", "input"), ("max_tokens", "max_output_tokens")])
def test_context_length_errors_name_the_responses_fields(app, param, want):
    client, ctx, engine = app()
    engine.submit_error = EngineError(400, "context_length_exceeded", "the prompt has 9000 tokens, which leaves no "
                                      "room for output in the context ceiling of 8192 tokens: start the server "
                                      "with a larger --max-context", param)
    r = post(client)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == want and "--max-context" in err["message"]
    assert ctx.ingress.admitted == 0
    engine.submit_error = None
    assert post(client).status_code == 200


def test_serve_flag():
    from ninfer_core.cli import build_parser
    from ninfer_core.config import options_from_args

    opts = options_from_args(build_parser().parse_args(["serve", "--drop-hosted-tools"]))
    assert opts.drop_hosted_tools is True
    assert options_from_args(build_parser().parse_args(["serve"])).drop_hosted_tools is False
    assert json.dumps(opts.drop_hosted_tools) == "true"
