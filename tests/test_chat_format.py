"""Core with no family's chat format: nothing is read as markup; a stated format drives every reader;
sampler presets from the family, its format, the artifact's generation config, or neutral."""

import pytest
from qwen_format import QWEN35_CHAT_FORMAT, byte_tokenizer_section

from ninfer_core.engine.api import EngineError
from ninfer_core.engine.cache import derive_hints
from ninfer_core.server.output import OutputDecoder
from ninfer_core.server.prepare import NEUTRAL_PRESET, default_sampling_presets, forced_call_ids, opens_reasoning
from ninfer_core.tokenizer import Tokenizer
from ninfer_core.tokenizer.chat_format import PLAIN, ChatFormat, attach, chat_format_of

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


def plain_tokenizer():
    return Tokenizer.from_section(byte_tokenizer_section())


def test_a_tokenizer_without_a_format_reads_no_markup():
    tok = plain_tokenizer()
    assert chat_format_of(tok) is PLAIN
    dec = OutputDecoder(in_reasoning=True, tools=TOOLS, chat_format=chat_format_of(tok))
    text = "<think>\nhm\n</think>\n\nhi <tool_call>\n<function=f>\n</function>\n</tool_call>"
    events = dec.feed(text) + dec.finish()
    assert [e.kind for e in events] == ["content"] and dec.content == text and not dec.tool_calls
    ids = tok.encode("<|im_start|>assistant\n<think>\n")
    assert opens_reasoning(tok, ids) is False
    assert derive_hints(tok, ids + ids).turn_closure is None
    with pytest.raises(EngineError) as ei:
        forced_call_ids(tok, "f")
    assert (ei.value.status, ei.value.code, ei.value.param) == (400, "tool_choice_not_supported", "tool_choice")


def test_a_stated_format_drives_reasoning_tools_and_hints():
    tok = plain_tokenizer()
    attach(tok, QWEN35_CHAT_FORMAT)
    dec = OutputDecoder(in_reasoning=False, tools=TOOLS, chat_format=chat_format_of(tok))
    dec.feed("<think>\nhm\n</think>\n\nhi <tool_call>\n<function=f>\n</function>\n</tool_call>")
    dec.finish()
    assert dec.reasoning == "hm\n" and dec.content == "hi" and [c.name for c in dec.tool_calls] == ["f"]
    turn = tok.encode("<|im_start|>user\nq<|im_end|>\n")
    ids = turn + tok.encode("<|im_start|>assistant\n<think>\n")
    assert opens_reasoning(tok, ids) is True
    assert derive_hints(tok, ids).turn_closure == len(turn)


def test_turn_opener_and_roles_of_another_format():
    """The context-cache hints follow whatever turn opener and role names the format states."""
    section = byte_tokenizer_section()
    section["added_tokens"] += [{"id": 265, "content": "<|turn>", "special": True},
                                {"id": 266, "content": "<turn|>", "special": True}]
    tok = Tokenizer.from_section(section)
    attach(tok, ChatFormat("turns", turn_opener="<|turn>", assistant_role="model"))
    first = tok.encode("<|turn>user\nq<turn|>\n<|turn>model\na<turn|>\n")
    second = tok.encode("<|turn>user\nr<turn|>\n")
    ids = first + second + tok.encode("<|turn>model\n")
    hints = derive_hints(tok, ids)
    assert hints.turn_closure == len(first) + len(second)
    assert hints.boundaries == [first.index(265, 1), len(first)]


def test_sampling_presets_in_order_family_format_generation_config_neutral():
    class Family:
        def sampling_presets(self, architecture):
            return {"thinking": {**NEUTRAL_PRESET, "temperature": 0.3}, "non_thinking": dict(NEUTRAL_PRESET)}

    class Silent:
        def sampling_presets(self, architecture):
            return None

    assert default_sampling_presets("x", Family())["thinking"]["temperature"] == 0.3
    fmt = ChatFormat("f", sampling={"thinking": {**NEUTRAL_PRESET, "top_k": 7}, "non_thinking": NEUTRAL_PRESET})
    assert default_sampling_presets("x", Silent(), chat_format=fmt)["thinking"]["top_k"] == 7
    gen = {"temperature": 0.6, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1, "do_sample": True}
    got = default_sampling_presets("x", Silent(), generation=gen)
    assert got["thinking"] == got["non_thinking"] == {**NEUTRAL_PRESET, "temperature": 0.6, "top_p": 0.9, "top_k": 40}
    assert default_sampling_presets("x") == {"thinking": NEUTRAL_PRESET, "non_thinking": NEUTRAL_PRESET}
    assert QWEN35_CHAT_FORMAT.sampling["non_thinking"]["temperature"] == 0.7
