"""Turn-closure and message-boundary hints learned from the chat template (not only ChatML)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from qwen_format import QWEN35_TEMPLATE, byte_tokenizer_section, with_format

from ninfer_core.engine.cache import derive_hints
from ninfer_core.engine.turn_markers import hints_from_markers, learn_turn_markers, template_turn_markers
from ninfer_core.server.prepare import prompt_hints
from ninfer_core.tokenizer import Tokenizer
from ninfer_core.tokenizer.chat_template import ChatTemplate

# Gemma's layout: a BOS, `<start_of_turn>role\n ... <end_of_turn>\n`, the system prompt folded into
# the first user turn, the assistant called "model".
GEMMA = (
    "{{ '<bos>' }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% set msgs = messages[1:] %}{% else %}{% set prefix = '' %}{% set msgs = messages %}{% endif %}"
    "{% for m in msgs %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') + m['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
# The same layout spelled with control tokens the tiny model's Qwen tokenizer has, for a real server.
GEMMA_ON_QWEN = GEMMA.replace("<bos>", "<|quad_start|>").replace("<start_of_turn>", "<|box_start|>").replace(
    "<end_of_turn>", "<|box_end|>")
PLAIN = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}Assistant:{% endif %}")


@pytest.fixture(scope="module")
def qwen():
    from qwen_format import qwen35_tokenizer_section, with_format

    return with_format(Tokenizer.from_section(qwen35_tokenizer_section()))


@pytest.fixture(scope="module")
def gemma_tok():
    section = byte_tokenizer_section()
    next_id = 256 + len(section["added_tokens"])
    section["added_tokens"] = section["added_tokens"] + [
        {"id": next_id + i, "content": c, "special": True} for i, c in
        enumerate(["<bos>", "<start_of_turn>", "<end_of_turn>"])]
    return with_format(Tokenizer.from_section(section))


TOOL_LOOP = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
             {"role": "assistant", "content": "", "reasoning_content": "r",
              "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]},
             {"role": "tool", "content": "out"}]
CHATS = [TOOL_LOOP, TOOL_LOOP[1:], TOOL_LOOP[:2], TOOL_LOOP[1:2],
         TOOL_LOOP[:2] + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}],
         TOOL_LOOP + [{"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}]]


@pytest.mark.parametrize("preserve", [None, False, True])
def test_learned_markers_reproduce_the_chatml_hints(qwen, preserve):
    tpl = ChatTemplate(QWEN35_TEMPLATE)
    markers = learn_turn_markers(tpl, qwen)
    assert markers is not None and markers.start_id == qwen.token_to_id("<|im_start|>")
    assert (markers.assistant, markers.user, markers.system) == ("assistant", "user", "system")
    assert markers.tool == "user\n<tool_response>"
    for msgs in CHATS:
        ids = tpl.render_ids(qwen, msgs)
        assert hints_from_markers(markers, qwen, ids, preserve) == derive_hints(qwen, ids, preserve), msgs


def _starts(ids, tok, token):
    return [i for i, t in enumerate(ids) if t == tok.token_to_id(token)]


def test_gemma_layout_gets_turn_closure_and_boundaries(gemma_tok):
    tpl = ChatTemplate(GEMMA)
    markers = learn_turn_markers(tpl, gemma_tok)
    assert markers is not None
    assert markers.start_id == gemma_tok.token_to_id("<start_of_turn>")
    assert (markers.assistant, markers.user, markers.system) == ("model", "user", None)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    ids = tpl.render_ids(gemma_tok, msgs)
    starts = _starts(ids, gemma_tok, "<start_of_turn>")
    assert len(starts) == 4 and starts[0] == 1  # after <bos>
    h = hints_from_markers(markers, gemma_tok, ids, False)
    assert h.turn_closure == starts[-1]  # before the generation prompt's opener
    assert h.boundaries == starts[1:-1]
    assert h.stable_prefix is None  # the system prompt is folded into the first user turn
    assert derive_hints(gemma_tok, ids, False).turn_closure is None  # the ChatML reading finds nothing


def test_gemma_open_tool_loop_closure_follows_preserve_thinking(gemma_tok):
    tpl = ChatTemplate(GEMMA)
    markers = learn_turn_markers(tpl, gemma_tok)
    assert markers.tool == "tool"  # a tool result is not a user query
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "calling"},
            {"role": "tool", "content": "out"}]
    ids = tpl.render_ids(gemma_tok, msgs)
    starts = _starts(ids, gemma_tok, "<start_of_turn>")
    off = hints_from_markers(markers, gemma_tok, ids, False)
    assert off.turn_closure == starts[1] and off.rolling_closure == starts[3]  # "tool" is not a user query
    on = hints_from_markers(markers, gemma_tok, ids, True)
    assert on.turn_closure == starts[3] and on.rolling_closure is None


def test_underivable_template_gives_no_turn_hints(gemma_tok):
    tpl = ChatTemplate(PLAIN)
    assert learn_turn_markers(tpl, gemma_tok) is None
    ctx = SimpleNamespace(chat_template=tpl, tokenizer=gemma_tok)
    ids = tpl.render_ids(gemma_tok, [{"role": "user", "content": "hi"}])
    h = prompt_hints(ctx, ids, {})
    assert h.turn_closure is None and h.boundaries == [] and h.stable_prefix is None


def test_markers_are_probed_once_per_template(gemma_tok):
    tpl = ChatTemplate(GEMMA)
    first = template_turn_markers(tpl, gemma_tok)
    tpl.source = "changed"  # a second probe would not see this, but the cached result is used
    assert template_turn_markers(tpl, gemma_tok) is first


def _chat(server, messages, max_tokens=8):
    import httpx

    model = httpx.get(server.api_base + "/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(server.api_base + "/chat/completions", timeout=120, json={
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_gemma_layout_turn_closure_is_exact_on_a_real_server(start_server, tmp_path, qwen):
    """Turn 2 of a conversation whose history differs from what turn 1 generated resumes from turn
    1's turn-closure checkpoint, learned from a non-ChatML template; greedy output equals root."""
    tpl_path = tmp_path / "gemma.jinja"
    tpl_path.write_text(GEMMA_ON_QWEN)
    cached = start_server("--chat-template", str(tpl_path))
    assert "chat messages open with '<|box_start|>' (assistant 'model')" in cached.log()
    turn1 = [{"role": "system", "content": "You answer briefly."},
             {"role": "user", "content": "Name three colours of the rainbow."}]
    _chat(cached, turn1)
    turn2 = turn1 + [{"role": "assistant", "content": "Red, orange and yellow."},
                     {"role": "user", "content": "And the other four?"}]
    warm = _chat(cached, turn2)
    tpl = ChatTemplate(GEMMA_ON_QWEN)
    closure = hints_from_markers(learn_turn_markers(tpl, qwen), qwen, tpl.render_ids(qwen, turn1), False).turn_closure
    assert closure and closure > 10
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == closure
    root = start_server("--chat-template", str(tpl_path), "--no-prefix-reuse")
    cold = _chat(root, turn2)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    assert warm["usage"]["completion_tokens"] == cold["usage"]["completion_tokens"]


def test_underivable_template_logs_one_line_at_startup(start_server, tmp_path):
    tpl_path = tmp_path / "plain.jinja"
    tpl_path.write_text(PLAIN)
    server = start_server("--chat-template", str(tpl_path))
    assert server.log().count("message opener could not be derived") == 1
