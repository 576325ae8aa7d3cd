"""Structured output as client libraries ask for it (issue 17): the openai SDK's `.parse` on Chat
Completions and Responses, LangChain's `with_structured_output` (json_schema and function-calling
methods), Simon Willison's `llm --schema` over its OpenAI-compatible model config, and forced or
optional tool calls beside a format, against the real server running ninfer-tiny with
--structured-output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("ninfer_qwen35")
pytest.importorskip("ninfer_tiny")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
from pydantic import BaseModel, Field  # noqa: E402

pytestmark = pytest.mark.timeout(600)
FACTS = "Facts: the age is 31; Anna is the name."


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    conftest = request.config.pluginmanager.get_plugin(
        str(Path(__file__).resolve().parents[1] / "conftest.py")
    )
    tmp = tmp_path_factory.mktemp("structured-clients")
    s = conftest.launch_server(
        None,
        "--structured-output",
        "--greedy",
        "--max-concurrency",
        "2",
        log_dir=tmp,
        env={"NINFER_CACHE_DIR": str(tmp / "cache")},
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_base, api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_openai_chat_parse_returns_the_pydantic_object(client, model):
    r = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": FACTS}], response_format=Person, max_tokens=64
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and isinstance(msg.parsed, Person), msg
    assert msg.parsed.age == 31  # the model read it from the conversation


def test_openai_responses_parse_returns_the_pydantic_object(client, model):
    r = client.responses.parse(model=model, input=FACTS, text_format=Person, max_output_tokens=64)
    assert r.status == "completed" and isinstance(r.output_parsed, Person), r.output_text
    assert r.text.format.type == "json_schema" and r.text.format.name == "Person"


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server, model, method):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(
        base_url=server.api_base, api_key="x", model=model, temperature=0, max_tokens=64, max_retries=0
    )
    result = llm.with_structured_output(Person, method=method).invoke(FACTS)
    assert isinstance(result, Person), result


def test_llm_cli_schema(server, model, tmp_path):
    exe = shutil.which("llm") or pytest.skip("the llm CLI is not installed")
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: ninfer\n  model_name: {model}\n  api_base: {server.api_base}\n  supports_schema: true\n"
    )
    env = dict(os.environ, LLM_USER_PATH=str(tmp_path))
    out = subprocess.run(
        [exe, "-m", "ninfer", "--schema", "name, age int", FACTS, "-o", "max_tokens", "64"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    value = json.loads(out.stdout)
    jsonschema.validate(
        value,
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
    )


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
        },
    },
}


def test_a_forced_call_is_generated_under_the_parameter_schema(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
    )
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


def test_anthropic_forced_tool_input_follows_its_schema(server, model):
    anthropic = pytest.importorskip("anthropic")
    a = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)
    fn = WEATHER["function"]
    m = a.messages.create(
        model=model,
        max_tokens=80,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1
    jsonschema.validate(uses[0].input, fn["parameters"])


def test_tools_beside_a_format_give_a_declared_call_or_the_json(client, model):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 40}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": schema}}
    for prompt in ("What's the weather in Paris?", "Say hello."):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            tools=[WEATHER],
            response_format=fmt,
            max_tokens=80,
        )
        ch = r.choices[0]
        if ch.message.tool_calls:
            assert ch.finish_reason == "tool_calls"
            assert {c.function.name for c in ch.message.tool_calls} == {"get_weather"}
        else:
            assert ch.finish_reason in ("stop", "length")
            if ch.finish_reason == "stop":
                jsonschema.validate(json.loads(ch.message.content), schema)


def test_a_bad_schema_is_a_400_and_the_server_keeps_serving(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=8,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "integer", "multipleOf": 5}},
            },
        )
    err = e.value.body
    assert e.value.status_code == 400 and err["code"] == "json_schema_keyword_not_supported"
    assert err["param"] == "response_format.json_schema.schema.multipleOf"
    ok = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4
    )
    assert ok.choices[0].finish_reason in ("stop", "length")
