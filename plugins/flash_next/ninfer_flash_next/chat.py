"""Flash-Next's chat format, template and sampler presets (the family states them to core through
`FlashNextFamily.chat_format` / `sampling_presets` / `chat_template`).

The model speaks the Qwen3.5 markup (its checkpoints ship the same template), kept here as this
family's own copy so that the plugin depends on ninfer-core only:
- turns `<|im_start|>ROLE\\n ... <|im_end|>\\n`; tool results are user turns opening with
  `<tool_response>`;
- reasoning `<think>\\n ... \\n</think>\\n\\n` (a close counts before whitespace or the end);
- tool calls in the XML function form (`ninfer_core.tokenizer.toolcalls`);
- sampler presets (spec "Server options"): thinking 1.0/0.95/20/0/0, non-thinking 0.7/0.8/20/0/1.5.

Importing this module never imports torch.
"""

from __future__ import annotations

from pathlib import Path

from ninfer_core.tokenizer.chat_format import ChatFormat, JudgePrompt, XmlToolSyntax

THINKING = {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0}
NON_THINKING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0,
                "presence_penalty": 1.5, "frequency_penalty": 0.0}
SAMPLING_PRESETS = {"thinking": THINKING, "non_thinking": NON_THINKING}

# used by `ninfer convert` when a checkpoint has no chat template of its own
FLASH_NEXT_TEMPLATE: str = (Path(__file__).resolve().parent / "templates" / "flash_next.jinja").read_text(
    encoding="utf-8")

FLASH_NEXT_CHAT_FORMAT = ChatFormat(
    "flash_next", "<think>", "</think>", close_needs_space=True, tools=XmlToolSyntax(),
    turn_opener="<|im_start|>", tool_result_open="<tool_response>",
    judge=JudgePrompt(head="<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n",
                      tail="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    sampling=SAMPLING_PRESETS,
)
