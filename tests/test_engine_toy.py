"""The toy runner itself: it must catch the bookkeeping mistakes the engine tests rely on it to catch."""

from __future__ import annotations

import pytest
import torch

from ninfer_core.engine.model_api import SeqView
from ninfer_core.testing import ScriptPolicy, ToyRunner, ToyTokenizer


def fresh(pages=8, slots=2) -> ToyRunner:
    r = ToyRunner()
    r.allocate_cache(pages, slots)
    return r


def test_chunked_prefill_and_decode_agree_with_one_prefill():
    prompt = list(range(1, 150))
    a = fresh()
    a.reset_slot(0)
    whole = a.prefill(SeqView(0, [3, 1, 5], 0), prompt)
    b = fresh()
    b.reset_slot(1)
    pages = [6, 0, 2]
    b.prefill(SeqView(1, pages, 0), prompt[:70])
    b.prefill(SeqView(1, pages, 70), prompt[70:148])
    last = b.decode([SeqView(1, pages, 148)], [prompt[148]])
    assert torch.equal(whole, last[0])
    every = fresh()
    every.reset_slot(0)
    rows = every.prefill(SeqView(0, [0, 1, 2], 0), prompt, all_logits=True)
    assert rows.shape == (149, 262) and torch.equal(rows[-1], whole)


def test_logits_depend_on_the_whole_prefix():
    r = fresh()
    r.reset_slot(0)
    r.reset_slot(1)
    x = r.prefill(SeqView(0, [0], 0), [1, 2, 3, 4])
    y = r.prefill(SeqView(1, [1], 0), [9, 2, 3, 4])
    assert not torch.equal(x, y)


def test_a_slot_that_was_not_reset_is_caught():
    r = fresh()
    with pytest.raises(RuntimeError, match="state slot"):
        r.prefill(SeqView(0, [0], 0), [1, 2])
    r.reset_slot(0)
    r.prefill(SeqView(0, [0], 0), [1, 2])
    with pytest.raises(RuntimeError, match="state slot"):  # reused without a reset
        r.prefill(SeqView(0, [1], 0), [1, 2])


def test_a_wrong_page_table_is_caught():
    r = fresh()
    r.reset_slot(0)
    r.prefill(SeqView(0, [4, 5], 0), list(range(100)))
    with pytest.raises(RuntimeError, match="page mapping"):
        r.decode([SeqView(0, [5, 4], 100)], [7])


def test_a_page_overwritten_by_another_sequence_is_caught():
    r = fresh()
    r.reset_slot(0)
    r.reset_slot(1)
    r.prefill(SeqView(0, [2], 0), [1, 2, 3])
    r.prefill(SeqView(1, [2], 0), [4, 5, 6])  # the engine handed page 2 out twice
    with pytest.raises(RuntimeError, match="corrupted"):
        r.decode([SeqView(0, [2], 3)], [7])


def test_pages_must_cover_the_positions():
    r = fresh()
    r.reset_slot(0)
    with pytest.raises(ValueError, match="needs 2 pages for 65 positions"):  # the contract's batch check
        r.prefill(SeqView(0, [0], 0), list(range(65)))


def test_decode_refuses_shared_slots_and_pages():
    r = fresh()
    r.reset_slot(0)
    r.reset_slot(1)
    r.prefill(SeqView(0, [0], 0), [1])
    r.prefill(SeqView(1, [1], 0), [1])
    with pytest.raises(ValueError, match="same state slot twice"):  # the contract's batch check
        r.decode([SeqView(0, [0], 1), SeqView(0, [1], 1)], [1, 1])
    with pytest.raises(RuntimeError, match="page"):
        r.decode([SeqView(0, [0], 1), SeqView(1, [0], 1)], [1, 1])


def test_script_policy_forces_tokens():
    tok = ToyTokenizer()
    prompt = tok.encode("Q:")
    r = ToyRunner(policy=ScriptPolicy({tuple(prompt): [10, 11]}, after=tok.EOS))
    r.allocate_cache(2, 1)
    r.reset_slot(0)
    assert int(r.prefill(SeqView(0, [0], 0), prompt).argmax()) == 10
    assert int(r.decode([SeqView(0, [0], 2)], [10])[0].argmax()) == 11
    assert int(r.decode([SeqView(0, [0], 3)], [11])[0].argmax()) == tok.EOS


def test_toy_tokenizer_round_trip():
    tok = ToyTokenizer()
    ids = tok.encode("hello world €<eos>")
    assert ids[:2] == [258, 259] and ids[-1] == tok.EOS and tok.EURO_HEAD in ids
    assert tok.decode(ids) == "hello world €"
    assert tok.decode(ids, skip_special=False) == "hello world €<eos>"
    assert tok.encode("<eos>", allow_special=False) == list(b"<eos>")
    assert tok.token_to_id("<eos>") == tok.EOS and tok.token_to_id("a") == ord("a")
    assert tok.is_special(tok.EOS) and not tok.is_special(258)
