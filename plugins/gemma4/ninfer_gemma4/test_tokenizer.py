"""A small Gemma-4-shaped tokenizer for tests: SentencePiece-style BPE with byte fallback (the
structure of Gemma's tokenizer.json: U+2581 for spaces, `<0xAB>` byte pieces, no pre-tokenizer
split), Gemma 4's control tokens as added tokens, trained with `tokenizers` on a few lines of text.

Ids of <pad> 0, <eos> 1, <bos> 2, <|tool_response> 50 and <turn|> 106 are those of the published
tokenizer (its generation_config's eos ids are 1, 106, 50); the other control ids are this
tokenizer's own.
"""

from __future__ import annotations

import json
from pathlib import Path

# (id, content, special): special=False marks markup the model writes in its answers (reasoning,
# tool calls, the string delimiter), which decoding must keep for the output parsers.
CONTROL = [
    (0, "<pad>", True), (1, "<eos>", True), (2, "<bos>", True), (3, "<unk>", True), (4, "<mask>", True),
    (46, "<|tool>", True), (47, "<tool|>", True), (48, "<|tool_call>", False), (49, "<tool_call|>", False),
    (50, "<|tool_response>", False), (51, "<tool_response|>", False), (52, '<|"|>', False),
    (98, "<|think|>", True), (100, "<|channel>", False), (101, "<channel|>", False),
    (105, "<|turn>", True), (106, "<turn|>", True), (107, "<|image|>", True),
    (108, "<|image>", True), (109, "<image|>", True), (110, "<|video|>", True),
]
RESERVED = 128  # ids below are control / unused tokens; then 256 byte pieces; then learned pieces

CORPUS = """The quick brown fox jumps over the lazy dog. Hello, world! How are you today?
A language model reads tokens and writes tokens. The weather in Paris is sunny; in London it rains.
Call the function get_weather with the city name. {"city": "Paris", "unit": "celsius"}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100. Thinking step by step, the answer is yes.
user model system tool response declaration call description parameters properties type STRING
"""


def tokenizer_json(vocab_size: int = 512) -> dict:
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    learned = vocab_size - RESERVED - 256
    trainer = trainers.BpeTrainer(vocab_size=learned, show_progress=False, special_tokens=[])
    tmp = Tokenizer(models.BPE())
    tmp.normalizer = normalizers.Replace(" ", "\u2581")
    tmp.train_from_iterator(CORPUS.splitlines(), trainer)
    trained = json.loads(tmp.to_str())["model"]
    pieces = sorted(trained["vocab"].items(), key=lambda kv: kv[1])[:learned]
    names = {i: c for i, c, _ in CONTROL}
    vocab = {names.get(i, f"<unused{i}>"): i for i in range(RESERVED)}
    vocab.update({f"<0x{b:02X}>": RESERVED + b for b in range(256)})
    for k, (piece, _) in enumerate(pieces):
        vocab.setdefault(piece, RESERVED + 256 + k)
    merges = [m for m in trained["merges"]
              if all(part in vocab for part in (m.split(" ") if isinstance(m, str) else m))
              and "".join(m.split(" ") if isinstance(m, str) else m) in vocab]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
                                                    for m in merges], byte_fallback=True, unk_token="<unk>",
                               fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken(c, special=s, normalized=False) for _, c, s in CONTROL])
    data = json.loads(tok.to_str())
    for entry in data["added_tokens"]:
        entry["special"] = next(s for _, c, s in CONTROL if c == entry["content"])
    return data


def write_tokenizer_files(path, vocab_size: int = 512) -> None:
    from ninfer_gemma4.chat import GEMMA4_TEMPLATE

    path = Path(path)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json(vocab_size)), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
         "tokenizer_class": "GemmaTokenizer"}), encoding="utf-8")
    (path / "chat_template.jinja").write_text(GEMMA4_TEMPLATE, encoding="utf-8")


def tokenizer_section(vocab_size: int = 512) -> dict:
    """The artifact tokenizer section of this tokenizer (what `ninfer convert` stores)."""
    import tempfile

    from ninfer_core.tokenizer.hf import tokenizer_section_from_hf_dir

    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer_files(tmp, vocab_size)
        return tokenizer_section_from_hf_dir(tmp)
