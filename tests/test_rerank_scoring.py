"""Engine scoring (GenerationRequest.score_token_ids), the path rerank judges documents with."""

from __future__ import annotations

import functools

import pytest
import torch

from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.model_api import SeqView
from ninfer_core.testing import ToyRunner, ToyTokenizer, collect, run_async

TOK = ToyTokenizer()
PROMPT = TOK.encode("is a panda a bear? answer:")
IDS = [ord("y"), ord("n"), TOK.EOS, 258]

_engines: list[Engine] = []


@pytest.fixture(autouse=True)
def _shutdown_engines():
    yield
    while _engines:
        _engines.pop().shutdown(timeout=30)


def make_engine(runner=None, **opts) -> Engine:
    eng = Engine(runner or ToyRunner(), TOK, EngineOptions(**{"max_context": 512, **opts}))
    _engines.append(eng)
    eng.start()
    return eng


def async_test(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return run_async(fn(*args, **kwargs))

    return wrapper


def reference_scores(prompt: list[int], ids: list[int]) -> list[float]:
    """The log-softmax of the toy model's logits after `prompt`, computed outside the engine."""
    r = ToyRunner()
    r.allocate_cache(8, 1)
    r.reset_slot(0)
    logits = r.prefill(SeqView(0, list(range(8)), 0), prompt)
    return torch.log_softmax(logits.float(), -1)[ids].tolist()


def assert_idle(eng: Engine) -> None:
    snap = eng.snapshot()
    assert snap["lanes_active"] == 0 and snap["pending"] == 0 and snap["outstanding"] == 0, snap
    assert snap["pages_free"] == snap["pages_total"] and snap["slots_free"] == snap["slots_total"], snap


@async_test
async def test_scores_are_the_log_softmax_at_the_first_output_position():
    eng = make_engine()
    out = await collect(eng.submit(GenerationRequest(PROMPT, max_tokens=0, score_token_ids=IDS)))
    assert out.kinds == ["admitted", "finish"]  # nothing generated
    fin = out.finish
    assert fin.finish_reason == "length" and fin.usage.completion_tokens == 0
    assert fin.scores == pytest.approx(reference_scores(PROMPT, IDS), abs=1e-6)
    assert all(s < 0 for s in fin.scores)
    assert_idle(eng)


@async_test
async def test_chunked_prefill_scores_the_same_position():
    eng = make_engine(prefill_chunk=4)
    fin = (await collect(eng.submit(GenerationRequest(PROMPT, max_tokens=0, score_token_ids=IDS)))).finish
    assert fin.scores == pytest.approx(reference_scores(PROMPT, IDS), abs=1e-6)
    assert_idle(eng)


@async_test
async def test_scoring_does_not_change_sampling_and_is_absent_unless_asked():
    eng = make_engine()
    sampling = SamplingParams(temperature=1.0, seed=1234)
    plain = await collect(eng.submit(GenerationRequest(PROMPT, sampling=sampling, max_tokens=6,
                                                       ignore_eos=True)))
    scored = await collect(eng.submit(GenerationRequest(PROMPT, sampling=sampling, max_tokens=6,
                                                        ignore_eos=True, score_token_ids=IDS)))
    assert plain.token_ids == scored.token_ids and len(plain.token_ids) == 6
    assert plain.finish.scores is None
    # the scores describe the first output position (the prompt's end), not a later one
    assert scored.finish.scores == pytest.approx(reference_scores(PROMPT, IDS), abs=1e-6)
    assert_idle(eng)


@async_test
async def test_scores_differ_between_prompts_and_batch_mates_do_not_interfere():
    eng = make_engine(max_concurrency=3)
    prompts = [PROMPT, TOK.encode("another question"), TOK.encode("x")]
    handles = [eng.submit(GenerationRequest(p, max_tokens=0, score_token_ids=IDS)) for p in prompts]
    outs = [await collect(h) for h in handles]
    for p, o in zip(prompts, outs):
        assert o.finish.scores == pytest.approx(reference_scores(p, IDS), abs=1e-6)
    assert outs[0].finish.scores != outs[1].finish.scores
    assert_idle(eng)


@async_test
async def test_an_out_of_vocabulary_score_id_fails_only_that_request():
    eng = make_engine()
    bad = await collect(eng.submit(GenerationRequest(PROMPT, max_tokens=0, score_token_ids=[10**6])))
    assert bad.kinds[-1] == "error" and bad.error.status == 500
    good = await collect(eng.submit(GenerationRequest(PROMPT, max_tokens=0, score_token_ids=IDS)))
    assert good.finish.scores is not None
    assert_idle(eng)
