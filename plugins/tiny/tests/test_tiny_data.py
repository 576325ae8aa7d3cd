"""The generator (determinism, format, tool calls parse back) and the tokenizer trainer."""

import json
import re
from types import SimpleNamespace

from ninfer_tiny import data
from ninfer_tiny.evaluate import matches_schema, score_answer

from ninfer_core.tokenizer.bpe import Tokenizer
from ninfer_core.tokenizer.toolcalls import parse_tool_calls, schema_map

_LAST_ANSWER = re.compile(r"<think>\n(.*?)\n</think>\n\n(.*?)<\|im_end\|>\n\Z", re.DOTALL)


def test_samples_are_deterministic_and_cover_every_kind():
    a = [data.make_sample(7, i) for i in range(300)]
    b = [data.make_sample(7, i) for i in range(300)]
    assert [(s.kind, s.messages, s.tools) for s in a] == [(s.kind, s.messages, s.tools) for s in b]
    assert {s.kind for s in a} == set(data.KINDS)
    other = [data.make_sample(8, i) for i in range(300)]
    assert [s.messages for s in other] != [s.messages for s in a]


def test_every_sample_renders_and_its_tool_calls_parse_back_with_the_shared_parser():
    calls_checked = 0
    for i in range(300):
        s = data.make_sample(3, i)
        assert data.render(s).endswith("<|im_end|>\n")
        # every assistant turn, rendered as the last one (with its thinking block)
        for j, msg in enumerate(s.messages):
            if msg["role"] != "assistant":
                continue
            text = data.render(data.Sample(s.kind, s.messages[: j + 1], s.tools))
            assert text.startswith("<|im_start|>") and text.endswith("<|im_end|>\n")
            m = _LAST_ANSWER.match(text.rsplit("<|im_start|>assistant\n", 1)[1])
            assert m, f"sample {i} ({s.kind}) turn {j} lacks a thinking block and an answer"
            assert m.group(1) == msg["reasoning_content"].strip()
            parsed = parse_tool_calls(m.group(2), schema_map(s.tools))
            expected = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
            got = [(c.name, json.loads(c.arguments)) for c in parsed.calls]
            assert got == expected, (i, j, m.group(2))
            assert not parsed.malformed and parsed.fallback == "none"
            calls_checked += len(got)
            if not expected:
                assert not parsed.marker_seen and parsed.content == msg["content"]
    assert calls_checked > 50


def test_json_answers_follow_their_schema_and_additions_are_right():
    for i in range(200):
        s = data.make_sample(5, i, "json")
        assert matches_schema(json.loads(s.messages[-1]["content"]), s.expect["schema"])
        a = data.make_sample(5, i, "arithmetic")
        if a.expect["op"] == "+":
            assert a.messages[-1]["reasoning_content"].endswith(f"= {a.expect['answer']}.")


def test_eval_scorer_accepts_the_reference_answer_and_rejects_wrong_ones():
    samples = data.eval_prompts(1, 10)
    assert {s.kind for s in samples} == {"tool", "json", "addition"}
    train_prompts = {json.dumps(data.make_sample(0, i).messages) for i in range(2000)}
    assert not any(json.dumps(s.messages) in train_prompts for s in samples)
    for s in samples:
        ref = s.messages[-1]
        if s.kind == "tool":
            fn = ref["tool_calls"][0]["function"]
            good = SimpleNamespace(content=None, tool_calls=[SimpleNamespace(function=SimpleNamespace(
                name=fn["name"], arguments=json.dumps(fn["arguments"])))])
            bad = SimpleNamespace(content="I cannot.", tool_calls=None)
            wrong_args = SimpleNamespace(content=None, tool_calls=[SimpleNamespace(function=SimpleNamespace(
                name=fn["name"], arguments=json.dumps({"bogus": 1})))])
            assert not score_answer(s, wrong_args)
        elif s.kind == "json":
            good = SimpleNamespace(content=ref["content"], tool_calls=None)
            bad = SimpleNamespace(content=ref["content"][:-1], tool_calls=None)
        else:
            good = SimpleNamespace(content=f"The answer is {s.expect['answer']}.", tool_calls=None)
            bad = SimpleNamespace(content=f"The answer is {s.expect['answer'] + 1}.", tool_calls=None)
        assert score_answer(s, good) and not score_answer(s, bad), s.kind


def test_schema_check_refuses_missing_extra_and_mistyped_keys():
    schema = data.json_schema_of(["name", "age", "in_stock"])
    assert matches_schema({"name": "A", "age": 3, "in_stock": False}, schema)
    assert not matches_schema({"name": "A", "age": 3}, schema)
    assert not matches_schema({"name": "A", "age": 3, "in_stock": False, "x": 1}, schema)
    assert not matches_schema({"name": "A", "age": "3", "in_stock": False}, schema)
    assert not matches_schema({"name": "A", "age": True, "in_stock": False}, schema)
    assert not matches_schema([1], schema)


def test_tokenizer_training_round_trips_and_places_qwen_added_tokens_after_the_bpe():
    from ninfer_tiny.bpe import qwen35_added_tokens, train_section

    texts = [data.render(data.make_sample(2, i)) for i in range(200)]
    section = train_section(texts, vocab_size=320)
    assert section == train_section(texts, vocab_size=320)  # deterministic
    added = qwen35_added_tokens()
    assert [(t["content"], t["special"]) for t in section["added_tokens"]] == [
        (t["content"], t["special"]) for t in added]
    assert [t["id"] for t in section["added_tokens"]] == list(range(320, 320 + len(added)))
    tok = Tokenizer(section)
    for name in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                 "<tool_response>", "</tool_response>", "<|vision_start|>"):
        assert tok.token_to_id(name) is not None and tok.token_to_id(name) >= 320
    assert not tok.is_special(tok.token_to_id("<tool_call>")) and tok.is_special(tok.token_to_id("<|im_end|>"))
    for text in texts[:50] + ["Prose, with ünïcode — and 12345 digits.\n\n  spaces"]:
        ids = data.project_template().render_ids(tok, [{"role": "user", "content": text}])
        assert tok.decode(ids, skip_special=False).count(text.strip()) == 1
        assert tok.decode(tok.encode(text, allow_special=True), skip_special=False) == text
    merged = tok.encode(texts[0], allow_special=True)
    assert len(merged) < 0.75 * len(texts[0].encode())  # 64 merges already compress
