"""Streaming split of generated text into the reasoning and content channels.

The open and close markers are the model's (its family's `ChatFormat`); without them (None) all
text is content. Rules (spec, "OpenAI Chat Completions"):
- Reasoning is open from the start when the prompt ended inside a reasoning block
  (in_reasoning=True), or when the output begins with the open marker. One "\\n" right after the
  opening belongs to the format.
- Reasoning closes only at a close marker followed by whitespace or the end of output (with
  close_needs_space; otherwise at any close marker); a marker the model quotes while reasoning
  (followed by anything else) stays reasoning text.
- The "\\n\\n" (or single "\\n") right after the closing marker belongs to the format, not the content.
- After reasoning closes, everything is content, including any further markers.
Only a suffix that may still become a marker (or the format newlines around one) is held back;
finish() flushes it.
"""

from __future__ import annotations

_CLOSE_FOLLOWERS = frozenset(" \t\r\n\f\v")

_START, _REASONING_START, _REASONING, _AFTER_CLOSE, _CONTENT = range(5)


class ReasoningSplitter:
    """Feed generated text chunks; get ("reasoning"|"content", text) pieces in output order."""

    def __init__(self, in_reasoning: bool, open_marker: str | None, close_marker: str | None,
                 close_needs_space: bool = True):
        # the markers come from the model's chat format (ninfer_core.tokenizer.chat_format)
        if not (open_marker and close_marker):
            self._state = _CONTENT
        else:
            self._state = _REASONING_START if in_reasoning else _START
        self._buf = ""
        self._open, self._close, self._needs_space = open_marker, close_marker, close_needs_space

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far leaves the output inside the reasoning block."""
        return self._state in (_REASONING_START, _REASONING)

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        self._run(out, final=False)
        return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._run(out, final=True)
        return out

    @staticmethod
    def _emit(out: list, kind: str, text: str) -> None:
        if not text:
            return
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))

    def _run(self, out: list, final: bool) -> None:
        while True:
            buf = self._buf
            state = self._state
            if state == _START:
                if buf.startswith(self._open):
                    self._buf = buf[len(self._open):]
                    self._state = _REASONING_START
                elif self._open.startswith(buf) and not final:
                    return
                else:
                    self._state = _CONTENT
            elif state == _REASONING_START:
                if not buf:
                    return
                if buf[0] == "\n":
                    self._buf = buf[1:]
                self._state = _REASONING
            elif state == _REASONING:
                if self._scan_reasoning(out, final):
                    return
            elif state == _AFTER_CLOSE:
                if buf.startswith("\n\n"):
                    self._buf = buf[2:]
                elif buf == "\n" and not final:
                    return
                elif buf.startswith("\n"):
                    self._buf = buf[1:]
                elif not buf and not final:
                    return
                self._state = _CONTENT
            else:
                self._emit(out, "content", buf)
                self._buf = ""
                return

    def _scan_reasoning(self, out: list, final: bool) -> bool:
        """Emit reasoning up to a closing marker; True when waiting for more text."""
        buf = self._buf
        close = self._close
        start = 0
        while True:
            idx = buf.find(close, start)
            if idx < 0:
                break
            after = idx + len(close)
            if after == len(buf) and self._needs_space:
                self._emit(out, "reasoning", buf[:idx])
                if final:
                    self._buf = ""
                    self._state = _CONTENT
                    return False
                self._buf = buf[idx:]
                return True
            if not self._needs_space or buf[after] in _CLOSE_FOLLOWERS:
                self._emit(out, "reasoning", buf[:idx])
                self._buf = buf[after:]
                self._state = _AFTER_CLOSE
                return False
            start = idx + 1
        hold = 0
        if not final:
            for k in range(min(len(close) - 1, len(buf)), 0, -1):
                if buf.endswith(close[:k]):
                    hold = k
                    break
        self._emit(out, "reasoning", buf[: len(buf) - hold])
        self._buf = buf[len(buf) - hold:]
        return True
