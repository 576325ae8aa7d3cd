"""Anthropic Messages responses: content blocks, the SSE lifecycle, stop reasons, usage, errors.

Model outputs are forced: the FakeEngine of tests/conftest.py replays scripted text (thinking,
text, Qwen tool-call markup), and a real Engine over the toy runner (ninfer_core.testing) emits
exact token sequences for the stop conditions only a real engine decides (stop strings, output
and context limits). The `anthropic` client library parses the streams through TestClient.
"""

from __future__ import annotations

import base64
import json

import anthropic
import pytest

from ninfer_core.engine.api import EngineError, EngineEvent, Usage
from ninfer_core.protocols.anthropic_history import SIGNATURE_PREFIX, VISIBLE_SIGNATURE_PREFIX

PROTOCOLS = [("ops", "ninfer_core.protocols.ops"), ("anthropic", "ninfer_core.protocols.anthropic")]
HI = [{"role": "user", "content": "Hi"}]
OFF = {"type": "disabled"}
OMITTED = {"type": "adaptive", "display": "omitted"}
TOOLS = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}]
CALL_PARIS = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
              "</parameter>\n</function>\n</tool_call>")
CALL_ROME = CALL_PARIS.replace("Paris", "Rome").replace("\n3\n", "\n1\n")


@pytest.fixture
def app(make_app):
    def make(**options):
        return make_app(builtins=PROTOCOLS, **options)

    return make


def post(client, **fields):
    body = {"model": "claude-test", "max_tokens": 64, "messages": HI, **fields}
    return client.post("/v1/messages", json=body)


def sse(text: str) -> list[tuple[str, object]]:
    """[(event name, data)] with comments as ("comment", text)."""
    out = []
    for block in text.split("\n\n"):
        if not block:
            continue
        if block.startswith(":"):
            out.append(("comment", block))
            continue
        name, data = block.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), block
        obj = json.loads(data[len("data: "):])
        assert obj["type"] == name[len("event: "):]
        out.append((obj["type"], obj))
    return out


def blocks_from_stream(events) -> list[dict]:
    """Rebuild the content blocks from the lifecycle events, checking their order rules."""
    blocks: list[dict] = []
    open_index = None
    for name, obj in events:
        if name == "content_block_start":
            assert open_index is None and obj["index"] == len(blocks)
            blocks.append(dict(obj["content_block"]))
            open_index = obj["index"]
            if blocks[-1]["type"] == "tool_use":
                assert blocks[-1]["input"] == {}
                blocks[-1]["_json"] = ""
        elif name == "content_block_delta":
            assert obj["index"] == open_index
            d, b = obj["delta"], blocks[open_index]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                b["signature"] += d["signature"]
            else:
                assert d["type"] == "input_json_delta"
                b["_json"] += d["partial_json"]
        elif name == "content_block_stop":
            assert obj["index"] == open_index
            b = blocks[open_index]
            if b["type"] == "tool_use":
                b["input"] = json.loads(b.pop("_json"))
            if b["type"] == "thinking":
                assert b["signature"]
            open_index = None
    assert open_index is None
    return blocks


# --- aggregate ---------------------------------------------------------------------------------------

def test_aggregate_message_with_visible_thinking(app):
    client, ctx, engine = app()
    r = post(client)
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("msg_") and body["type"] == "message" and body["role"] == "assistant"
    assert body["model"] == "claude-test"  # the request's label is echoed
    assert body["content"][0]["type"] == "thinking" and body["content"][0]["thinking"] == "Let me think."
    assert body["content"][0]["signature"].startswith(VISIBLE_SIGNATURE_PREFIX)
    assert body["content"][1:] == [{"type": "text", "text": "Hello there."}]
    assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None
    completion = sum(len(ctx.tokenizer.encode(p)) for p in engine.pieces)
    assert body["usage"] == {"input_tokens": len(engine.requests[-1].prompt_ids), "output_tokens": completion,
                             "cache_creation_input_tokens": None, "cache_read_input_tokens": 0}
    assert ctx.ingress.admitted == 0


def test_omitted_display_signature_round_trips(app):
    client, ctx, engine = app()
    body = post(client, thinking=OMITTED).json()
    thinking = body["content"][0]
    assert thinking["thinking"] == ""
    assert thinking["signature"] == SIGNATURE_PREFIX + base64.b64encode(b"Let me think.").decode()
    # replaying the block restores the reasoning: the same prompt as with visible text
    history = [*HI, {"role": "assistant", "content": body["content"]}, {"role": "user", "content": "And?"},
               {"role": "assistant", "content": "Fine"}, {"role": "system", "content": "end"}]
    assert post(client, messages=history, chat_template_kwargs={"preserve_thinking": True}).status_code == 200
    omitted_prompt = engine.requests[-1].prompt_ids
    visible = [*HI, {"role": "assistant", "content": [{**thinking, "thinking": "Let me think.", "signature": "x"},
                                                      body["content"][1]]}, *history[2:]]
    assert post(client, messages=visible, chat_template_kwargs={"preserve_thinking": True}).status_code == 200
    assert engine.requests[-1].prompt_ids == omitted_prompt
    assert "Let me think." in ctx.tokenizer.decode(omitted_prompt, skip_special=False)


def test_aggregate_without_thinking(app):
    client, _, engine = app()
    engine.pieces = ["Plain", " answer"]
    body = post(client, thinking=OFF).json()
    assert body["content"] == [{"type": "text", "text": "Plain answer"}]


def test_tool_calls_become_tool_use_blocks(app):
    client, _, engine = app()
    engine.pieces = ["Need data.", "</think>\n\n", "I'll check.\n\n", CALL_PARIS[:30], CALL_PARIS[30:], "\n", CALL_ROME]
    body = post(client, tools=TOOLS).json()
    kinds = [b["type"] for b in body["content"]]
    assert kinds == ["thinking", "text", "tool_use", "tool_use"]
    assert body["content"][1] == {"type": "text", "text": "I'll check."}
    calls = body["content"][2:]
    assert [c["input"] for c in calls] == [{"city": "Paris", "days": 3}, {"city": "Rome", "days": 1}]
    assert all(c["name"] == "get_weather" and c["id"].startswith("toolu_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    assert body["stop_reason"] == "tool_use"
    one = post(client, tools=TOOLS, tool_choice={"type": "auto", "disable_parallel_tool_use": True}).json()
    assert [b["type"] for b in one["content"]] == ["thinking", "text", "tool_use"]
    assert one["content"][2]["input"] == {"city": "Paris", "days": 3}
    # without tools the markup is text
    plain = post(client).json()
    assert plain["content"][1]["type"] == "text" and "<tool_call>" in plain["content"][1]["text"]
    assert plain["stop_reason"] == "end_turn"


def test_forced_tool_continues_the_opener(app):
    client, _, engine = app()
    engine.pieces = ["<parameter=city>\nOslo\n</parameter>\n", "</function>\n</tool_call>"]
    body = post(client, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"}).json()
    assert [b["type"] for b in body["content"]] == ["tool_use"]
    assert body["content"][0]["name"] == "get_weather" and body["content"][0]["input"] == {"city": "Oslo"}
    assert body["stop_reason"] == "tool_use"


def test_whitespace_only_text_opens_no_block(app):
    client, _, engine = app()
    engine.pieces = ["\n\n", "  ", CALL_PARIS]
    body = post(client, tools=TOOLS, thinking=OFF).json()
    assert [b["type"] for b in body["content"]] == ["tool_use"]
    engine.pieces = [" \n", "  x"]
    assert post(client, thinking=OFF).json()["content"] == [{"type": "text", "text": " \n  x"}]


def _finish_script(engine, reason, detail, matched=None, cached=0, text="cut here"):
    def script(request):
        ids = engine.tokenizer.encode(text)
        return [EngineEvent("admitted", usage=Usage(len(request.prompt_ids), 0, cached)),
                EngineEvent("delta", token_ids=ids, text=text),
                EngineEvent("finish", finish_reason=reason, stop_reason=detail, matched_stop=matched,
                            usage=Usage(len(request.prompt_ids), len(ids), cached))]

    engine.script = script


@pytest.mark.parametrize("reason,detail,matched,expected", [
    ("stop", "stop_string", "END", ("stop_sequence", "END")),
    ("stop", "eos", None, ("end_turn", None)),
    ("length", "max_tokens", None, ("max_tokens", None)),
    ("length", "context", None, ("model_context_window_exceeded", None)),
])
def test_stop_reasons(app, reason, detail, matched, expected):
    client, _, engine = app()
    _finish_script(engine, reason, detail, matched)
    body = post(client, thinking=OFF, stop_sequences=["END"]).json()
    assert (body["stop_reason"], body["stop_sequence"]) == expected
    events = sse(post(client, thinking=OFF, stream=True).text)
    delta = [obj for name, obj in events if name == "message_delta"][0]
    assert (delta["delta"]["stop_reason"], delta["delta"]["stop_sequence"]) == expected


def test_cached_prefix_is_reported_as_cache_read(app):
    client, _, engine = app()
    _finish_script(engine, "stop", "eos", cached=7)
    body = post(client, thinking=OFF).json()
    prompt = len(engine.requests[-1].prompt_ids)
    assert body["usage"]["input_tokens"] == prompt - 7 and body["usage"]["cache_read_input_tokens"] == 7
    events = sse(post(client, thinking=OFF, stream=True).text)
    start = events[0][1]["message"]["usage"]
    assert start == {"input_tokens": prompt - 7, "output_tokens": 0, "cache_creation_input_tokens": None,
                     "cache_read_input_tokens": 7}
    assert [obj for n, obj in events if n == "message_delta"][0]["usage"] == body["usage"]


# --- streaming -----------------------------------------------------------------------------------------

def test_stream_lifecycle_matches_the_aggregate(app):
    client, ctx, engine = app()
    engine.pieces = ["Need data.", "</think>\n\n", "I'll check.\n\n", CALL_PARIS]
    r = post(client, tools=TOOLS, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["request-id"].startswith("req_")
    events = sse(r.text)
    names = [n for n, _ in events]
    assert names == ["message_start",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    deltas = [obj["delta"]["type"] for n, obj in events if n == "content_block_delta"]
    assert deltas == ["thinking_delta", "signature_delta", "text_delta", "input_json_delta"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    streamed = blocks_from_stream(events)
    aggregate = post(client, tools=TOOLS).json()
    for b in streamed + aggregate["content"]:
        b.pop("id", None)
    assert streamed == aggregate["content"]
    assert events[-2][1]["usage"] == aggregate["usage"]
    assert ctx.ingress.admitted == 0


def test_stream_omitted_display_has_no_thinking_delta(app):
    client, _, _ = app()
    events = sse(post(client, thinking=OMITTED, stream=True).text)
    deltas = [obj["delta"] for n, obj in events if n == "content_block_delta"]
    assert [d["type"] for d in deltas] == ["signature_delta", "text_delta", "text_delta"]
    assert deltas[0]["signature"] == SIGNATURE_PREFIX + base64.b64encode(b"Let me think.").decode()
    assert blocks_from_stream(events)[0] == {"type": "thinking", "thinking": "", "signature": deltas[0]["signature"]}


def test_keepalive_comments_are_followed_by_ping(app):
    client, ctx, engine = app()
    ctx.keepalive_s = 0.02
    engine.delay_s = 0.15  # every event, admission included, arrives after several keep-alives
    events = sse(post(client, stream=True).text)
    names = [n for n, _ in events]
    assert names[0] == "comment" and names.index("message_start") > 0  # waiting for admission
    for i, (name, obj) in enumerate(events):
        if name == "comment":
            assert obj == ": keep-alive" and events[i + 1] == ("ping", {"type": "ping"})
    assert [n for n in names if n not in ("comment", "ping")][-2:] == ["message_delta", "message_stop"]
    text = "".join(obj["delta"]["text"] for n, obj in events
                   if n == "content_block_delta" and obj["delta"]["type"] == "text_delta")
    assert text == "Hello there."


@pytest.mark.parametrize("error,status,type_", [
    (EngineError(503, "request_queue_timeout", "not admitted in time"), 504, "timeout_error"),
    (EngineError(500, "server_error", "model execution failed"), 500, "api_error"),
    (EngineError(503, "service_unavailable", "server is shutting down"), 503, "api_error"),
])
def test_engine_errors_aggregate_and_stream(app, error, status, type_):
    client, ctx, engine = app()
    engine.script = lambda req: [EngineEvent("delta", token_ids=[1], text="partial"), EngineEvent("error", error=error)]
    r = post(client)
    assert r.status_code == status
    assert r.json() == {"type": "error", "error": {"type": type_, "message": error.message, "code": error.code},
                        "request_id": r.headers["request-id"]}
    r = post(client, stream=True)
    events = sse(r.text)
    assert events[-1] == ("error", {"type": "error", "error": {"type": type_, "message": error.message,
                                                               "code": error.code},
                                    "request_id": r.headers["request-id"]})
    assert "message_stop" not in [n for n, _ in events]
    assert ctx.ingress.admitted == 0


def test_failure_before_the_stream_starts_keeps_its_http_status(app):
    client, ctx, engine = app()
    late = EngineError(503, "request_queue_timeout", "not admitted in time")
    engine.script = lambda req: [EngineEvent("error", error=late)]
    r = post(client, stream=True)
    assert r.status_code == 504 and r.headers["content-type"].startswith("application/json")
    assert r.json() == {"type": "error", "error": {"type": "timeout_error", "message": "not admitted in time",
                                                   "code": "request_queue_timeout"},
                        "request_id": r.headers["request-id"]}
    # after a keep-alive interval the stream has started: the same failure is an error event
    ctx.keepalive_s = 0.02
    engine.delay_s = 0.1
    r = post(client, stream=True)
    assert r.status_code == 200
    events = sse(r.text)
    assert events[0] == ("comment", ": keep-alive") and events[1][0] == "ping"
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "timeout_error"
    assert ctx.ingress.admitted == 0


def test_cancelled_stream_ends_with_an_error_event(app):
    client, ctx, engine = app()
    engine.script = lambda req: [EngineEvent("admitted"), EngineEvent("finish", finish_reason="cancelled",
                                                                       usage=Usage())]
    events = sse(post(client, stream=True).text)
    assert [n for n, _ in events] == ["message_start", "error"]
    assert events[1][1]["error"]["code"] == "request_cancelled"
    assert post(client).status_code == 503
    assert ctx.ingress.admitted == 0


# --- the anthropic client library over the app ----------------------------------------------------------

def test_sdk_parses_aggregate_and_stream(app):
    client, ctx, engine = app()
    engine.pieces = ["Need data.", "</think>\n\n", "Checking.\n\n", CALL_PARIS]
    sdk = anthropic.Anthropic(base_url="http://testserver", api_key="k", http_client=client, max_retries=0)
    msg = sdk.messages.create(model="m", max_tokens=50, messages=HI, tools=TOOLS)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[2].input == {"city": "Paris", "days": 3} and msg.stop_reason == "tool_use"
    with sdk.messages.stream(model="m", max_tokens=50, messages=HI, tools=TOOLS,
                             thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"}) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert "signature" in kinds and "thinking" not in kinds
    assert final.content[0].type == "thinking" and final.content[0].signature.startswith(SIGNATURE_PREFIX)
    assert final.content[2].input == {"city": "Paris", "days": 3} and final.stop_reason == "tool_use"
    count = sdk.messages.count_tokens(model="m", messages=HI, tools=TOOLS)
    assert count.input_tokens == len(engine.requests[0].prompt_ids)
    with pytest.raises(anthropic.BadRequestError) as e:
        sdk.messages.create(model="m", max_tokens=0, messages=HI)
    assert e.value.body["error"]["param"] == "max_tokens" and e.value.request_id.startswith("req_")
    engine.submit_error = EngineError(429, "server_overloaded", "busy")
    with pytest.raises(anthropic.APIStatusError) as e:
        sdk.messages.create(model="m", max_tokens=5, messages=HI)
    assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
    engine.submit_error = None
    # a failure after the stream started reaches the client as an error event
    late = EngineError(503, "request_queue_timeout", "not admitted in time")
    engine.script = lambda req: [EngineEvent("admitted"), EngineEvent("error", error=late)]
    with pytest.raises(anthropic.APIStatusError) as e:
        with sdk.messages.stream(model="m", max_tokens=5, messages=HI) as stream:
            stream.until_done()
    assert e.value.body["error"]["type"] == "timeout_error"
    assert e.value.body["error"]["code"] == "request_queue_timeout"


# --- a real Engine over the toy runner ------------------------------------------------------------------

@pytest.fixture
def toy(app):
    """(client, ctx, force): the app over a real Engine whose toy model emits `force(body, text)`."""
    from ninfer_core.engine.engine import Engine
    from ninfer_core.protocols.anthropic import prepare_prompt
    from ninfer_core.protocols.anthropic_request import parse_request
    from ninfer_core.testing import ScriptPolicy, ToyRunner

    engines = []

    def make(**engine_options):
        client, ctx, _ = app(engine_options=engine_options)
        tok = ctx.tokenizer
        im_end = tok.token_to_id("<|im_end|>")
        runner = ToyRunner(vocab_size=tok.vocab_size, eos_token_ids=(im_end,))
        ctx.engine = Engine(runner, tok, ctx.options.engine)
        ctx.engine.start()
        engines.append(ctx.engine)

        def force(body: dict, text: str) -> list[int]:
            """Make the model answer `body` with exactly `text` (then <|im_end|>); returns the prompt ids."""
            prompt = prepare_prompt(ctx, parse_request({"model": "m", **body}, ctx)).ids
            out = [t for piece in _pieces(text) for t in tok.encode(piece, allow_special=piece.startswith("<"))]
            runner.policy = ScriptPolicy({tuple(prompt): out}, after=im_end)
            return prompt

        return client, ctx, force

    yield make
    for eng in engines:
        eng.shutdown(timeout=30)


def _pieces(text: str) -> list[str]:
    """Split so that control-token spellings (</think>, <tool_call>...) encode as their tokens."""
    import re

    return [p for p in re.split(r"(</?think>|</?tool_call>)", text) if p]


def assert_idle(ctx):
    snap = ctx.engine.snapshot()
    assert snap["lanes_active"] == 0 and snap["pending"] == 0 and snap["outstanding"] == 0, snap
    assert ctx.ingress.admitted == 0


def test_engine_stop_sequence_reports_the_matched_string(toy):
    client, ctx, force = toy()
    body = {"messages": HI, "thinking": OFF, "max_tokens": 40, "stop_sequences": ["XYZ", "END"]}
    force(body, "Sunny END and more")
    msg = client.post("/v1/messages", json={"model": "m", **body}).json()
    assert msg["content"] == [{"type": "text", "text": "Sunny "}]
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "END")
    events = sse(client.post("/v1/messages", json={"model": "m", **body, "stream": True}).text)
    delta = [obj for n, obj in events if n == "message_delta"][0]["delta"]
    assert delta == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert_idle(ctx)


def test_engine_output_limit_and_context_window(toy):
    client, ctx, force = toy(max_context=256)
    body = {"messages": HI, "thinking": OFF, "max_tokens": 3}
    force(body, "abcdefgh")
    msg = client.post("/v1/messages", json={"model": "m", **body}).json()
    assert msg["content"] == [{"type": "text", "text": "abc"}]
    assert msg["stop_reason"] == "max_tokens" and msg["usage"]["output_tokens"] == 3
    # no max_tokens: the default limit is the remaining context, and running into it says so
    body = {"messages": HI, "thinking": OFF}
    prompt = force(body, "z" * 300)
    msg = client.post("/v1/messages", json={"model": "m", **body}).json()
    assert msg["stop_reason"] == "model_context_window_exceeded"
    assert msg["usage"]["output_tokens"] == 256 - len(prompt)
    assert msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"] == len(prompt)
    assert_idle(ctx)


def test_engine_thinking_and_tool_call_stream(toy):
    client, ctx, force = toy()
    body = {"messages": HI, "tools": TOOLS, "max_tokens": 200}
    force(body, "Check weather.\n</think>\n\nLooking.\n\n" + CALL_PARIS)
    r = client.post("/v1/messages", json={"model": "m", **body, "stream": True})
    events = sse(r.text)
    assert events[0][0] == "message_start"
    blocks = blocks_from_stream(events)
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[0]["thinking"] == "Check weather.\n" and blocks[1]["text"] == "Looking."
    assert blocks[2]["input"] == {"city": "Paris", "days": 3}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert events[-2][1]["usage"]["output_tokens"] > 0
    assert_idle(ctx)
