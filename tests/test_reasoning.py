"""ReasoningSplitter: streaming <think>/</think> split, checked at every chunking."""

import itertools

import pytest

from ninfer_core.tokenizer.reasoning import ReasoningSplitter


def merged(events):
    out = []
    for kind, text in events:
        assert text, "no empty pieces"
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out


def run(chunks, in_reasoning):
    splitter = ReasoningSplitter(in_reasoning, "<think>", "</think>")
    events = []
    for chunk in chunks:
        events += splitter.feed(chunk)
    events += splitter.finish()
    return merged(events)


CASES = [
    # (output, in_reasoning, expected)
    ("Let me think.\n</think>\n\nThe answer is 4.", True,
     [("reasoning", "Let me think.\n"), ("content", "The answer is 4.")]),
    ("\nLeading newline dropped.</think>\n\nok", True,
     [("reasoning", "Leading newline dropped."), ("content", "ok")]),
    ("\n\ntwo newlines: one kept</think>\nsingle", True,
     [("reasoning", "\ntwo newlines: one kept"), ("content", "single")]),
    ("r</think>\n\n\nthree", True, [("reasoning", "r"), ("content", "\nthree")]),
    ("quoted </think>, not closed; real close</think>\n\nanswer", True,
     [("reasoning", "quoted </think>, not closed; real close"), ("content", "answer")]),
    ("escaped </think>\\n stays</think> spaced", True,
     [("reasoning", "escaped </think>\\n stays"), ("content", " spaced")]),
    ("ends in reasoning with a partial </thi", True,
     [("reasoning", "ends in reasoning with a partial </thi")]),
    ("closed at the very end</think>", True, [("reasoning", "closed at the very end")]),
    ("closed then one newline</think>\n", True, [("reasoning", "closed then one newline")]),
    ("after close <think> and </think>\n are content</think>\n\nx <think>y</think>\n", True,
     [("reasoning", "after close <think> and "),
      ("content", " are content</think>\n\nx <think>y</think>\n")]),
    ("<think>\nopened by output</think>\n\nanswer", False,
     [("reasoning", "opened by output"), ("content", "answer")]),
    ("<think>\n\n</think>\n\nthinking off echo", False,
     [("reasoning", "\n"), ("content", "thinking off echo")]),
    ("plain answer with <think> later", False, [("content", "plain answer with <think> later")]),
    (" <think>not at start</think>\n", False, [("content", " <think>not at start</think>\n")]),
    ("<thin", False, [("content", "<thin")]),
    ("<think>", False, []),
    ("", True, []),
    ("", False, []),
    ("\n", True, []),
    ("no close at all, multi\nline\n", True, [("reasoning", "no close at all, multi\nline\n")]),
    ("</think>\n\nimmediately closed", True, [("content", "immediately closed")]),
    ("a</think>\tb", True, [("reasoning", "a"), ("content", "\tb")]),
    ("a</think></think>\nb", True, [("reasoning", "a</think>"), ("content", "b")]),
    ("a<</think>\n\n<</think>", True, [("reasoning", "a<"), ("content", "<</think>")]),
]


@pytest.mark.parametrize("output,in_reasoning,expected", CASES)
def test_whole_output(output, in_reasoning, expected):
    assert run([output], in_reasoning) == expected


@pytest.mark.parametrize("output,in_reasoning,expected", CASES)
def test_every_single_split_point(output, in_reasoning, expected):
    for i in range(len(output) + 1):
        assert run([output[:i], output[i:]], in_reasoning) == expected, i


@pytest.mark.parametrize("output,in_reasoning,expected", CASES)
def test_character_by_character(output, in_reasoning, expected):
    assert run(list(output), in_reasoning) == expected


@pytest.mark.parametrize("output,in_reasoning,expected", [c for c in CASES if len(c[0]) <= 40])
def test_every_two_split_points(output, in_reasoning, expected):
    for i, j in itertools.combinations(range(len(output) + 1), 2):
        assert run([output[:i], output[i:j], output[j:]], in_reasoning) == expected, (i, j)


def test_holds_back_only_a_possible_marker():
    s = ReasoningSplitter(True, "<think>", "</think>")
    assert s.feed("abc") == [("reasoning", "abc")]
    assert s.feed(" </th") == [("reasoning", " ")]
    assert s.feed("ought") == [("reasoning", "</thought")]
    assert s.feed("</think>") == []
    assert s.in_reasoning
    assert s.feed("\n") == []
    assert not s.in_reasoning
    assert s.feed("\nHi") == [("content", "Hi")]
    assert s.feed(" <") == [("content", " <")]
    assert s.finish() == []


def test_content_mode_streams_immediately():
    s = ReasoningSplitter(False, "<think>", "</think>")
    assert s.feed("<th") == []
    assert s.feed("ank") == [("content", "<thank")]
    assert s.feed("</think>") == [("content", "</think>")]
