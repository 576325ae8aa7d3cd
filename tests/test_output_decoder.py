"""OutputDecoder: streamed events equal the one-shot result at every chunking; hold-back rules."""

import json

import pytest
from qwen_format import QWEN35_CHAT_FORMAT

from ninfer_core.server.output import OutputDecoder, OutputEvent
from ninfer_core.tokenizer.toolcalls import MALFORMED_TOOL

TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
    "cmd": {"type": "string"}, "n": {"type": "integer"}}}}}]
CALL = "<tool_call>\n<function=run>\n<parameter=cmd>\nls\n</parameter>\n<parameter=n>\n2\n</parameter>\n" \
       "</function>\n</tool_call>"

# (output, in_reasoning, tools?, expected reasoning, expected content, expected calls [(name, args)])
CORPUS = [
    ("plain answer", False, True, "", "plain answer", []),
    ("thinking\n</think>\n\nanswer", True, True, "thinking\n", "answer", []),
    ("<think>\nr</think>\n\nI'll run it.\n\n" + CALL, False, True, "r", "I'll run it.", [("run", {"cmd": "ls", "n": 2})]),
    ("why\n</think>\n\n" + CALL, True, True, "why\n", "", [("run", {"cmd": "ls", "n": 2})]),
    ("quote <tool_call> in reasoning</think>, still\n</think>\n\nok", True, True,
     "quote <tool_call> in reasoning</think>, still\n", "ok", []),
    ("Text with <b>html</b> and a < sign", False, True, "", "Text with <b>html</b> and a < sign", []),
    ("Markup <tool_call> that never opens a function.", False, True, "",
     "Markup <tool_call> that never opens a function.", []),
    ("Quoted <function=run>...</function> then real:\n" + CALL, False, True, "",
     "Quoted <function=run>...</function> then real:", [("run", {"cmd": "ls", "n": 2})]),
    # the first marker opens with a complete call: that region is the turn, trailing text dropped
    ("First <function=run></function> then more:\n" + CALL, False, True, "", "First", [("run", {})]),
    (CALL + "\n" + CALL.replace("ls", "pwd"), False, True, "", "",
     [("run", {"cmd": "ls", "n": 2}), ("run", {"cmd": "pwd", "n": 2})]),
    ("trailing spaces kept   ", False, True, "", "trailing spaces kept   ", []),
    ("ends with a partial marker <tool_c", False, True, "", "ends with a partial marker <tool_c", []),
    ("no tools: " + CALL, False, False, "", "no tools: " + CALL, []),
    ("<tool_call>\n<function=run>\n<parameter=cmd>\nunterminated", False, True, "", "", [(MALFORMED_TOOL, None)]),
    ("I may call <function=run> later.", False, True, "", "I may call", [(MALFORMED_TOOL, None)]),
    ('<function_calls>\n<invoke name="run">\n<parameter name="cmd">x</parameter>\n</invoke>\n</function_calls>',
     False, True, "", "", [("run", {"cmd": "x"})]),
    ("", True, True, "", "", []),
    ("€ unicode ✓\n\n" + CALL, False, True, "", "€ unicode ✓", [("run", {"cmd": "ls", "n": 2})]),
]


def run_decoder(chunks, in_reasoning, tools, parallel=True):
    dec = OutputDecoder(in_reasoning=in_reasoning, tools=TOOLS if tools else None, parallel_tool_calls=parallel,
                        chat_format=QWEN35_CHAT_FORMAT)
    events: list[OutputEvent] = []
    for c in chunks:
        events += dec.feed(c)
    events += dec.finish()
    return dec, events


def summarize(dec, events):
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    content = "".join(e.text for e in events if e.kind == "content")
    calls = [e.tool_call for e in events if e.kind == "tool_call"]
    assert reasoning == dec.reasoning and content == dec.content
    assert [c.id for c in calls] == [c.id for c in dec.tool_calls]
    for e in events:
        assert e.kind == "tool_call" or e.text, "no empty text events"
    # tool calls come last, after all text
    kinds = [e.kind for e in events]
    if "tool_call" in kinds:
        assert all(k == "tool_call" for k in kinds[kinds.index("tool_call"):])
    return reasoning, content, [(c.name, json.loads(c.arguments)) for c in calls]


def check(expected_calls, got_calls):
    assert len(got_calls) == len(expected_calls)
    for (en, ea), (gn, ga) in zip(expected_calls, got_calls):
        assert gn == en
        if ea is not None:
            assert ga == ea


@pytest.mark.parametrize("case", CORPUS, ids=[repr(c[0][:30]) for c in CORPUS])
def test_every_two_way_split_and_char_by_char(case):
    text, in_reasoning, tools, want_r, want_c, want_calls = case
    splits = [[text]] + [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for chunks in splits:
        dec, events = run_decoder(chunks, in_reasoning, tools)
        r, c, calls = summarize(dec, events)
        assert (r, c) == (want_r, want_c), chunks
        check(want_calls, calls)


@pytest.mark.parametrize("case", CORPUS[:10], ids=[repr(c[0][:30]) for c in CORPUS[:10]])
def test_three_way_splits(case):
    text, in_reasoning, tools, want_r, want_c, want_calls = case
    n = len(text)
    for i in range(0, n + 1, 3):
        for j in range(i, n + 1, 5):
            dec, events = run_decoder([text[:i], text[i:j], text[j:]], in_reasoning, tools)
            r, c, calls = summarize(dec, events)
            assert (r, c) == (want_r, want_c)
            check(want_calls, calls)


def test_answer_text_streams_before_the_end():
    dec = OutputDecoder(in_reasoning=False, tools=TOOLS, chat_format=QWEN35_CHAT_FORMAT)
    assert [(e.kind, e.text) for e in dec.feed("Hello world, ")] == [("content", "Hello world,")]
    # the trailing space was held back (a call may follow it), released with the next text
    assert [(e.kind, e.text) for e in dec.feed("more")] == [("content", " more")]


def test_only_an_ambiguous_marker_prefix_is_held():
    dec = OutputDecoder(in_reasoning=False, tools=TOOLS, chat_format=QWEN35_CHAT_FORMAT)
    assert [e.text for e in dec.feed("a <tool")] == ["a"]
    assert [e.text for e in dec.feed("kit>")] == [" <toolkit>"]
    assert [e.text for e in dec.feed(" <tool_call> words")] == [" <tool_call> words"]


def test_region_that_opens_a_function_is_held_until_finish():
    dec = OutputDecoder(in_reasoning=False, tools=TOOLS, chat_format=QWEN35_CHAT_FORMAT)
    assert [e.text for e in dec.feed("ok\n\n<tool_call>\n<function=run>\n")] == ["ok"]
    assert dec.feed("<parameter=cmd>\nls\n</parameter>\n</function>\n</tool_call>") == []
    events = dec.finish()
    assert [e.kind for e in events] == ["tool_call"]
    assert events[0].tool_call.id.startswith("call_") and len(events[0].tool_call.id) == 29


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = CALL + "\n" + CALL.replace("ls", "pwd")
    dec, events = run_decoder([text], False, True, parallel=False)
    assert [json.loads(c.arguments)["cmd"] for c in dec.tool_calls] == ["ls"]


def test_id_prefix_and_unique_ids():
    dec = OutputDecoder(in_reasoning=False, tools=TOOLS, id_prefix="toolu_", chat_format=QWEN35_CHAT_FORMAT)
    dec.feed(CALL + CALL)
    dec.finish()
    ids = [c.id for c in dec.tool_calls]
    assert all(i.startswith("toolu_") for i in ids) and len(set(ids)) == 2


@pytest.mark.parametrize("tail", [
    "<parameter=cmd>\nls\n</parameter>\n</function>\n</tool_call>",
    "<parameter=cmd>\nls\n</parameter>\n</function>",
    "<parameter=cmd>\nls\n</parameter>",
    "<parameter=cmd>\nls\n",
])
def test_forced_call_continues_the_opener_and_closes_it(tail):
    opener = "<tool_call>\n<function=run>\n"
    dec = OutputDecoder(in_reasoning=False, tools=TOOLS, forced_call=opener, chat_format=QWEN35_CHAT_FORMAT)
    events = []
    for ch in tail:
        events += dec.feed(ch)
    events += dec.finish()
    assert [e.kind for e in events] == ["tool_call"]
    assert json.loads(dec.tool_calls[0].arguments) == {"cmd": "ls"}
    assert dec.forced_call_closed == (not tail.endswith("</tool_call>"))
    assert dec.content == ""


def test_forced_call_that_cannot_be_read_is_malformed():
    dec = OutputDecoder(in_reasoning=False, tools=TOOLS, forced_call="<tool_call>\n<function=run>\n",
                        chat_format=QWEN35_CHAT_FORMAT)
    dec.feed("garbage <<")
    dec.finish()
    assert [c.name for c in dec.tool_calls] == [MALFORMED_TOOL]


def test_feed_after_finish_is_an_error():
    dec = OutputDecoder(in_reasoning=False, chat_format=QWEN35_CHAT_FORMAT)
    dec.finish()
    with pytest.raises(RuntimeError):
        dec.feed("x")
    assert dec.finish() == []


class _Tok:
    """Token ids -> bytes for LogprobChannel: 1 <think>, 2 </think>, others one character."""

    table = {1: b"<think>", 2: b"</think>", 3: b"\n\n", 4: b"a", 5: b" ", 6: b"\n", 7: b"b"}
    chat_format = QWEN35_CHAT_FORMAT

    def token_to_id(self, text):
        return {"<think>": 1, "</think>": 2}.get(text)

    def token_bytes(self, t):
        return self.table[t]


def _rec(t):
    from ninfer_core.engine.api import TokenLogprob

    return TokenLogprob(t, -0.5)


def test_logprob_channel_keeps_content_tokens_only():
    from ninfer_core.server.output import LogprobChannel

    ch = LogprobChannel(_Tok(), in_reasoning=True)
    ids = [4, 4, 2, 3, 6, 7, 5, 4]
    got = ch.take(ids[:3], [_rec(t) for t in ids[:3]]) + ch.take(ids[3:], [_rec(t) for t in ids[3:]])
    assert [r.token_id for r in got] == [7, 5, 4]  # reasoning, the close and its whitespace have none
    ch = LogprobChannel(_Tok(), in_reasoning=False)
    assert [r.token_id for r in ch.take([5, 4], [_rec(5), _rec(4)])] == [5, 4]
    ch = LogprobChannel(_Tok(), in_reasoning=False)  # an output that opens its own block
    assert [r.token_id for r in ch.take([1, 4, 2, 3, 7], [_rec(t) for t in (1, 4, 2, 3, 7)])] == [7]
    # inserted (unsampled) tokens have no record and are skipped without shifting the others
    ch = LogprobChannel(_Tok(), in_reasoning=True)
    assert [r.token_id for r in ch.take([4, 2, 3, 7, 4], [_rec(4), _rec(7), _rec(4)])] == [7, 4]


def test_logprob_json_shape():
    from ninfer_core.engine.api import TokenLogprob
    from ninfer_core.server.output import logprob_json

    tok = _Tok()
    tok.table = {**tok.table, 8: b"\xe2\x82"}  # an incomplete UTF-8 sequence
    rec = TokenLogprob(8, -1.25, [(8, -1.25), (4, -2.0)])
    assert logprob_json(tok, rec) == {"token": "\ufffd", "logprob": -1.25, "bytes": [0xE2, 0x82], "top_logprobs": [
        {"token": "\ufffd", "logprob": -1.25, "bytes": [0xE2, 0x82]}, {"token": "a", "logprob": -2.0, "bytes": [97]}]}
    assert logprob_json(tok, rec, with_bytes=False)["top_logprobs"][1] == {"token": "a", "logprob": -2.0}


@pytest.mark.parametrize("as_text", [False, True])
def test_undeclared_function_is_text_when_asked(as_text):
    # Responses: only the effective tool set becomes structured calls; Chat recovers the call.
    undeclared = "Let me try.\n" + CALL.replace("function=run", "function=delete_everything")
    for chunks in ([undeclared], list(undeclared)):
        dec = OutputDecoder(in_reasoning=False, tools=TOOLS, undeclared_as_text=as_text,
                            chat_format=QWEN35_CHAT_FORMAT)
        events = [e for c in chunks for e in dec.feed(c)] + dec.finish()
        calls = [e.tool_call for e in events if e.kind == "tool_call"]
        if as_text:
            assert calls == [] and dec.content == undeclared
            assert "".join(e.text for e in events if e.kind == "content") == undeclared
        else:
            assert [c.name for c in calls] == [MALFORMED_TOOL] and dec.content == "Let me try."
    # a declared call still parses with the flag on
    dec = OutputDecoder(in_reasoning=False, tools=TOOLS, undeclared_as_text=True,
                        chat_format=QWEN35_CHAT_FORMAT)
    dec.feed(CALL)
    dec.finish()
    assert [c.name for c in dec.tool_calls] == ["run"]
