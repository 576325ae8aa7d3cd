"""The shared streaming output decoder: generated text -> reasoning, content and tool calls.

Every chat protocol (Chat Completions, Responses, Anthropic Messages) reads generated text
through one `OutputDecoder`:

```python
dec = OutputDecoder(in_reasoning=prompt.opens_reasoning, tools=plan.tools,
                    parallel_tool_calls=True, id_prefix="call_")
for piece in engine_text_deltas:
    for ev in dec.feed(piece):      # OutputEvent(kind="reasoning"|"content", text=...)
        ...
for ev in dec.finish():             # the rest of the content, then OutputEvent("tool_call", tool_call=ToolCall)
    ...
dec.reasoning, dec.content, dec.tool_calls   # aggregates (equal to the concatenated events)
dec.parse                                      # ParseResult diagnostics after finish() (no text in logs!)
```

- Reasoning/content split: `ReasoningSplitter` with the markers of the model's `ChatFormat` (a
  close marker quoted inside reasoning stays reasoning; the format newlines around the close are
  dropped). A format without reasoning markers has no reasoning channel.
- Without `tools` (None or empty: no tools, or tool_choice none), or with a format that states no
  tool-call syntax, content passes through as is.
- With `tools`, content streams immediately except (a) a suffix that may still become a tool-call
  marker, (b) trailing whitespace (dropped if a call follows it), and (c) everything from the first
  marker whose region opens a function: that region is held to the end, because only the whole
  answer decides whether it is the structured turn or quoted markup (see
  `ninfer_core.tokenizer.toolcalls`). Markup that never opens a function is released as text.
- Tool calls are emitted by `finish()`, each once, in order, with a fresh id (`id_prefix` + 24 hex).
  Arguments are JSON text with the members in generated order; parameter values typed by the
  tool's declared JSON-schema types. A call that cannot be read is a call to `malformed_tool_call`.
- `parallel_tool_calls=False` keeps only the first call.
- `forced_call`: the call opener the prompt ended with (tool_choice forcing a function, e.g.
  "<tool_call>\\n<function=NAME>\\n"); the output continues that call, and the closing tags the
  model leaves out at the end are supplied (`parse.forced_call_closed`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from ninfer_core.tokenizer.chat_format import ChatFormat, chat_format_of, default_format, token_id
from ninfer_core.tokenizer.reasoning import ReasoningSplitter
from ninfer_core.tokenizer.toolcalls import MAX_MARKERS, ParseResult, schema_map

_WS = " \t\r\n"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, member order preserved


@dataclass
class OutputEvent:
    kind: str  # "reasoning" | "content" | "tool_call"
    text: str = ""
    tool_call: ToolCall | None = None


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


class OutputDecoder:
    """Streaming decoder of one choice's generated text (see the module docstring)."""

    def __init__(self, *, in_reasoning: bool, tools: list[dict] | None = None,
                 parallel_tool_calls: bool = True, id_prefix: str = "call_",
                 forced_call: str | None = None, undeclared_as_text: bool = False,
                 chat_format: ChatFormat | None = None):
        fmt = chat_format or default_format()
        self._syntax = fmt.tools
        self._longest = max((len(m) for m in fmt.tools.markers), default=0) if fmt.tools is not None else 0
        self._splitter = ReasoningSplitter(in_reasoning and fmt.has_reasoning, fmt.reasoning_open,
                                           fmt.reasoning_close, fmt.close_needs_space)
        self._schemas = schema_map(tools) if (tools and fmt.tools is not None) else None
        self._parallel = parallel_tool_calls
        self._undeclared_as_text = undeclared_as_text
        self._id_prefix = id_prefix
        self._forced = forced_call if (forced_call and self._schemas is not None) else None
        self._text = self._forced or ""  # the content channel as generated (forced opener first)
        self._emitted = 0  # chars of _text already published as content
        self._scan = len(self._text)  # where the next marker search starts
        self._markers = 0  # markers passed over as text (they never opened a function)
        self._region: int | None = 0 if self._forced else None  # held structured region start
        self._finished = False
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[ToolCall] = []
        self.parse: ParseResult | None = None
        self.forced_call_closed = False

    @property
    def parses_tools(self) -> bool:
        return self._schemas is not None

    @property
    def in_reasoning(self) -> bool:
        return self._splitter.in_reasoning

    def feed(self, text: str) -> list[OutputEvent]:
        """Events this text makes publishable (possibly none)."""
        if self._finished:
            raise RuntimeError("OutputDecoder.feed after finish")
        out: list[OutputEvent] = []
        self._pieces(self._splitter.feed(text), out, final=False)
        return out

    def finish(self) -> list[OutputEvent]:
        """Flush everything held; parse the tool-call region; emit the calls."""
        if self._finished:
            return []
        out: list[OutputEvent] = []
        self._pieces(self._splitter.finish(), out, final=True)
        self._finished = True
        if self._schemas is None:
            return out
        self.parse = self._final_parse()
        final_content = self.parse.content
        published = self._text[: self._emitted]
        if final_content.startswith(published):
            self._emit(out, "content", final_content[len(published):])
        calls = self.parse.calls if self._parallel else self.parse.calls[:1]
        for c in calls:
            call = ToolCall(new_call_id(self._id_prefix), c.name, c.arguments)
            self.tool_calls.append(call)
            out.append(OutputEvent("tool_call", tool_call=call))
        return out

    # -- internals ------------------------------------------------------------------------------
    def _final_parse(self) -> ParseResult:
        text = self._text
        parse = self._syntax.parse
        if self._forced is None:
            return parse(text, self._schemas, undeclared_as_text=self._undeclared_as_text)
        stripped = text.rstrip(_WS)
        for closers in self._syntax.forced_closers:
            res = parse(stripped + closers, self._schemas, max_markers=1, undeclared_as_text=self._undeclared_as_text)
            if res.calls and not res.recovered:
                self.forced_call_closed = bool(closers)
                return res
        return parse(text, self._schemas, max_markers=1, undeclared_as_text=self._undeclared_as_text)

    def _emit(self, out: list[OutputEvent], kind: str, text: str) -> None:
        if not text:
            return
        if kind == "reasoning":
            self.reasoning += text
        else:
            self.content += text
        if out and out[-1].kind == kind and kind != "tool_call":
            out[-1].text += text
        else:
            out.append(OutputEvent(kind, text))

    def _pieces(self, pieces: list[tuple[str, str]], out: list[OutputEvent], final: bool) -> None:
        for kind, text in pieces:
            if kind == "reasoning":
                self._emit(out, "reasoning", text)
            elif self._schemas is None:
                self._emit(out, "content", text)
            else:
                self._text += text
                self._advance(out, final=False)
        if final and self._schemas is not None:
            self._advance(out, final=True)

    def _publish_to(self, out: list[OutputEvent], end: int) -> None:
        if end > self._emitted:
            self._emit(out, "content", self._text[self._emitted:end])
            self._emitted = end

    def _content_end(self, end: int) -> int:
        """`end` moved back over trailing whitespace (held: a call may follow it), not below what
        is already published."""
        text = self._text
        while end > self._emitted and text[end - 1] in _WS:
            end -= 1
        return end

    def _advance(self, out: list[OutputEvent], final: bool) -> None:
        """Publish the content that can no longer belong to a tool-call region."""
        if self._region is not None:
            return
        text = self._text
        while True:
            if self._markers >= MAX_MARKERS:  # no further marker is tried: the rest is text
                self._publish_to(out, len(text))
                return
            found = self._syntax.find_markers(text, self._scan, 1)
            if not found:
                # no complete marker starts before here: later ones start near the end
                self._scan = max(self._scan, len(text) - self._longest + 1)
                if final:
                    return
                self._publish_to(out, self._content_end(len(text) - self._syntax.marker_prefix_len(text)))
                return
            pos = found[0]
            state = self._syntax.opens_function(text, pos)
            if state is True:
                self._region = pos
                self._publish_to(out, self._content_end(pos))
                return
            if state is None and not final:
                self._publish_to(out, self._content_end(pos))
                return
            self._markers += 1
            self._scan = pos + 1


# -- token log probabilities (spec "Token log probabilities") ----------------------------------


class LogprobChannel:
    """Keeps the records of content-channel tokens: after the reasoning block and the whitespace
    that closes it (tool-call markup included); reasoning tokens have none.

    `take(token_ids, records)` with a delta event's ids and `logprobs` (records exist only for
    sampled tokens, in order) returns the records to publish."""

    def __init__(self, tokenizer, in_reasoning: bool):
        self._tok = tokenizer
        fmt = chat_format_of(tokenizer)
        self._open = token_id(tokenizer, fmt.reasoning_open_token)
        self._close = token_id(tokenizer, fmt.reasoning_close)
        self._state = "reasoning" if (in_reasoning and self._close is not None) else "start"

    def take(self, token_ids: list[int], records: list | None) -> list:
        queue = list(records or [])
        out = []
        for t in token_ids:
            record = queue.pop(0) if queue and queue[0].token_id == t else None
            if self._state == "start":
                if t == self._open and self._open is not None:
                    self._state = "reasoning"
                    continue
                self._state = "content"
            if self._state == "reasoning":
                if t == self._close:
                    self._state = "closing"
                continue
            if self._state == "closing":
                if self._tok.token_bytes(t).strip() == b"":
                    continue
                self._state = "content"
            if record is not None:
                out.append(record)
        return out


def logprob_json(tokenizer, record, with_bytes: bool = True) -> dict:
    """One OpenAI logprob entry: token (U+FFFD for bytes that are not UTF-8 on their own), logprob,
    bytes, top_logprobs (Responses deltas pass with_bytes=False)."""

    def entry(token_id: int, logprob: float) -> dict:
        raw = tokenizer.token_bytes(token_id)
        d = {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob}
        if with_bytes:
            d["bytes"] = list(raw)
        return d

    out = entry(record.token_id, record.logprob)
    out["top_logprobs"] = [entry(i, lp) for i, lp in record.top]
    return out
