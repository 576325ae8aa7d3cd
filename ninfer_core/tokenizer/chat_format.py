"""A model family's chat markup as the server reads it: turns, reasoning, tool calls, presets.

The server renders prompts with the artifact's chat template; what it must know about the markup
to read generated text (where reasoning opens and closes, how a tool call is written, what a
prompt ends with to force a call), where the messages of a rendered prompt start (context-cache
hints and cache breakpoints), how to pose a relevance judgement (/v1/rerank) and which sampler
presets apply comes from a `ChatFormat`. A family states its own through
`ModelFamily.chat_format(artifact)`; the loader attaches it to the tokenizer it builds
(`attach`), and every reader finds it with `chat_format_of(tokenizer)`. Core names no family's
markup: without a stated format the plain one applies (no reasoning channel, no tool-call syntax,
no turn opener, so none of those features read anything).

`XmlToolSyntax` is one reusable tool-call syntax (the `<tool_call>`/`<function=...>` form of
`ninfer_core.tokenizer.toolcalls`) a family may select; core never selects it itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class ToolSyntax(Protocol):
    """What the streaming output decoder needs from a tool-call syntax (see toolcalls.py for the
    meaning of each function; a family's syntax implements the same contract)."""

    markers: tuple[str, ...]
    forced_closers: tuple[str, ...]  # closing text tried, in order, after a forced call's output

    def find_markers(self, text: str, start: int = 0, limit: int = ...) -> list[int]: ...
    def marker_prefix_len(self, text: str) -> int: ...
    def opens_function(self, text: str, pos: int) -> bool | None: ...
    def parse(self, text: str, schemas, *, max_markers: int = ..., undeclared_as_text: bool = False): ...
    def forced_opener(self, name: str) -> str: ...
    def forced_ids(self, tokenizer, name: str) -> list[int]: ...


class XmlToolSyntax:
    """The XML function-call syntax of `ninfer_core.tokenizer.toolcalls`, for families that write it."""

    forced_closers = ("", "\n</function>\n</tool_call>", "\n</parameter>\n</function>\n</tool_call>",
                      "\n</tool_call>")

    def __init__(self):
        from ninfer_core.tokenizer import toolcalls

        self._m = toolcalls
        self.markers = toolcalls.MARKERS

    def find_markers(self, text, start=0, limit=None):
        return self._m.find_markers(text, start, self._m.MAX_MARKERS if limit is None else limit)

    def marker_prefix_len(self, text):
        return self._m.marker_prefix_len(text)

    def opens_function(self, text, pos):
        return self._m.opens_function(text, pos)

    def parse(self, text, schemas, *, max_markers=None, undeclared_as_text=False):
        return self._m.parse_tool_calls(text, schemas, max_markers=max_markers or self._m.MAX_MARKERS,
                                        undeclared_as_text=undeclared_as_text)

    def forced_opener(self, name):
        return f"<tool_call>\n<function={name}>\n"

    def forced_ids(self, tokenizer, name):
        head = tokenizer.encode("<tool_call>", allow_special=True)
        return head + tokenizer.encode(f"\n<function={name}>\n", allow_special=False)


@dataclass(frozen=True)
class JudgePrompt:
    """A relevance-judgement prompt in the family's turn markup (/v1/rerank): `head` holds the
    `{system}` placeholder and opens the user turn the query and document go into as text; `tail`
    closes it and opens the answer (with reasoning already closed where the format has it)."""

    head: str
    tail: str


@dataclass(frozen=True)
class ChatFormat:
    name: str
    reasoning_open: str | None = None  # the text that opens reasoning (its first token is a control token)
    reasoning_close: str | None = None  # the control token that closes it
    # True: a close marker counts only before whitespace or the end (a quoted one stays reasoning);
    # False: every close marker closes (formats whose content follows the marker directly)
    close_needs_space: bool = True
    tools: Any = field(default=None, compare=False)  # a ToolSyntax, or None: tool calls are not read
    # the control token every rendered message starts with (None: no message boundaries are known),
    # the role names that follow it, and the text a tool result in a user turn opens with
    turn_opener: str | None = None
    assistant_role: str = "assistant"
    user_role: str = "user"
    system_role: str = "system"
    tool_result_open: str | None = None
    judge: JudgePrompt | None = field(default=None, compare=False)
    # sampler presets {"thinking": {...}, "non_thinking": {...}} the family recommends, or None
    sampling: dict | None = field(default=None, compare=False)

    @property
    def reasoning_open_token(self) -> str | None:
        """The control token that starts `reasoning_open` (what a prompt's token ids show)."""
        if self.reasoning_open is None:
            return None
        return self.reasoning_open.split(">", 1)[0] + ">" if ">" in self.reasoning_open else self.reasoning_open

    @property
    def has_reasoning(self) -> bool:
        return bool(self.reasoning_open and self.reasoning_close)


PLAIN = ChatFormat("plain")


def default_format() -> ChatFormat:
    """The format of a tokenizer no family stated one for: no markup is read."""
    return PLAIN


def attach(tokenizer: Any, fmt: ChatFormat | None) -> None:
    """Make `fmt` the chat format every reader of this tokenizer's output uses."""
    if fmt is not None:
        tokenizer.chat_format = fmt


def chat_format_of(tokenizer: Any) -> ChatFormat:
    return getattr(tokenizer, "chat_format", None) or default_format()


def token_id(tokenizer: Any, text: str | None) -> int | None:
    """`text`'s id as one control token of `tokenizer`, or None (no text, no such token)."""
    if not text or tokenizer is None:
        return None
    to_id = getattr(tokenizer, "token_to_id", None)
    return to_id(text) if callable(to_id) else None


def turn_opener_id(tokenizer: Any) -> int | None:
    """The id of the control token every rendered message starts with, per the tokenizer's format."""
    return token_id(tokenizer, chat_format_of(tokenizer).turn_opener)
