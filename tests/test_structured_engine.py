"""The Engine with constrained requests on the toy runner: masks beside the forward, failures that
stay with their request, constrained and unconstrained requests in the same rounds, thinking first."""

from __future__ import annotations

import asyncio
import json
import random
import time

import jsonschema
import pytest
import torch

from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.spec import Proposal, SpecBackend
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


# -- speculative decoding: a constrained lane verifies drafts, one mask per draft position -------------


class _Replay(SpecBackend):
    """Drafts the next tokens of a recorded output (`outputs[prompt]`), each position replaced by
    another byte with probability `corrupt`: a drafter whose acceptance the test controls."""

    name = "replay"

    def __init__(self, outputs: dict, k: int = 3, corrupt: float = 0.0, seed: int = 0):
        self.outputs, self.k, self.corrupt = outputs, k, corrupt
        self.draft_tokens = k
        self.proposed = 0
        self._rng = random.Random(seed)

    def propose(self, lanes):
        out = []
        for lane in lanes:
            hist = list(lane.history)
            for prompt, ids in self.outputs.items():
                if tuple(hist[: len(prompt)]) == prompt:
                    done = len(hist) - len(prompt)
                    got = ids[done : done + min(self.k, lane.max_drafts)]
                    break
            else:
                got = []
            got = [self._rng.randrange(32, 127) if self._rng.random() < self.corrupt else t for t in got]
            self.proposed += len(got)
            out.append(Proposal(list(got)))
        return out


def spec_engine(runner, spec, **opts) -> Engine:
    eng = Engine(runner, TOK, EngineOptions(**{"max_context": 1024, "max_concurrency": 4, **opts}), spec=spec)
    _engines.append(eng)
    eng.start()
    return eng


def _shaped(i, sampling):
    return GenerationRequest(
        prompt_ids=TOK.encode(f"json {i}"), sampling=sampling, max_tokens=300, constraint=constraint()
    )


@pytest.mark.parametrize("corrupt", [0.0, 0.4])
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SAMPLED], ids=["greedy", "sampled"])
def test_constrained_lanes_verify_drafts_and_commit_what_plain_decoding_commits(sampling, corrupt):
    plain = run(engine(ToyRunner(), max_concurrency=4), *(_shaped(i, sampling) for i in range(3)))
    recorded = {tuple(TOK.encode(f"json {i}")): o.token_ids for i, o in enumerate(plain)}
    runner = ToyRunner()
    backend = _Replay(recorded, k=4, corrupt=corrupt)
    eng = spec_engine(runner, backend)
    outs = run(eng, *(_shaped(i, sampling) for i in range(3)))
    for a, b in zip(plain, outs):
        assert b.finish.finish_reason == "stop", b.events[-1]
        assert b.token_ids == a.token_ids  # the same masks, the same coupled picks, row for row
        jsonschema.validate(json.loads(b.text), SCHEMA)
    c = eng.snapshot()["counters"]
    assert c["draft_tokens"] > 0 and c["draft_accepted_tokens"] > 0
    widest = max(x[2] for x in runner.calls if x[0] == "verify")
    if corrupt == 0.0:  # the recorded output is exactly what the masked target picks
        assert c["draft_accepted_tokens"] >= 0.9 * c["draft_tokens"] - 3 * 4
        assert c["draft_tokens"] == backend.proposed and widest == 3 * 5  # 3 lanes, K + 1 rows each
    else:  # drafts the grammar refuses are cut before the forward; admitted wrong ones are rejected
        assert c["draft_tokens"] < backend.proposed and c["draft_accepted_tokens"] < c["draft_tokens"]
    snap = eng.snapshot()
    assert snap["lanes_active"] == 0 and snap["pages_free"] == snap["pages_total"]


def test_a_draft_the_grammar_refuses_is_never_verified_or_committed():
    # the drafts are the model's own unconstrained picks ("not json..."): the grammar refuses most
    # of them, so they are cut before the verify forward and the output is the plain masked one
    prompt = TOK.encode("json 0")
    script = list(b"not json at all, but a long ramble")
    plain = run(engine(ToyRunner(policy=ScriptPolicy({tuple(prompt): script}))), _shaped(0, SAMPLED))
    runner = ToyRunner(policy=ScriptPolicy({tuple(prompt): script}))
    backend = _Replay({tuple(prompt): script}, k=3)
    eng = spec_engine(runner, backend)
    (out,) = run(eng, _shaped(0, SAMPLED))
    assert out.token_ids == plain[0].token_ids
    jsonschema.validate(json.loads(out.text), SCHEMA)
    c = eng.snapshot()["counters"]
    assert backend.proposed > 0 and c["draft_tokens"] < backend.proposed


class _Costly(Constraint):
    def fill_next_mask(self, bitmask=None, index=0):
        time.sleep(0.006)  # over the 4 ms a constrained lane may spend per mask and still draft
        return super().fill_next_mask(bitmask, index)


def test_a_constrained_lane_with_costly_masks_decodes_without_drafts():
    plain = run(engine(ToyRunner()), _shaped(0, SAMPLED))
    recorded = {tuple(TOK.encode("json 0")): plain[0].token_ids}
    runner = ToyRunner()
    eng = spec_engine(runner, _Replay(recorded, k=3))
    slow = GenerationRequest(prompt_ids=TOK.encode("json 0"), sampling=SAMPLED, max_tokens=300,
                             constraint=_like(_Costly, constraint()))
    (out,) = run(eng, slow)
    assert out.token_ids == plain[0].token_ids
    c = eng.snapshot()["counters"]
    # the first round drafts (no mask measured yet); after that the lane's masks cost > 4 ms
    assert c["draft_tokens"] <= 3
    assert not any(x[0] == "verify" for x in runner.calls[3:])


def test_mask_rows_follow_the_tentative_drafts_and_roll_back():
    from ninfer_core.structured.masks import MaskStage

    stage = MaskStage()
    c = constraint()
    seq = type("S", (), {"request": type("R", (), {"constraint": c})()})()
    drafts = list(b'{"na')
    assert stage.admitted(seq, drafts) == len(drafts)
    stage.prefetch_rows(seq, drafts)  # rows 1..4 on a host thread, as while a forward runs
    logits = torch.zeros(len(drafts) + 1, 262)
    n, err = stage.apply_rows(logits, seq, drafts)
    assert err is None and n == len(drafts) + 1
    assert logits[0, ord("{")] == 0 and logits[0, ord("a")] == float("-inf")  # row 0: a '{' opens
    assert logits[2, ord("n")] == 0 and logits[2, ord("x")] == float("-inf")  # after '{"': the key
    assert logits[4, ord("m")] == 0 and logits[4, ord("e")] == float("-inf")  # after '{"na': "name"
    # rolled back: the grammar is where it was, so the first token is still '{' and nothing else
    assert not c.accept(ord("a")) and c.accept(ord("{"))
    c.rollback(1)
    assert stage.admitted(seq, list(b'{"zz')) == 2  # 'z' starts no key: the drafts are cut there
    assert stage.admitted(seq, list(b'x{')) == 0
    stage.shutdown()
