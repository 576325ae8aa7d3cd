"""Responses over a real Engine whose toy model (ninfer_core.testing) is forced to write exact text.

The FakeEngine tests pin the adapter's shapes; these check the same paths against the engine's own
events: token counts, the output limit, reasoning tokens, chains, and that the engine returns to idle.
"""

from __future__ import annotations

import json
import re

import pytest

BUILTINS = [("ops", "ninfer_core.protocols.ops"), ("responses", "ninfer_core.protocols.responses")]
MODEL = "test-model"
NS = {"type": "namespace", "name": "mcp__weather", "description": "Weather service",
      "tools": [{"type": "function", "name": "get_current", "parameters": {"type": "object", "properties": {
          "city": {"type": "string"}, "days": {"type": "integer"}}}}]}
CALL = ("<tool_call>\n<function=mcp__weather.get_current>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture
def toy(make_app):
    """(client, ctx, force): the app over a real Engine; force(body, text) scripts the model's answer."""
    from ninfer_core.engine.engine import Engine
    from ninfer_core.protocols.responses import prepare_prompt, render
    from ninfer_core.protocols.responses_request import parse_request
    from ninfer_core.testing import ScriptPolicy, ToyRunner

    engines = []

    def make(**engine_options):
        client, ctx, _ = make_app(builtins=BUILTINS, engine_options=engine_options)
        tok = ctx.tokenizer
        im_end = tok.token_to_id("<|im_end|>")
        runner = ToyRunner(vocab_size=tok.vocab_size, eos_token_ids=(im_end,))
        ctx.engine = Engine(runner, tok, ctx.options.engine)
        ctx.engine.start()
        engines.append(ctx.engine)
        scripts: dict = {}

        def force(body: dict, text: str) -> list[int]:
            plan = parse_request({"model": MODEL, **body}, ctx)
            prompt = render(prepare_prompt(plan, ctx, ctx.response_store), plan, ctx).ids
            pieces = [p for p in re.split(r"(</?think>|</?tool_call>)", text) if p]
            scripts[tuple(prompt)] = [t for p in pieces for t in tok.encode(p, allow_special=p.startswith("<"))]
            runner.policy = ScriptPolicy(scripts, after=im_end)
            return prompt

        return client, ctx, force

    yield make
    for eng in engines:
        eng.shutdown(timeout=30)


def assert_idle(ctx):
    snap = ctx.engine.snapshot()
    assert snap["lanes_active"] == 0 and snap["pending"] == 0 and snap["outstanding"] == 0, snap
    assert ctx.ingress.admitted == 0


def sse(text: str) -> list[dict]:
    out = []
    for block in text.split("\n\n"):
        if block and not block.startswith(":"):
            out.append(json.loads(block.split("\n", 1)[1][len("data: "):]))
    return out


def test_stream_with_reasoning_text_and_namespaced_call(toy):
    client, ctx, force = toy()
    body = {"input": "Weather in Paris?", "tools": [NS], "max_output_tokens": 200}
    force(body, "Check weather.</think>\n\nLooking.\n\n" + CALL)
    events = sse(client.post("/v1/responses", json={"model": MODEL, **body, "stream": True}).text)
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Check weather."
    assert final["output"][1]["content"][0]["text"] == "Looking."
    fc = final["output"][2]
    assert (fc["namespace"], fc["name"]) == ("mcp__weather", "get_current")
    assert json.loads(fc["arguments"]) == {"city": "Paris", "days": 3}
    tok = ctx.tokenizer
    u = final["usage"]
    assert u["output_tokens_details"]["reasoning_tokens"] == len(tok.encode("Check weather.")) + 1  # + </think>
    assert u["output_tokens"] > u["output_tokens_details"]["reasoning_tokens"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert_idle(ctx)


def test_output_limit_is_incomplete(toy):
    client, ctx, force = toy()
    body = {"input": "Hi", "reasoning": {"effort": "none"}, "max_output_tokens": 3}
    force(body, "abcdefgh")
    resp = client.post("/v1/responses", json={"model": MODEL, **body}).json()
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["output"][0]["content"][0]["text"] == "abc" and resp["usage"]["output_tokens"] == 3
    assert resp["output"][0]["status"] == "incomplete"
    body["max_output_tokens"] = 50
    force(body, "done")
    resp = client.post("/v1/responses", json={"model": MODEL, **body}).json()
    assert resp["status"] == "completed" and resp["output"][0]["content"][0]["text"] == "done"
    assert resp["usage"]["output_tokens"] == len(ctx.tokenizer.encode("done")) + 1  # + the stop token
    assert_idle(ctx)


def test_chain_input_tokens_and_count_agree(toy):
    client, ctx, force = toy()
    body = {"input": "first", "reasoning": {"effort": "none"}}
    force(body, "one")
    first = client.post("/v1/responses", json={"model": MODEL, **body}).json()
    child = {"input": "second", "previous_response_id": first["id"], "reasoning": {"effort": "none"}}
    prompt = force(child, "two")
    second = client.post("/v1/responses", json={"model": MODEL, **child}).json()
    assert second["output"][0]["content"][0]["text"] == "two"  # the forced prompt matched exactly
    assert second["usage"]["input_tokens"] == len(prompt)
    n = client.post("/v1/responses/input_tokens", json={"model": MODEL, **child}).json()["input_tokens"]
    assert n == len(prompt)
    text = ctx.tokenizer.decode(prompt, skip_special=False)
    assert text.index("first") < text.index("one") < text.index("second")
    assert_idle(ctx)
