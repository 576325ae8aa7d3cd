"""Structured-output request checks over HTTP: every refused schema keyword and malformed format
answers 400 with the spec's shape (status, code, param naming the field and keyword) on each
protocol, and the server keeps serving; the --structured-output gate and its unconstrained mode."""

from __future__ import annotations

import pytest

from ninfer_core.structured.compiler import StructuredOutput

OBJ = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture
def app(make_app):
    client, ctx, engine = make_app(structured_output=True)
    ctx.structured = StructuredOutput(ctx.tokenizer, ctx.tokenizer.vocab_size)
    return client, ctx, engine


def chat(schema, strict=True):
    return {
        "messages": MSG,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "strict": strict, "schema": schema},
        },
    }


SCHEMA_PARAM = "response_format.json_schema.schema"

# (schema, code, param inside the schema): one case per refused keyword and rule of the subset
REFUSED = [
    ({"type": "integer", "multipleOf": 2}, "json_schema_keyword_not_supported", "multipleOf"),
    ({"oneOf": [{"type": "string"}]}, "json_schema_keyword_not_supported", "oneOf"),
    ({"allOf": [{"type": "string"}]}, "json_schema_keyword_not_supported", "allOf"),
    ({"not": {"type": "string"}}, "json_schema_keyword_not_supported", "not"),
    ({"if": {"type": "string"}, "then": {}}, "json_schema_keyword_not_supported", "if"),
    ({"type": "object", "then": {}}, "json_schema_keyword_not_supported", "then"),
    ({"type": "object", "else": {}}, "json_schema_keyword_not_supported", "else"),
    (
        {"type": "object", "dependentRequired": {"a": ["b"]}},
        "json_schema_keyword_not_supported",
        "dependentRequired",
    ),
    ({"type": "object", "dependentSchemas": {}}, "json_schema_keyword_not_supported", "dependentSchemas"),
    (
        {"type": "object", "patternProperties": {"^x": {}}},
        "json_schema_keyword_not_supported",
        "patternProperties",
    ),
    (
        {"type": "object", "propertyNames": {"maxLength": 3}},
        "json_schema_keyword_not_supported",
        "propertyNames",
    ),
    ({"type": "object", "minProperties": 1}, "json_schema_keyword_not_supported", "minProperties"),
    ({"type": "array", "contains": {"type": "integer"}}, "json_schema_keyword_not_supported", "contains"),
    ({"type": "array", "minContains": 1}, "json_schema_keyword_not_supported", "minContains"),
    ({"type": "array", "maxContains": 1}, "json_schema_keyword_not_supported", "maxContains"),
    (
        {"type": "object", "unevaluatedProperties": False},
        "json_schema_keyword_not_supported",
        "unevaluatedProperties",
    ),
    ({"type": "array", "unevaluatedItems": False}, "json_schema_keyword_not_supported", "unevaluatedItems"),
    (
        {"type": "array", "items": [{}], "additionalItems": False},
        "json_schema_keyword_not_supported",
        "additionalItems",
    ),
    ({"$dynamicRef": "#x"}, "json_schema_keyword_not_supported", "$dynamicRef"),
    ({"$anchor": "x", "type": "string"}, "json_schema_keyword_not_supported", "$anchor"),
    ({"type": "string", "contentEncoding": "base64"}, "json_schema_keyword_not_supported", "contentEncoding"),
    ({"type": "string", "x-custom": 1}, "json_schema_keyword_not_supported", "x-custom"),
    ({"type": "string", "format": "email"}, "json_schema_keyword_not_supported", "format"),
    ({"format": "date"}, "json_schema_keyword_not_supported", "format"),
    ({"type": "string", "pattern": "a", "format": "date"}, "json_schema_keyword_not_supported", "format"),
    ({"type": "string", "pattern": "a", "maxLength": 3}, "json_schema_keyword_not_supported", "pattern"),
    ({"type": "string", "pattern": "\\bword"}, "json_schema_keyword_not_supported", "pattern"),
    ({"type": "string", "pattern": "(a)\\1"}, "json_schema_keyword_not_supported", "pattern"),
    ({"type": "string", "pattern": "(?=a)a"}, "json_schema_keyword_not_supported", "pattern"),
    ({"type": "string", "pattern": "(?i)a"}, "json_schema_keyword_not_supported", "pattern"),
    ({"type": "string", "pattern": "a+?"}, "json_schema_keyword_not_supported", "pattern"),
    ({"type": "string", "pattern": "a{1, 2}"}, "json_schema_keyword_not_supported", "pattern"),
    ({"type": "string", "pattern": "[\\s-z]"}, "json_schema_keyword_not_supported", "pattern"),
    ({"type": "string", "pattern": "^a|b$"}, "json_schema_keyword_not_supported", "pattern"),
    ({"type": "string", "pattern": "\\q"}, "json_schema_keyword_not_supported", "pattern"),
    ({"type": "string", "pattern": "\\ud800"}, "json_schema_keyword_not_supported", "pattern"),
    ({"minimum": 1}, "json_schema_keyword_not_supported", "minimum"),
    ({"type": "integer", "minimum": 1.5}, "json_schema_keyword_not_supported", "minimum"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "json_schema_keyword_not_supported", "minimum"),
    (
        {"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1.0000001},
        "json_schema_keyword_not_supported",
        "exclusiveMinimum",
    ),
    ({"type": "number", "maximum": 1e300}, "invalid_json_schema", "maximum"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "json_schema_keyword_not_supported", "minLength"),
    ({"type": "string", "maxLength": 2**31}, "invalid_json_schema", "maxLength"),
    ({"type": "array", "minItems": 2, "maxItems": 1}, "json_schema_keyword_not_supported", "minItems"),
    (
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "json_schema_keyword_not_supported",
        "uniqueItems",
    ),
    (
        {"type": "array", "items": {"type": "string", "maxLength": 2}, "uniqueItems": True},
        "json_schema_keyword_not_supported",
        "uniqueItems",
    ),
    ({"type": "object", "required": ["a", "a"]}, "invalid_json_schema", "required"),
    (
        {"type": "object", "required": ["z"], "additionalProperties": False},
        "json_schema_keyword_not_supported",
        "required",
    ),
    ({"$ref": "https://example.com/s.json"}, "json_schema_keyword_not_supported", "$ref"),
    ({"$ref": "#/$defs/a~1b", "$defs": {}}, "json_schema_keyword_not_supported", "$ref"),
    ({"$ref": "#/$defs/missing"}, "invalid_json_schema", "$ref"),
    (
        {"$ref": "#/$defs/a", "type": "string", "$defs": {"a": {}}},
        "json_schema_keyword_not_supported",
        "type",
    ),
    ({"$id": "urn:x", "properties": {"a": {"$ref": "#"}}}, "json_schema_keyword_not_supported", "$id"),
    ({"$schema": "http://json-schema.org/draft-04/schema#"}, "json_schema_keyword_not_supported", "$schema"),
    ({"enum": ["a"], "const": "b"}, "json_schema_keyword_not_supported", "const"),
    ({"enum": ["a"], "maxLength": 2}, "json_schema_keyword_not_supported", "maxLength"),
    ({"type": "integer", "enum": ["a"]}, "json_schema_keyword_not_supported", "type"),
    ({"anyOf": [{"type": "string"}], "properties": {}}, "json_schema_keyword_not_supported", "properties"),
    ({"type": "integer", "anyOf": [{"type": "string"}]}, "json_schema_keyword_not_supported", "anyOf"),
    ({"type": "wat"}, "invalid_json_schema", "type"),
]


def _ids(case):
    return case[2]


@pytest.mark.parametrize("schema,code,where", REFUSED, ids=[f"{i}-{c[2]}" for i, c in enumerate(REFUSED)])
def test_each_refused_keyword_names_itself(app, schema, code, where):
    client, _, engine = app
    r = client.post(CHAT, json=chat({"type": "object", "properties": {"v": schema}}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["type"] == "invalid_request_error"
    assert err["param"] == f"{SCHEMA_PARAM}.properties.v.{where}"
    assert where.split(".")[0] in err["message"] or code == "invalid_json_schema"
    assert not engine.requests  # nothing reached the engine
    ok = client.post(CHAT, json=chat(OBJ))  # the server keeps serving
    assert ok.status_code == 200 and engine.requests[-1].constraint is not None


@pytest.mark.parametrize(
    "path,body,param",
    [
        (
            "/v1/responses",
            {
                "model": "test-model",
                "input": "hi",
                "text": {"format": {"type": "json_schema", "name": "x", "schema": {"oneOf": []}}},
            },
            "text.format.schema.oneOf",
        ),
        (
            "/v1/messages",
            {
                "model": "test-model",
                "max_tokens": 8,
                "messages": MSG,
                "output_config": {
                    "format": {"type": "json_schema", "schema": {"type": "integer", "multipleOf": 3}}
                },
            },
            "output_config.format.schema.multipleOf",
        ),
        (
            "/completion",
            {"prompt": "x", "json_schema": {"type": "string", "format": "uri"}},
            "json_schema.format",
        ),
        (
            "/v1/completions",
            {
                "prompt": "x",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "object", "minProperties": 2}},
                },
            },
            "response_format.json_schema.schema.minProperties",
        ),
        ("/v1/completions", {"prompt": "x", "json_schema": {"not": {}}}, "json_schema.not"),
        ("/completion", {"prompt": "x", "grammar": "root ::= ("}, "grammar"),
    ],
)
def test_every_protocol_names_the_refused_keyword(app, path, body, param):
    client, _, engine = app
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert err["code"] in ("json_schema_keyword_not_supported", "invalid_grammar")
    assert not engine.requests


@pytest.mark.parametrize(
    "body,code,param",
    [
        (
            {"response_format": {"type": "json_schema"}},
            "missing_required_parameter",
            "response_format.json_schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
            "invalid_value",
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
            "invalid_type",
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
            "invalid_type",
            "response_format.json_schema.strict",
        ),
        ({"response_format": {"type": "yaml"}}, "invalid_value", "response_format.type"),
        ({"response_format": {"type": "json_object"}, "stop": ["}"]}, "stop_not_supported", "stop"),
        (
            {"response_format": {"type": "json_object"}, "ignore_eos": True},
            "ignore_eos_not_supported",
            "ignore_eos",
        ),
        ({"guided_json": {"type": "object"}}, "unsupported_parameter", "guided_json"),
    ],
)
def test_malformed_chat_formats(app, body, code, param):
    client, _, engine = app
    r = client.post(CHAT, json={"messages": MSG, **body})
    assert (
        r.status_code == 400 and r.json()["error"]["code"] == code and r.json()["error"]["param"] == param
    ), r.text
    assert client.post(CHAT, json={"messages": MSG}).status_code == 200


def test_anthropic_refuses_a_prefill_and_stop_sequences_beside_a_format(app):
    client, _, _ = app
    fmt = {"output_config": {"format": {"type": "json_schema", "schema": OBJ}}}
    r = client.post(
        "/v1/messages",
        json={
            "model": "test-model",
            "max_tokens": 8,
            **fmt,
            "messages": [*MSG, {"role": "assistant", "content": "{"}],
        },
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = client.post(
        "/v1/messages",
        json={"model": "test-model", "max_tokens": 8, **fmt, "messages": MSG, "stop_sequences": ["}"]},
    )
    assert r.status_code == 400


@pytest.mark.parametrize(
    "path,body,code,param",
    [
        (
            CHAT,
            {"messages": MSG, "response_format": {"type": "json_object"}},
            "response_format_not_supported",
            "response_format",
        ),
        (
            "/v1/responses",
            {"model": "test-model", "input": "hi", "text": {"format": {"type": "json_object"}}},
            "response_format_not_supported",
            "text.format",
        ),
        (
            "/v1/messages",
            {
                "model": "test-model",
                "max_tokens": 8,
                "messages": MSG,
                "output_config": {"format": {"type": "json_schema", "schema": OBJ}},
            },
            "output_format_not_supported",
            "output_config.format",
        ),
        ("/completion", {"prompt": "x", "json_schema": OBJ}, "json_schema_not_supported", "json_schema"),
        ("/completion", {"prompt": "x", "grammar": 'root ::= "a"'}, "grammar_not_supported", "grammar"),
        (
            "/v1/completions",
            {"prompt": "x", "response_format": {"type": "json_object"}},
            "response_format_not_supported",
            "response_format",
        ),
    ],
)
def test_without_the_flag_formats_are_refused_or_run_unconstrained(make_app, path, body, code, param):
    client, _, engine = make_app()
    r = client.post(path, json=body)
    assert r.status_code == 400
    err = r.json().get("error") or {}
    assert err.get("code") == code and err.get("param") == param, r.text
    loose, _, loose_engine = make_app(unconstrained_response_format=True)
    assert loose.post(path, json=body).status_code == 200
    assert loose_engine.requests[-1].constraint is None


def test_the_format_instruction_and_thinking_default(app):
    client, ctx, engine = app
    r = client.post(CHAT, json=chat(OBJ))
    assert r.status_code == 200
    gen = engine.requests[-1]
    prompt = ctx.tokenizer.decode(gen.prompt_ids, skip_special=False)
    assert "raw JSON without Markdown code fences" in prompt and '"required": ["a"]' in prompt
    assert prompt.rstrip().endswith("</think>")  # thinking off unless the request asks for it
    r = client.post(CHAT, json={**chat(OBJ), "reasoning_effort": "high"})
    assert r.status_code == 200 and engine.requests[-1].in_reasoning
    plain = client.post(CHAT, json={"messages": MSG})
    assert "Markdown" not in ctx.tokenizer.decode(engine.requests[-1].prompt_ids) and plain.status_code == 200


def test_responses_echoes_the_format(app):
    client, _, _ = app
    fmt = {"type": "json_schema", "name": "w", "schema": OBJ, "strict": True}
    r = client.post("/v1/responses", json={"model": "test-model", "input": "hi", "text": {"format": fmt}})
    assert r.status_code == 200 and r.json()["text"]["format"] == fmt
