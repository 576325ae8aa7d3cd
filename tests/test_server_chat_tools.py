"""Chat Completions over TestClient with the real Engine on the toy runner, outputs forced by script.

Covers what random weights cannot show deterministically: tool calls (aggregate and streamed),
forced tool choice, custom tools, malformed calls, log probabilities, thinking budgets and the
post-thinking switch.
"""

from __future__ import annotations

import json

import pytest
from test_server_chat import sse_events

from ninfer_core.config import EngineOptions, ServeOptions, ThinkingOptions
from ninfer_core.engine.engine import Engine
from ninfer_core.testing import ToyRunner

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "custom", "custom": {"name": "shell", "description": "run a command"}}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n</function>\n</tool_call>")
HI = [{"role": "user", "content": "Weather in Paris?"}]


class PromptScript:
    """Runner policy: after any new prompt, emit `self.output` (text, encoded) then <|im_end|>.

    The first logits call of a request is at its whole prompt (prefill in one chunk), so a prefix
    never seen before is a prompt; later calls continue the known prompt they extend."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eos = tokenizer.token_to_id("<|im_end|>")
        self.output: list[int] = []
        self.prompts: list[tuple[int, ...]] = []

    def set(self, text: str, eos: bool = True) -> None:
        self.output = self.tok.encode(text) + ([self.eos] if eos else [])

    def __call__(self, prefix: list[int]) -> int | None:
        key = tuple(prefix)
        for p in self.prompts:
            if len(key) > len(p) and key[: len(p)] == p:
                i = len(key) - len(p)
                return self.output[i] if i < len(self.output) else None
        if key not in self.prompts:
            self.prompts.append(key)
        return self.output[0] if self.output else None


class RecordingEngine(Engine):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.requests = []

    def submit(self, request):
        self.requests.append(request)
        return super().submit(request)


@pytest.fixture
def toy_app():
    from fastapi.testclient import TestClient
    from qwen_format import QWEN35_TEMPLATE, byte_tokenizer_section, with_format
    from qwen_format import sampling_presets as qwen_sampling_presets

    from ninfer_core.plugins import PluginHost, PluginSelection
    from ninfer_core.server.app import create_app
    from ninfer_core.server.context import ServedModel, ServerContext
    from ninfer_core.tokenizer import Tokenizer
    from ninfer_core.tokenizer.chat_template import ChatTemplate

    made = []

    def make(thinking: ThinkingOptions | None = None, **options):
        tok = with_format(Tokenizer.from_section(byte_tokenizer_section()))
        script = PromptScript(tok)
        eng_opts = EngineOptions(max_context=4096, prefill_chunk=4096)
        opts = ServeOptions(artifact="/models/toy.ninfer", engine=eng_opts, thinking=thinking or ThinkingOptions(),
                            **options)
        runner = ToyRunner(vocab_size=tok.vocab_size, eos_token_ids=(script.eos,), policy=script)
        engine = RecordingEngine(runner, tok, eng_opts)
        engine.start()
        ctx = ServerContext(options=opts, plugins=PluginHost(PluginSelection(autoload=False)), tokenizer=tok,
                            chat_template=ChatTemplate(QWEN35_TEMPLATE), engine=engine,
                            sampling_presets=qwen_sampling_presets())
        ctx.model = ServedModel(id="toy", artifact_path=opts.artifact, architecture="qwen3_5",
                                max_model_len=4096, n_vocab=tok.vocab_size)
        ctx.mark_ready()
        client = TestClient(create_app(ctx))
        made.append((client, engine))
        return client, ctx, engine, script

    yield make
    for client, engine in made:
        client.close()
        snap = engine.snapshot()
        engine.shutdown(timeout=30)
        assert snap["lanes_active"] == 0 and snap["pages_free"] == snap["pages_total"], snap


def chat(client, **body):
    body.setdefault("messages", HI)
    body.setdefault("temperature", 0)
    return client.post("/v1/chat/completions", json=body)


def stream(client, **body) -> list:
    r = chat(client, stream=True, **body)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    return events[:-1]


# -- tool calls --------------------------------------------------------------------------------


def test_tool_call_aggregate(toy_app):
    client, ctx, engine, script = toy_app()
    script.set("Need the weather.\n</think>\n\nLet me check.\n\n" + CALL)
    body = chat(client, tools=TOOLS).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["reasoning_content"] == "Need the weather.\n" and msg["content"] == "Let me check."
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}
    # the tools were rendered into the prompt
    prompt = ctx.tokenizer.decode(engine.requests[-1].prompt_ids, skip_special=False)
    assert '"name": "get_weather"' in prompt and '"name": "shell"' in prompt


def test_tool_call_stream(toy_app):
    client, _, _, script = toy_app()
    script.set("</think>\n\nChecking.\n\n" + CALL + "\n" + CALL.replace("Paris", "Rome"))
    chunks = stream(client, tools=TOOLS, stream_options={"include_usage": True})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Checking."
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1]
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Rome"]
    assert all(c["type"] == "function" and c["id"].startswith("call_") and c["function"]["name"] == "get_weather"
               for c in calls)
    assert len({c["id"] for c in calls}) == 2
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "tool_calls" and all(f is None for f in finish[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] > 0


def test_parallel_tool_calls_false_keeps_the_first(toy_app):
    client, _, _, script = toy_app()
    script.set("</think>\n\n" + CALL + "\n" + CALL.replace("Paris", "Rome"))
    calls = chat(client, tools=TOOLS, parallel_tool_calls=False).json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris"]


def test_forced_tool_call_ends_the_prompt_with_the_opener(toy_app):
    client, ctx, engine, script = toy_app()
    script.set("<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")
    body = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}).json()
    msg = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert msg["content"] is None and msg["reasoning_content"] is None
    prompt = ctx.tokenizer.decode(engine.requests[-1].prompt_ids, skip_special=False)
    # default thinking switched off, then the opener
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>\n")


def test_required_over_one_tool_forces_it_and_closes_an_unclosed_call(toy_app):
    client, ctx, engine, script = toy_app()
    script.set("<parameter=city>\nOslo\n</parameter>\n")  # stops before closing: the decoder closes it
    tools = TOOLS[:1]
    msg = chat(client, tools=tools, tool_choice="required").json()["choices"][0]["message"]
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    prompt = ctx.tokenizer.decode(engine.requests[-1].prompt_ids, skip_special=False)
    assert prompt.endswith("<tool_call>\n<function=get_weather>\n")


def test_allowed_tools_required_forces_that_call_and_narrows_the_prompt(toy_app):
    client, ctx, engine, script = toy_app()
    script.set("<parameter=input>\nls -l\n</parameter>\n</function>\n</tool_call>")
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "required",
                                                          "tools": [{"type": "custom", "name": "shell"}]}}
    msg = chat(client, tools=TOOLS, tool_choice=choice).json()["choices"][0]["message"]
    # a custom tool answers as a custom call with its single string input
    assert msg["tool_calls"][0]["type"] == "custom"
    assert msg["tool_calls"][0]["custom"] == {"name": "shell", "input": "ls -l"}
    prompt = ctx.tokenizer.decode(engine.requests[-1].prompt_ids, skip_special=False)
    assert '"name": "get_weather"' not in prompt and prompt.endswith("<function=shell>\n")


def test_tool_choice_none_leaves_markup_as_content(toy_app):
    client, ctx, engine, script = toy_app()
    script.set("</think>\n\n" + CALL)
    body = chat(client, tools=TOOLS, tool_choice="none").json()
    msg = body["choices"][0]["message"]
    assert msg["content"] == CALL and "tool_calls" not in msg and body["choices"][0]["finish_reason"] == "stop"
    prompt = ctx.tokenizer.decode(engine.requests[-1].prompt_ids, skip_special=False)
    assert "get_weather" not in prompt


def test_malformed_call_becomes_malformed_tool_call(toy_app):
    client, _, _, script = toy_app()
    script.set("</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis")
    msg = chat(client, tools=TOOLS).json()["choices"][0]["message"]
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "malformed_tool_call"
    assert "error" in json.loads(call["function"]["arguments"])


def test_quoted_markup_without_a_call_stays_content_in_the_stream(toy_app):
    client, _, _, script = toy_app()
    text = "Write <tool_call> then <function_calls> to call tools."
    script.set("</think>\n\n" + text)
    chunks = stream(client, tools=TOOLS)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# -- log probabilities -------------------------------------------------------------------------


def test_logprobs_cover_content_tokens_only(toy_app):
    client, ctx, _, script = toy_app()
    script.set("Reasoning here.\n</think>\n\nAnswer text")
    body = chat(client, logprobs=True, top_logprobs=3).json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == "Answer text"
    records = choice["logprobs"]["content"]
    assert choice["logprobs"]["refusal"] is None
    assert "".join(r["token"] for r in records) == "Answer text"
    for r in records:
        assert bytes(r["bytes"]).decode() == r["token"]
        assert len(r["top_logprobs"]) == 3
        values = [t["logprob"] for t in r["top_logprobs"]]
        assert values == sorted(values, reverse=True)
        assert r["logprob"] == pytest.approx(values[0]) and r["top_logprobs"][0]["token"] == r["token"]
    # streamed records equal the aggregate ones, each travelling with content
    chunks = stream(client, logprobs=True, top_logprobs=3)
    streamed = [r for c in chunks for r in ((c["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert streamed == records
    for c in chunks:
        if c["choices"][0]["delta"].get("reasoning_content"):
            assert c["choices"][0]["logprobs"] is None


def test_logprobs_include_tool_markup(toy_app):
    client, _, _, script = toy_app()
    script.set("</think>\n\n" + CALL)
    body = chat(client, tools=TOOLS, logprobs=True).json()
    records = body["choices"][0]["logprobs"]["content"]
    assert "".join(r["token"] for r in records) == CALL
    assert all(r["top_logprobs"] == [] for r in records)
    chunks = stream(client, tools=TOOLS, logprobs=True)
    streamed = [r for c in chunks for r in ((c["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert streamed == records


def test_logprobs_not_requested_are_null(toy_app):
    client, _, _, script = toy_app()
    script.set("</think>\n\nx")
    assert chat(client).json()["choices"][0]["logprobs"] is None
    assert chat(client, logprobs=False).json()["choices"][0]["logprobs"] is None


def test_stop_string_drops_the_cut_records(toy_app):
    client, _, _, script = toy_app()
    script.set("</think>\n\nkeep END drop")
    body = chat(client, logprobs=True, stop=["END"]).json()
    assert body["choices"][0]["message"]["content"] == "keep "
    assert "".join(r["token"] for r in body["choices"][0]["logprobs"]["content"]) == "keep "


# -- thinking budgets and post-thinking --------------------------------------------------------


def test_thinking_budget_inserts_the_guidance(toy_app):
    client, _, engine, script = toy_app()
    script.set("a" * 200, eos=False)
    body = chat(client, thinking_budget=5, max_tokens=400).json()
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"].startswith("aaaaa\n\nConsidering the limited time")
    req = engine.requests[-1]
    assert req.thinking_budget == 5 and req.in_reasoning and req.budget_close_ids
    assert body["usage"]["completion_tokens"] == 400  # the inserted tokens count
    assert msg["content"].startswith("a")


def test_default_thinking_budget_and_custom_message(toy_app):
    client, _, engine, script = toy_app(ThinkingOptions(default_thinking_budget=4, thinking_budget_message="Stop."))
    script.set("b" * 100, eos=False)
    msg = chat(client, max_tokens=60).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "bbbbStop.\n"
    assert msg["content"].startswith("b")
    # a request that does not think receives no cap, whatever it sends
    chat(client, enable_thinking=False, thinking_budget=3, max_tokens=5)
    assert engine.requests[-1].thinking_budget is None and not engine.requests[-1].in_reasoning
    # the request's own budget replaces the default
    chat(client, thinking_budget=9, max_tokens=5)
    assert engine.requests[-1].thinking_budget == 9


def test_post_thinking_reaches_the_engine(toy_app):
    client, _, engine, script = toy_app(ThinkingOptions(post_thinking=True, post_thinking_overrides={"top_k": 7}))
    script.set("r</think>\n\nok")
    chat(client, temperature=1.0)
    pt = engine.requests[-1].post_thinking
    assert (pt.temperature, pt.top_k, pt.seed) == (0.2, 7, None)
    chat(client, temperature=1.0, post_thinking={"temperature": 0.5, "seed": 11})
    pt = engine.requests[-1].post_thinking
    assert (pt.temperature, pt.top_k, pt.seed) == (0.5, 7, 11)
    chat(client, enable_thinking=False, post_thinking={})
    assert engine.requests[-1].post_thinking is None  # no thinking: original sampler kept


def test_server_keeps_serving_after_every_feature(toy_app):
    client, _, engine, script = toy_app()
    script.set("</think>\n\nfine")
    assert chat(client, tools=TOOLS, logprobs=True, top_logprobs=20, thinking_budget=3,
                post_thinking={}).status_code == 200
    assert chat(client).json()["choices"][0]["message"]["content"] == "fine"


def test_parse_fallback_logs_the_classification_only(toy_app, caplog):
    import logging

    client, _, _, script = toy_app()
    script.set("</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSECRET-CITY")
    with caplog.at_level(logging.INFO):
        msg = chat(client, tools=TOOLS, messages=[{"role": "user", "content": "PROMPT-TEXT"}]).json()
    assert msg["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "malformed_tool_call"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("malformed_structure" in w for w in warnings), warnings
    for r in caplog.records:
        text = r.getMessage()
        assert "SECRET-CITY" not in text and "PROMPT-TEXT" not in text and "<parameter" not in text
