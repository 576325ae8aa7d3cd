"""Structured output below the HTTP layer: the per-request Constraint over real xgrammar masks.

Random walks through the masks of every corpus schema (tests/structured_corpus.py) must end in
documents the `jsonschema` package accepts, on the Qwen3.5 tokenizer (248k tokens) and on
ninfer-tiny's; the checks beside the grammar (lengths counted in decoded scalars, uniqueItems,
escaped aliases, lone surrogates), the thinking phases, rollback and the tool-call branches are
tested on their own.
"""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from qwen_format import QWEN35_CHAT_FORMAT, with_format
from structured_corpus import CORPUS, STRICT

from ninfer_core.engine.api import EngineError
from ninfer_core.structured.compiler import StructuredOutput
from ninfer_core.structured.formats import ResponseFormat


@pytest.fixture(scope="module")
def qwen():
    from qwen_format import qwen35_tokenizer_section, with_format

    from ninfer_core.tokenizer import Tokenizer

    tok = with_format(Tokenizer.from_section(qwen35_tokenizer_section()))
    so = StructuredOutput(tok, 248320)
    so.warm()
    return tok, so


@pytest.fixture(scope="module")
def tiny():
    plugin = pytest.importorskip("ninfer_tiny.plugin")
    from ninfer_core.artifact import Artifact
    from ninfer_core.tokenizer import Tokenizer

    path = plugin.packaged_artifact()
    if path is None:
        pytest.skip("ninfer-tiny ships no artifact here")
    art = Artifact.open(path)
    tok = with_format(Tokenizer.from_section(art.tokenizer_section))
    return tok, StructuredOutput(tok, int(art.config.get("vocab_size", 8448)))


def fmt(schema, strict=False) -> ResponseFormat:
    return ResponseFormat(
        "json_schema",
        "response_format",
        schema,
        strict=strict,
        schema_param="response_format.json_schema.schema",
    )


def allowed(c) -> np.ndarray:
    bits = np.unpackbits(c.bitmask[0].numpy().view(np.uint8), bitorder="little")[: c.vocab.size]
    return np.flatnonzero(bits)


_CLOSING: dict[int, np.ndarray] = {}


def walk(so, tok, c, rng: random.Random, steps: int = 200) -> tuple[str, bool]:
    """Sample uniformly among admitted tokens (often one that closes something) until EOS."""
    closing = _CLOSING.get(id(so))
    if closing is None:
        closing = _CLOSING[id(so)] = np.array([any(ch in b for ch in b'"]},') for b in so.vocab.token_bytes])
    eos = np.asarray(tok.eos_token_ids)
    out = []
    for _ in range(steps):
        assert c.fill_next_mask()
        bits = np.unpackbits(c.bitmask[0].numpy().view(np.uint8), bitorder="little")[: c.vocab.size].astype(
            bool
        )
        assert bits.any(), f"no token admitted after {tok.decode(out)!r}"
        ends = eos[bits[eos]]
        near = np.flatnonzero(bits & closing)
        if len(ends) and rng.random() < 0.5:
            t = int(ends[0])
        elif len(near) and rng.random() < 0.6:
            t = int(near[rng.randrange(len(near))])
        else:
            ids = np.flatnonzero(bits)
            t = int(ids[rng.randrange(len(ids))])
        assert c.accept(t)
        if t in tok.eos_token_ids:
            return tok.decode(out), True
        out.append(t)
    return tok.decode(out), False


def validate(text: str, schema) -> None:
    value = json.loads(text)
    jsonschema.validate(
        value,
        schema,
        cls=jsonschema.Draft202012Validator,
        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER,
    )


@pytest.mark.parametrize("which", ["qwen", "tiny"])
def test_random_walks_through_the_masks_give_valid_documents(which, request):
    tok, so = request.getfixturevalue(which)
    seeds = 1 if which == "qwen" else 2
    finished = 0
    for k, schema in enumerate(CORPUS):
        compiled = so.compile(fmt(schema, strict=k in STRICT))
        for seed in range(seeds):
            text, done = walk(so, tok, so.constraint(compiled), random.Random(f"{which}:{k}:{seed}"))
            if done:
                finished += 1
                try:
                    validate(text, schema)
                except Exception as e:  # noqa: BLE001 - name the schema and the document
                    raise AssertionError(f"schema {k} {json.dumps(schema)[:200]}\n-> {text!r}: {e}") from None
    assert finished >= 0.75 * seeds * len(CORPUS), finished  # the others rambled past 200 tokens


def test_length_bounds_count_decoded_scalars_whatever_the_escape(qwen):
    tok, so = qwen
    compiled = so.compile(fmt({"type": "string", "minLength": 2, "maxLength": 2}))
    for spelling, ok in (
        ('"\\n\\u00e9"', True),
        ('"\\ud83d\\ude00x"', True),
        ('"ab"', True),
        ('"a"', False),
        ('"abc"', False),
        ('"\\"\\\\"', True),
    ):
        c = so.constraint(compiled)
        accepted = all(c.accept(t) for t in tok.encode(spelling))
        assert (
            accepted and c.matcher.accept_token(tok.eos_token_ids[0])
            if ok
            else not (accepted and c.matcher.is_completed())
        ), spelling


def test_masks_never_admit_a_lone_surrogate(qwen):
    tok, so = qwen
    c = so.constraint(so.compile(fmt({"type": "string"})))
    for t in tok.encode('"\\ud83d'):
        assert c.accept(t)
    c.fill_next_mask()
    for i in allowed(c):  # after a high surrogate only the backslash of its pair can follow
        assert so.vocab.token_bytes[int(i)].startswith(b"\\"), so.vocab.token_bytes[int(i)]
    low = so.constraint(so.compile(fmt({"type": "string"})))
    assert all(low.accept(t) for t in tok.encode('"a'))
    assert not all(low.accept(t) for t in tok.encode("\\udc00"))


def test_unique_items_refuses_a_repeat_in_any_spelling(qwen):
    tok, so = qwen
    schema = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    c = so.constraint(so.compile(fmt(schema)))
    for t in tok.encode('["ab","x",'):
        assert c.accept(t)
    assert not all(c.accept(t) for t in tok.encode('"a\\u0062"'))  # "ab" again, escaped


def test_a_finite_unique_domain_cannot_repeat_or_continue_after_exhaustion(qwen):
    tok, so = qwen
    c = so.constraint(so.compile(fmt({"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True})))
    for t in tok.encode('["a",'):
        assert c.accept(t)
    c.fill_next_mask()
    texts = {so.vocab.token_bytes[int(i)] for i in allowed(c)}
    assert not any(b'"a"' in t for t in texts) and any(t.startswith(b'"b') or t == b'"' for t in texts)
    for t in tok.encode('"b"'):
        assert c.accept(t)
    c.fill_next_mask()
    assert not any(so.vocab.token_bytes[int(i)].lstrip().startswith(b",") for i in allowed(c))


def test_an_additional_key_cannot_alias_a_declared_property(qwen):
    tok, so = qwen
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "additionalProperties": {"type": "integer"},
    }
    c = so.constraint(so.compile(fmt(schema)))
    for t in tok.encode('{"name":"x",'):
        assert c.accept(t)
    assert not all(c.accept(t) for t in tok.encode('"na\\u006de":1}'))


def test_strict_admits_only_declared_properties(qwen):
    tok, so = qwen
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    open_ = so.constraint(so.compile(fmt(schema, strict=False)))
    closed = so.constraint(so.compile(fmt(schema, strict=True)))
    text = '{"a":1,"b":2}'
    assert all(open_.accept(t) for t in tok.encode(text))
    assert not all(closed.accept(t) for t in tok.encode(text))


def test_whitespace_runs_are_bounded_to_eight(qwen):
    tok, so = qwen
    c = so.constraint(so.compile(fmt({"type": "object"})))
    assert c.accept(tok.encode("{")[0])
    assert all(c.accept(tok.encode(" ")[0]) for _ in range(8))
    assert not c.accept(tok.encode(" ")[0])


def test_properties_come_in_declaration_order(qwen):
    tok, so = qwen
    schema = {
        "type": "object",
        "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    c = so.constraint(so.compile(fmt(schema)))
    assert not all(c.accept(t) for t in tok.encode('{"a":1,"b":2}'))


def test_thinking_first_then_the_format_newlines_then_the_grammar(qwen):
    tok, so = qwen
    close = tok.token_to_id("</think>")
    c = so.constraint(so.compile(fmt({"type": "object"})), in_reasoning=True, think_end_ids=[close])
    assert not c.needs_mask() and not c.fill_next_mask()
    for t in tok.encode("Let me think about {braces"):
        assert c.accept(t)  # reasoning is free text
    assert c.accept(close) and c.needs_mask()
    c.fill_next_mask()
    assert {so.vocab.token_bytes[int(i)] for i in allowed(c)} <= {b"\n", b"\n\n"}
    assert not c.accept(tok.encode("{")[0])
    assert c.accept(tok.encode("\n\n")[0])
    assert all(c.accept(t) for t in tok.encode('{"a":1}'))
    assert c.accept(tok.eos_token_ids[0]) and c.is_terminated()


def test_rollback_undoes_tentative_drafts(qwen):
    tok, so = qwen
    c = so.constraint(so.compile(fmt({"type": "array", "items": {"type": "string"}, "uniqueItems": True})))
    for t in tok.encode('["x",'):
        assert c.accept(t)
    c.fill_next_mask()
    before = c.bitmask.clone()
    drafts = tok.encode('"y","z"')
    for t in drafts:  # a verify round accepts drafts to fill the masks after them, then rolls back
        assert c.accept(t)
    c.rollback(len(drafts))
    c.fill_next_mask()
    assert bool((c.bitmask == before).all())
    assert not all(c.accept(t) for t in tok.encode('"x"'))  # the tracker came back too


def test_a_json_format_beside_tools_admits_the_json_or_declared_calls(qwen):
    tok, so = qwen
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                },
            },
        }
    ]
    compiled = so.compile(
        fmt({"type": "object", "properties": {"t": {"type": "integer"}}, "required": ["t"]}), tools=tools
    )
    call = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    )
    for text, ok in (
        (call, True),
        ('{"t": 3}', True),
        (call.replace("get_weather", "get_time"), False),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=days>\n1\n</parameter>\n<parameter=city>\nX\n"
            "</parameter>\n</function>\n</tool_call>",
            False,
        ),
    ):  # declaration order
        c = so.constraint(compiled)
        ids = tok.encode(text)
        accepted = all(c.accept(t) for t in ids)
        assert (accepted and c.accept(tok.eos_token_ids[0])) == ok, text


def test_a_forced_call_follows_the_parameter_schema(qwen):
    from ninfer_core.server.output import OutputDecoder

    tok, so = qwen
    params = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 8},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"enum": ["C", "F"]},
            "note": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}], "default": None},
            "hours": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 23},
                "maxItems": 3,
            },
        },
        "required": ["city", "days"],
    }
    compiled = so.compile(None, forced_parameters=params)
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    done = 0
    for seed in range(6):
        text, finished = walk(so, tok, so.constraint(compiled), random.Random(seed), steps=200)
        if not finished:
            continue
        done += 1
        dec = OutputDecoder(in_reasoning=False, tools=tools, forced_call="<tool_call>\n<function=f>\n",
                            chat_format=QWEN35_CHAT_FORMAT)
        dec.feed(text)
        dec.finish()
        assert [c.name for c in dec.tool_calls] == ["f"], text
        jsonschema.validate(json.loads(dec.tool_calls[0].arguments), params)
    assert done >= 4


def test_a_forced_parameter_the_parser_would_read_as_text_must_admit_a_string(qwen):
    _, so = qwen
    with pytest.raises(EngineError) as e:
        so.compile(
            None,
            forced_parameters={"type": "object", "properties": {"n": {"enum": [1, 2]}}},
            forced_param="tools.0.function.parameters",
        )
    assert (e.value.status, e.value.code, e.value.param) == (
        400,
        "json_schema_keyword_not_supported",
        "tools.0.function.parameters.properties.n",
    )


def test_schema_errors_name_the_field_and_keyword(qwen):
    _, so = qwen
    with pytest.raises(EngineError) as e:
        so.compile(fmt({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}}))
    assert (e.value.status, e.value.code, e.value.param) == (
        400,
        "json_schema_keyword_not_supported",
        "response_format.json_schema.schema.properties.n.multipleOf",
    )


def test_a_gbnf_grammar_constrains_raw_output(qwen):
    tok, so = qwen
    compiled = so.compile(ResponseFormat("grammar", "grammar", grammar='root ::= "yes" | "no"'))
    c = so.constraint(compiled)
    assert all(c.accept(t) for t in tok.encode("no")) and c.accept(tok.eos_token_ids[0])
    with pytest.raises(EngineError) as e:
        so.compile(ResponseFormat("grammar", "grammar", grammar="root ::= ("))
    assert (e.value.code, e.value.param) == ("invalid_grammar", "grammar")
