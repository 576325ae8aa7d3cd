"""A model family's chat markup as the server reads it: reasoning markers and the tool-call syntax.

The server renders prompts with the artifact's chat template; what it must know about the markup
to read generated text (where reasoning opens and closes, how a tool call is written, what a
prompt ends with to force a call) comes from a `ChatFormat`. A family states its own through
`ModelFamily.chat_format(artifact)`; the loader attaches it to the tokenizer it builds
(`attach`), and every reader finds it with `chat_format_of(tokenizer)`. Without one the default
format applies (the markup of the first family: `<think>` blocks and the XML tool calls of
`ninfer_core.tokenizer.toolcalls`).
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
    """The default syntax: `ninfer_core.tokenizer.toolcalls`."""

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
class ChatFormat:
    name: str
    reasoning_open: str  # the text that opens reasoning in the output (its first token is a control token)
    reasoning_close: str  # the control token that closes it
    # True: a close marker counts only before whitespace or the end (a quoted one stays reasoning);
    # False: every close marker closes (formats whose content follows the marker directly)
    close_needs_space: bool = True
    tools: Any = field(default=None, compare=False)  # a ToolSyntax

    @property
    def reasoning_open_token(self) -> str:
        """The control token that starts `reasoning_open` (what a prompt's token ids show)."""
        return self.reasoning_open.split(">", 1)[0] + ">" if ">" in self.reasoning_open else self.reasoning_open


_DEFAULT: ChatFormat | None = None


def default_format() -> ChatFormat:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = ChatFormat("default", "<think>", "</think>", True, XmlToolSyntax())
    return _DEFAULT


def attach(tokenizer: Any, fmt: ChatFormat | None) -> None:
    """Make `fmt` the chat format every reader of this tokenizer's output uses."""
    if fmt is not None:
        tokenizer.chat_format = fmt


def chat_format_of(tokenizer: Any) -> ChatFormat:
    return getattr(tokenizer, "chat_format", None) or default_format()
