"""The engine side of the serving rules, without a server: preserve_thinking turn closures read from
real Qwen tokens, cache_prompt opt-out, Responses replay checkpoints keyed by session and the
store:false rule (toy runner: the logits read every prefix back out of the pages and state).
"""

from __future__ import annotations

import pytest

from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.cache import derive_hints
from ninfer_core.engine.checkpoints import CheckpointHints
from ninfer_core.engine.engine import Engine
from ninfer_core.testing import ToyRunner, ToyTokenizer, collect, run_async

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture
def qwen():
    from qwen_format import qwen35_tokenizer_section, with_format

    from ninfer_core.tokenizer import Tokenizer

    return with_format(Tokenizer.from_section(qwen35_tokenizer_section()))


def _render(tok, messages, preserve=None):
    from qwen_format import QWEN35_TEMPLATE

    from ninfer_core.tokenizer.chat_template import ChatTemplate, render_ids

    kw = {} if preserve is None else {"preserve_thinking": preserve}
    return render_ids(tok, messages, template=ChatTemplate(QWEN35_TEMPLATE), **kw)


def test_turn_closure_follows_preserve_thinking(qwen):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "reasoning_content": "r",
             "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]},
            {"role": "tool", "content": "out"}]
    ids = _render(qwen, msgs)
    im = qwen.token_to_id("<|im_start|>")
    starts = [i for i, t in enumerate(ids) if t == im]  # system, user, assistant, tool, opener
    assert len(starts) == 5
    off = derive_hints(qwen, ids, False)
    assert off.turn_closure == starts[2] and off.rolling_closure == starts[4]
    assert derive_hints(qwen, ids, None).turn_closure == starts[2]  # unknown: the template default
    on = derive_hints(qwen, ids, True)
    assert on.turn_closure == starts[4] and on.rolling_closure is None
    # No tool loop in the open turn: both values give the current opener.
    plain = _render(qwen, msgs[:2])
    assert derive_hints(qwen, plain, False).turn_closure == derive_hints(qwen, plain, True).turn_closure
    assert derive_hints(qwen, plain, False).rolling_closure is None


@pytest.fixture
def eng():
    e = Engine(ToyRunner(), ToyTokenizer(), EngineOptions(max_context=2048, prefill_chunk=64, prefix_reuse=True,
                                                            max_private_continuations=4))
    e.start()
    yield e
    e.shutdown(timeout=30)


def run(eng, prompt, **kw):
    hints = kw.pop("hints", None) or CheckpointHints()

    async def go():
        return await collect(eng.submit(GenerationRequest(prompt_ids=list(prompt), sampling=GREEDY, max_tokens=6,
                                                          checkpoint_hints=hints, **kw)))

    out = run_async(go())
    assert out.finish is not None, out.events
    return out


def retained(eng) -> int:
    return eng.snapshot()["context_cache"]["private_continuations"]


def test_cache_prompt_false_is_root_and_retains_nothing(eng):
    prompt = list(range(1, 200))
    first = run(eng, prompt, hints=CheckpointHints(turn_closure=198))
    assert retained(eng) == 1
    off = run(eng, prompt, hints=CheckpointHints(turn_closure=198), cache_prompt=False)
    assert off.finish.usage.cached_tokens == 0 and off.finish.context["source"] == "root"
    assert off.token_ids == first.token_ids and retained(eng) == 1
    assert run(eng, prompt).finish.usage.cached_tokens == 198


def test_replay_checkpoint_serves_its_session_only(eng):
    history = list(range(1, 150))
    a = history + [200, 201]  # the new input of one child
    b = history + [210, 211]  # a sibling's
    run(eng, a, hints=CheckpointHints(replay=149), session_id="resp:1")
    other = run(eng, b, session_id="resp:2")
    assert other.finish.context["source"] == "root"
    mine = run(eng, b, session_id="resp:1")
    assert mine.finish.context["source"] == "private_response_replay" and mine.finish.usage.cached_tokens == 149
    assert mine.token_ids == other.token_ids
    rows = eng.snapshot()["context_cache"]
    assert rows["selections"]["private_response_replay"] == 1


def test_store_false_child_publishes_beside_the_chain(eng):
    p = list(range(1, 120))
    one = run(eng, p, session_id="resp:9")
    child = p + one.token_ids + [7, 8]
    out = run(eng, child, session_id="resp:9", session_store=False)
    assert out.finish.context["source"] == "private_endpoint"
    assert retained(eng) == 2  # the chain's endpoint stays
    again = run(eng, child + out.token_ids + [9], session_id="resp:9")
    assert again.finish.context["source"] == "private_endpoint"
    assert retained(eng) == 2  # a stored child replaces the endpoint it extended
