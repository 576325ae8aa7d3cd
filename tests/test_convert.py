"""`ninfer convert` from a tiny Hugging Face-style directory, and `ninfer inspect` on the result."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from ninfer_core.artifact import Artifact
from ninfer_core.artifact.inspect import run_inspect
from ninfer_core.cli import main

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")]
ADDED = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
]
VOCAB_SIZE = 256 + len(MERGES) + len(ADDED)  # 264
GENERATION = {"eos_token_id": [262, 260], "temperature": 0.6, "top_p": 0.95, "top_k": 20}
LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def _byte_chars() -> list[str]:
    """The byte-level BPE alphabet: printable bytes stand for themselves, the rest map above 255."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _tokenizer_json() -> dict:
    vocab = {c: i for i, c in enumerate(_byte_chars())}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    added = [
        {
            "id": len(vocab) + i,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for i, (text, special) in enumerate(ADDED)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": SPLIT_PATTERN},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [f"{a} {b}" for a, b in MERGES],
        },
    }


def _hf_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    h = 16
    out = {
        "model.language_model.embed_tokens.weight": torch.randn(VOCAB_SIZE, h, generator=g).bfloat16(),
        "model.language_model.norm.weight": torch.randn(h, generator=g),  # f32
        "lm_head.weight": torch.randn(VOCAB_SIZE, h, generator=g).bfloat16(),
    }
    for i in range(len(LAYER_TYPES)):
        prefix = f"model.language_model.layers.{i}"
        out[f"{prefix}.mlp.up_proj.weight"] = torch.randn(32, h, generator=g).bfloat16()
        out[f"{prefix}.input_layernorm.weight"] = torch.randn(h, generator=g).bfloat16()
    out["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=g).bfloat16()
    out["mtp.norm.weight"] = torch.randn(h, generator=g).bfloat16()
    out["model.visual.patch_embed.proj.weight"] = torch.randn(h, 3, 2, 2, generator=g)  # f32
    out["model.visual.merger.fc.weight"] = torch.randn(h, h, generator=g).half()  # f16
    return out


def _config() -> dict:
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text",
            "hidden_size": 16,
            "num_hidden_layers": len(LAYER_TYPES),
            "layer_types": LAYER_TYPES,
            "vocab_size": VOCAB_SIZE,
            "mtp_num_hidden_layers": 1,
        },
        "vision_config": {"hidden_size": 16, "depth": 1},
    }


def make_hf_dir(root, *, index: bool = True) -> str:
    d = root / "tiny-qwen"
    d.mkdir()
    tensors = _hf_tensors()
    names = list(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(d / fname), metadata={"format": "pt"})
    if index:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {n: f for f, part in shards.items() for n in part}
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
        )
    (d / "config.json").write_text(json.dumps(_config()))
    (d / "tokenizer.json").write_text(json.dumps(_tokenizer_json(), ensure_ascii=False))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "chat_template": CHAT_TEMPLATE,
                "added_tokens_decoder": {
                    str(256 + len(MERGES) + i): {"content": t, "special": s} for i, (t, s) in enumerate(ADDED)
                },
            }
        )
    )
    (d / "generation_config.json").write_text(
        json.dumps(GENERATION)
    )
    return str(d)


@pytest.fixture
def hf_dir(tmp_path):
    return make_hf_dir(tmp_path)


def _convert(hf: str, out: str, *extra: str) -> int:
    return main(["convert", hf, out, "--no-progress", *extra])


def test_handwritten_tokenizer_json_is_valid():
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_str(json.dumps(_tokenizer_json()))
    assert tok.get_vocab_size() == VOCAB_SIZE
    ids = tok.encode("hello world<|im_end|>").ids
    assert ids[0] == 258 and ids[-1] == 262  # "hell" merged, added token recognised


def test_convert_round_trip(hf_dir, tmp_path, capsys):
    out = str(tmp_path / "tiny.ninfer")
    assert _convert(hf_dir, out) == 0
    assert "wrote" in capsys.readouterr().out
    assert not os.path.exists(out + ".tmp")
    tensors = _hf_tensors()
    with Artifact.open(out) as art:
        assert art.architecture == "qwen3_5"
        assert art.name == "tiny-qwen"
        assert art.manifest["identity"] == {"model_id": "tiny-qwen"}
        assert art.config == _config()
        assert art.chat_template == CHAT_TEMPLATE
        assert art.manifest["generation"] == GENERATION
        assert art.components == ["text", "mtp", "vision"]
        assert sorted(art.tensor_names()) == sorted(tensors)
        assert set(art.tensor_names("mtp")) == {"mtp.fc.weight", "mtp.norm.weight"}
        assert set(art.tensor_names("vision")) == {
            "model.visual.patch_embed.proj.weight",
            "model.visual.merger.fc.weight",
        }
        for name, t in tensors.items():
            got = art.get_tensor(name)
            assert got.dtype == t.dtype and torch.equal(got, t), name
        enc = {n: e["encoding"] for n, e in art.manifest["tensors"].items()}
        assert enc["lm_head.weight"] == "bf16"
        assert enc["model.language_model.norm.weight"] == "f32"
        assert enc["model.visual.merger.fc.weight"] == "f16"
        tok = art.tokenizer_section
        assert tok["type"] == "bpe"
        assert "<|im_end|>" in tok["eos_tokens"]
        assert {t["content"] for t in tok["added_tokens"]} == {t for t, _ in ADDED}
        assert art.verify() == len(tensors)


def test_convert_name_and_chat_template_jinja(hf_dir, tmp_path):
    (tmp_path / "tiny-qwen" / "chat_template.jinja").write_text("{{ messages[0].content }}")
    out = str(tmp_path / "n.ninfer")
    assert _convert(hf_dir, out, "--name", "my-model") == 0
    art = Artifact.open(out)
    assert art.name == "my-model"
    assert art.manifest["identity"]["model_id"] == "my-model"
    assert art.chat_template == "{{ messages[0].content }}"


def test_convert_without_index_uses_all_shards(tmp_path):
    hf = make_hf_dir(tmp_path, index=False)
    os.remove(os.path.join(hf, "generation_config.json"))
    out = str(tmp_path / "noindex.ninfer")
    assert _convert(hf, out) == 0
    art = Artifact.open(out)
    assert sorted(art.tensor_names()) == sorted(_hf_tensors())
    assert art.manifest["generation"] == {}


def test_inspect_summary(hf_dir, tmp_path, capsys):
    out = str(tmp_path / "tiny.ninfer")
    assert _convert(hf_dir, out) == 0
    capsys.readouterr()
    assert main(["inspect", out]) == 0
    text = capsys.readouterr().out
    tensors = _hf_tensors()
    text_names = [n for n in tensors if not n.startswith(("mtp.", "model.visual."))]
    total = sum(t.numel() for t in tensors.values())
    assert "format version: 3" in text
    assert "name:           tiny-qwen" in text
    assert "architecture:   qwen3_5" in text
    assert f"text ({len(text_names)} tensors" in text
    assert "mtp (2 tensors" in text and "vision (2 tensors" in text
    assert f"parameters:     {total:,}" in text
    assert "bf16 (" in text and "f32 (2 tensors, " in text and "f16 (1 tensor, " in text
    assert f"vocab {VOCAB_SIZE}, {len(ADDED)} added tokens" in text
    assert "<|im_end|>" in text
    assert f"chat template:  yes ({len(CHAT_TEMPLATE)} chars)" in text
    assert "hidden_size 16" in text and "num_hidden_layers 4" in text and f"vocab_size {VOCAB_SIZE}" in text
    assert "linear_attention x3, full_attention x1" in text


def test_inspect_json_elides_ranks(hf_dir, tmp_path, capsys):
    out = str(tmp_path / "tiny.ninfer")
    assert _convert(hf_dir, out) == 0
    capsys.readouterr()
    assert main(["inspect", out, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["format_version"] == 3 and shown["architecture"] == "qwen3_5"
    assert shown["tokenizer"]["ranks"] == f"<{256 + len(MERGES)} ranks elided>"
    assert shown["config"] == _config()
    assert len(shown["tensors"]) == len(_hf_tensors())


def test_inspect_verify(hf_dir, tmp_path, capsys):
    out = str(tmp_path / "tiny.ninfer")
    assert _convert(hf_dir, out) == 0
    ns = argparse.Namespace(artifact=out, json=False, verify=True, no_progress=True)
    assert run_inspect(ns) == 0
    assert "verify: ok" in capsys.readouterr().out
    art = Artifact.open(out)
    offset, nbytes = art.tensor_file_range("lm_head.weight")
    art.close()
    with open(out, "r+b") as f:
        f.seek(offset + 3)
        b = f.read(1)
        f.seek(offset + 3)
        f.write(bytes([b[0] ^ 0x40]))
    capsys.readouterr()
    assert run_inspect(argparse.Namespace(artifact=out, json=False, verify=False)) == 0  # open does not check
    capsys.readouterr()
    assert run_inspect(ns) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "CRC32 mismatch" in err and "lm_head.weight" in err


def test_inspect_refuses_bad_files(hf_dir, tmp_path, capsys):
    out = tmp_path / "tiny.ninfer"
    assert _convert(hf_dir, str(out)) == 0
    data = out.read_bytes()
    cut = tmp_path / "cut.ninfer"
    cut.write_bytes(data[:-10])
    capsys.readouterr()
    assert main(["inspect", str(cut)]) == 1
    assert "truncated" in capsys.readouterr().err
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(1)}, str(plain))
    assert main(["inspect", str(plain)]) == 1
    assert "error: " in capsys.readouterr().err


def test_convert_errors(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _convert(str(empty), str(tmp_path / "o.ninfer")) == 1
    assert "has no config.json" in capsys.readouterr().err

    (empty / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    assert _convert(str(empty), str(tmp_path / "o.ninfer")) == 1
    assert "has no weights" in capsys.readouterr().err

    (empty / "config.json").write_text("{broken")
    assert _convert(str(empty), str(tmp_path / "o.ninfer")) == 1
    assert "config.json is not valid JSON" in capsys.readouterr().err

    assert _convert(str(tmp_path / "nowhere"), str(tmp_path / "o.ninfer")) == 1
    assert "is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "o.ninfer").exists()


def test_convert_index_names_missing_shard(hf_dir, tmp_path, capsys):
    os.remove(os.path.join(hf_dir, "model-00002-of-00002.safetensors"))
    assert _convert(hf_dir, str(tmp_path / "o.ninfer")) == 1
    assert "model-00002-of-00002.safetensors, which is missing" in capsys.readouterr().err


def test_convert_output_directory_missing(hf_dir, tmp_path, capsys):
    assert _convert(hf_dir, str(tmp_path / "no" / "such" / "o.ninfer")) == 1
    assert "does not exist" in capsys.readouterr().err


def test_cli_exit_codes_in_a_subprocess(hf_dir, tmp_path):
    out = str(tmp_path / "sub.ninfer")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ok = subprocess.run(
        [sys.executable, "-m", "ninfer_core.cli", "convert", hf_dir, out],
        capture_output=True,
        text=True,
        env=env,
    )
    assert ok.returncode == 0, ok.stderr
    assert "writing: 100%" in ok.stderr  # stderr is a pipe here: plain progress lines, not a bar
    bad = subprocess.run(
        [sys.executable, "-m", "ninfer_core.cli", "inspect", str(tmp_path / "missing.ninfer")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 1 and bad.stderr.startswith("error: ")


def test_convert_stores_a_proposal_head(hf_dir, tmp_path):
    """--mtp-proposal-head from an HF directory: the rows of lm_head (or the tied embedding) of the
    added tokens and the corpus's most frequent tokens (tests/test_convert_proposal.py: re-writes)."""
    from ninfer_core.artifact.proposal import TOKEN_IDS, WEIGHT

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello hello world " * 20)
    out = str(tmp_path / "p.ninfer")
    assert _convert(hf_dir, out, "--mtp-proposal-head", "6", "--mtp-proposal-corpus", str(corpus)) == 0
    art = Artifact.open(out)
    ids = art.get_tensor(TOKEN_IDS)
    src = art.get_tensor(art.manifest["proposal_head"]["source"])
    assert ids.numel() == 6 and torch.equal(art.get_tensor(WEIGHT), src[ids])
    assert art.tensor_component(WEIGHT) == "mtp"
