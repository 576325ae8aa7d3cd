"""Anthropic content blocks from model output: a corpus of outputs, every chunking.

The shared OutputDecoder splits reasoning, text and tool calls; BlockWriter turns its events into
blocks and their SSE lifecycle. For every output and every way of cutting it into deltas, the
blocks rebuilt from the events equal the aggregate blocks, and the lifecycle rules hold.
"""

from __future__ import annotations

import base64
import json

import pytest
from qwen_format import QWEN35_CHAT_FORMAT

from ninfer_core.protocols.anthropic import BlockWriter
from ninfer_core.protocols.anthropic_history import SIGNATURE_PREFIX
from ninfer_core.server.output import OutputDecoder
from ninfer_core.tokenizer.toolcalls import MALFORMED_TOOL

TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
    "cmd": {"type": "string"}, "n": {"type": "integer"}}}}}]
CALL = ("<tool_call>\n<function=run>\n<parameter=cmd>\nls -l\n</parameter>\n<parameter=n>\n2\n</parameter>\n"
        "</function>\n</tool_call>")

# (output, prompt opens reasoning, tools offered, expected [(block type, text or tool input)])
CORPUS = [
    ("plain answer", False, False, [("text", "plain answer")]),
    ("why not\n</think>\n\nanswer", True, False, [("thinking", "why not\n"), ("text", "answer")]),
    ("only thinking, cut by the limit", True, False, [("thinking", "only thinking, cut by the limit")]),
    ("r\n</think>\n\nI'll run it.\n\n" + CALL, True, True,
     [("thinking", "r\n"), ("text", "I'll run it."), ("tool_use", {"cmd": "ls -l", "n": 2})]),
    ("r\n</think>\n\n" + CALL + "\n" + CALL.replace("ls -l", "pwd"), True, True,
     [("thinking", "r\n"), ("tool_use", {"cmd": "ls -l", "n": 2}), ("tool_use", {"cmd": "pwd", "n": 2})]),
    ("\n\n   \n" + CALL, False, True, [("tool_use", {"cmd": "ls -l", "n": 2})]),
    ("quoted <tool_call> in reasoning</think>, still\n</think>\n\nok", True, True,
     [("thinking", "quoted <tool_call> in reasoning</think>, still\n"), ("text", "ok")]),
    ("Markup <tool_call> that never opens a function.", False, True,
     [("text", "Markup <tool_call> that never opens a function.")]),
    ("no tools offered: " + CALL, False, False, [("text", "no tools offered: " + CALL)]),
    ("€ unicode ✓ 你好\n\n" + CALL, False, True, [("text", "€ unicode ✓ 你好"), ("tool_use", {"cmd": "ls -l", "n": 2})]),
    ("<tool_call>\n<function=run>\n<parameter=cmd>\nunterminated", False, True, [("tool_use", MALFORMED_TOOL)]),
    ("", True, True, []),
    ("  \n", False, False, []),
]


def chunkings(text: str):
    yield [text]
    for size in (1, 2, 3, 5, 11):
        yield [text[i:i + size] for i in range(0, len(text), size)] or [""]


def run(output: str, in_reasoning: bool, tools, chunks, omitted: bool = False):
    decoder = OutputDecoder(in_reasoning=in_reasoning, tools=tools if tools else None, id_prefix="toolu_",
                            chat_format=QWEN35_CHAT_FORMAT)
    writer = BlockWriter(omitted)
    events = []
    for piece in chunks:
        events += writer.feed(decoder.feed(piece))
    tail = writer.feed(decoder.finish())
    writer.close(tail)
    return writer.blocks, events + tail


def rebuild(events) -> list[dict]:
    blocks: list[dict] = []
    open_index = None
    for ev in events:
        kind = ev["type"]
        if kind == "content_block_start":
            assert open_index is None and ev["index"] == len(blocks), "a block opened before the last closed"
            blocks.append(json.loads(json.dumps(ev["content_block"])))
            open_index = ev["index"]
            if blocks[-1]["type"] == "tool_use":
                assert blocks[-1]["input"] == {}
                blocks[-1]["_json"] = ""
        elif kind == "content_block_delta":
            assert ev["index"] == open_index
            b, d = blocks[open_index], ev["delta"]
            field = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature",
                     "input_json_delta": "_json"}[d["type"]]
            assert {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "thinking",
                    "input_json_delta": "tool_use"}[d["type"]] == b["type"]
            value = d.get("partial_json", d.get("text", d.get("thinking", d.get("signature"))))
            b[field] += value
        else:
            assert kind == "content_block_stop" and ev["index"] == open_index
            b = blocks[open_index]
            if b["type"] == "tool_use":
                b["input"] = json.loads(b.pop("_json"))
            open_index = None
    assert open_index is None
    return blocks


def summary(blocks):
    out = []
    for b in blocks:
        if b["type"] == "tool_use":
            out.append(("tool_use", b["name"] if b["name"] == MALFORMED_TOOL else b["input"]))
        else:
            out.append((b["type"], b["thinking"] if b["type"] == "thinking" else b["text"]))
    return out


@pytest.mark.parametrize("output,in_reasoning,tools,expected", CORPUS)
def test_blocks_at_every_chunking(output, in_reasoning, tools, expected):
    for chunks in chunkings(output):
        blocks, events = run(output, in_reasoning, TOOLS if tools else None, chunks)
        assert summary(blocks) == expected, chunks
        rebuilt = rebuild(events)
        assert rebuilt == blocks
        for b in blocks:
            if b["type"] == "text":
                assert b["text"].strip(), "a whitespace-only text block"
            if b["type"] == "thinking":
                assert b["signature"]
                sig_deltas = [e for e in events if e["type"] == "content_block_delta"
                              and e["delta"]["type"] == "signature_delta"]
                assert sig_deltas
            if b["type"] == "tool_use":
                assert b["id"].startswith("toolu_") and isinstance(b["input"], dict)


@pytest.mark.parametrize("output,in_reasoning,tools,expected", [c for c in CORPUS if c[1]])
def test_omitted_display_carries_the_reasoning_in_the_signature(output, in_reasoning, tools, expected):
    for chunks in chunkings(output):
        blocks, events = run(output, in_reasoning, TOOLS if tools else None, chunks, omitted=True)
        assert not any(e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta"
                       for e in events)
        assert rebuild(events) == blocks
        thinking = [b for b in blocks if b["type"] == "thinking"]
        want = [text for kind, text in expected if kind == "thinking"]
        assert [b["thinking"] for b in thinking] == [""] * len(want)
        assert [base64.b64decode(b["signature"][len(SIGNATURE_PREFIX):]).decode() for b in thinking] == want
