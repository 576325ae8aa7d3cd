"""The first family's chat format as the representative fixture of core's tests.

Core names no family (tests/test_core_names_no_family.py); its tests still need a real format to
exercise reasoning, tool calls, turn markers and cache breakpoints, and the one every fixture here
was written against is Qwen3.5's (ChatML turns, `<think>` blocks, XML tool calls). It lives in
plugins/qwen35 (`ninfer_qwen35.chat`, torch-free); with the plugin not installed (CI's core-only
run) the module is read from this checkout, so core's tests run the same either way.
"""

from __future__ import annotations

import base64
import importlib.util
import sys
from pathlib import Path

try:
    import ninfer_qwen35.chat as chat
except ImportError:  # core-only: the plugin's format module from the checkout
    _path = Path(__file__).resolve().parent.parent / "plugins" / "qwen35" / "ninfer_qwen35" / "chat.py"
    _spec = importlib.util.spec_from_file_location("_qwen35_chat_fixture", _path)
    chat = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = chat
    _spec.loader.exec_module(chat)

from ninfer_core.tokenizer.chat_format import attach

QWEN35_TEMPLATE: str = chat.QWEN35_TEMPLATE
CHATML_TEMPLATE: str = chat.CHATML_TEMPLATE
QWEN35_CHAT_FORMAT = chat.QWEN35_CHAT_FORMAT
SAMPLING_PRESETS = chat.SAMPLING_PRESETS
qwen35_tokenizer_section = chat.qwen35_tokenizer_section


def with_format(tokenizer):
    """`tokenizer` with the Qwen3.5 chat format attached (what the family's loader does)."""
    attach(tokenizer, QWEN35_CHAT_FORMAT)
    return tokenizer


def qwen35_tokenizer():
    from ninfer_core.tokenizer.bpe import Tokenizer

    return with_format(Tokenizer.from_section(qwen35_tokenizer_section()))


def sampling_presets() -> dict:
    return {k: dict(v) for k, v in SAMPLING_PRESETS.items()}


def byte_tokenizer_section() -> dict:
    """A real byte-level BPE section (256 byte tokens) with the Qwen control tokens after them."""
    added = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
             "</tool_call>", "<tool_response>", "</tool_response>"]
    ranks = "".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256))
    return {"type": "bpe", "ranks": ranks,
            "pattern": r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
            "added_tokens": [{"id": 256 + i, "content": c, "special": c.startswith("<|")}
                             for i, c in enumerate(added)],
            "eos_tokens": ["<|im_end|>"], "pad_token": "<|endoftext|>", "bos_token": None}
