"""The Engine with constrained requests on the toy runner: masks beside the forward, failures that
stay with their request, constrained and unconstrained requests in the same rounds, thinking first."""

from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import pytest

from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.structured.compiler import StructuredOutput
from ninfer_core.structured.constraint import Constraint
from ninfer_core.structured.formats import ResponseFormat
from ninfer_core.testing import ScriptPolicy, ToyRunner, ToyTokenizer, collect, run_async

TOK = ToyTokenizer()
SO = StructuredOutput(TOK, 262)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "uniqueItems": True},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}
SAMPLED = SamplingParams(temperature=1.0, top_k=20, seed=7)
_engines: list[Engine] = []


@pytest.fixture(autouse=True)
def _shutdown():
    yield
    while _engines:
        _engines.pop().shutdown(timeout=30)


def engine(runner=None, **opts) -> Engine:
    eng = Engine(runner or ToyRunner(), TOK, EngineOptions(**{"max_context": 1024, **opts}))
    _engines.append(eng)
    eng.start()
    return eng


def constraint(schema=SCHEMA, **kw) -> Constraint:
    return SO.constraint(
        SO.compile(ResponseFormat("json_schema", "response_format", schema, strict=True)), **kw
    )


def run(eng, *requests):
    async def go():
        return await asyncio.gather(*(collect(eng.submit(r)) for r in requests))

    return run_async(go(), timeout=120)


def test_sampled_outputs_follow_the_schema_beside_unconstrained_requests_in_the_same_rounds():
    runner = ToyRunner()
    eng = engine(runner, max_concurrency=4)
    plain = [
        GenerationRequest(
            prompt_ids=TOK.encode(f"free {i}"),
            sampling=SamplingParams(temperature=0.0),
            max_tokens=40,
            ignore_eos=True,
        )
        for i in range(2)
    ]
    alone = [o.token_ids for o in run(eng, *plain)]
    shaped = [
        GenerationRequest(
            prompt_ids=TOK.encode(f"json {i}"),
            sampling=SamplingParams(temperature=1.0, seed=i),
            max_tokens=300,
            constraint=constraint(),
        )
        for i in range(2)
    ]
    mixed = [
        GenerationRequest(
            prompt_ids=TOK.encode(f"free {i}"),
            sampling=SamplingParams(temperature=0.0),
            max_tokens=40,
            ignore_eos=True,
        )
        for i in range(2)
    ]
    runner.calls.clear()
    outs = run(eng, *(shaped + mixed))
    for o in outs[:2]:
        assert o.finish is not None and o.finish.finish_reason == "stop", o.events[-1]
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert [o.token_ids for o in outs[2:]] == alone  # the masks never touch an unconstrained row
    widths = [len(c[1]) for c in runner.calls if c[0] == "decode"]
    assert max(widths) == 4  # constrained and unconstrained rows decoded together


class _Broken(Constraint):
    """A grammar whose mask admits everything: what a mask bug would let through."""

    def fill_next_mask(self, bitmask=None, index=0):
        return False


class _Slow(Constraint):
    def fill_next_mask(self, bitmask=None, index=0):
        time.sleep(0.6)
        return super().fill_next_mask(bitmask, index)


def _like(cls, base: Constraint):
    base.__class__ = cls
    return base


def test_a_token_the_grammar_refuses_fails_only_its_request_with_500():
    prompt = TOK.encode("bad")
    runner = ToyRunner(policy=ScriptPolicy({tuple(prompt): list(b"not json")}))
    eng = engine(runner, max_concurrency=2)
    bad = GenerationRequest(
        prompt_ids=prompt,
        sampling=SamplingParams(temperature=0.0),
        max_tokens=20,
        constraint=_like(_Broken, constraint()),
    )
    good = GenerationRequest(
        prompt_ids=TOK.encode("good"), sampling=SAMPLED, max_tokens=300, constraint=constraint()
    )
    out_bad, out_good = run(eng, bad, good)
    assert out_bad.error is not None and (out_bad.error.status, out_bad.error.code) == (
        500,
        "grammar_violation",
    )
    assert out_good.finish.finish_reason == "stop"
    jsonschema.validate(json.loads(out_good.text), SCHEMA)
    snap = eng.snapshot()
    assert snap["lanes_active"] == 0 and snap["pages_free"] == snap["pages_total"]
    assert snap["counters"]["requests_failed"] == 1


def test_a_mask_over_the_timeout_fails_only_its_request():
    eng = engine(max_concurrency=2)
    eng._masks.timeout_s = 0.3  # the 5 s bound, shortened for the test
    slow = GenerationRequest(
        prompt_ids=TOK.encode("slow"), sampling=SAMPLED, max_tokens=50, constraint=_like(_Slow, constraint())
    )
    free = GenerationRequest(
        prompt_ids=TOK.encode("free"),
        sampling=SamplingParams(temperature=0.0),
        max_tokens=30,
        ignore_eos=True,
    )
    out_slow, out_free = run(eng, slow, free)
    assert out_slow.error is not None and (out_slow.error.status, out_slow.error.code) == (
        500,
        "grammar_mask_timeout",
    )
    assert out_free.finish.finish_reason == "length" and len(out_free.token_ids) == 30


def test_thinking_first_then_constrained_content():
    close = TOK.TOOL  # the toy vocabulary's stand-in for </think>
    prompt = TOK.encode("think")
    reasoning = list(b"{not json") + [close] + [10, 10]
    runner = ToyRunner(policy=ScriptPolicy({tuple(prompt): reasoning}))
    eng = engine(runner)
    r = GenerationRequest(
        prompt_ids=prompt,
        sampling=SamplingParams(temperature=0.0),
        max_tokens=300,
        in_reasoning=True,
        think_end_ids=[close],
        constraint=constraint(in_reasoning=True, think_end_ids=[close]),
    )
    (out,) = run(eng, r)
    assert out.finish.finish_reason == "stop", out.events[-1]
    ids = out.token_ids
    assert ids[: len(reasoning) - 1] == reasoning[:-1]  # reasoning and the close were not masked
    body = TOK.decode(ids[ids.index(close) + 1 :])
    jsonschema.validate(json.loads(body), SCHEMA)
