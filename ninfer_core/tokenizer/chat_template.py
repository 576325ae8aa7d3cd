"""Chat templates: Jinja rendering in a sandbox, and prompt encoding that keeps quoted control tokens text.

A prompt is template markup (turn markers, reasoning markers, ...) around caller data (message content, tool
schemas, tool arguments, template kwargs). Encoding the rendered string with added tokens allowed
would turn a user's quoted turn-end marker into the control token. render_segments() therefore renders
with every added-token spelling inside the data replaced by a sentinel, so the only spellings left
in the output are the template's own; the sentinels are turned back into text afterwards and
encoded as ordinary text. Consequence: a template cannot see added-token spellings in the data
(a "'<marker>' in content" test is false for data that quotes the marker).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Template kwargs that carry tokenizer special tokens: markup, never escaped.
SPECIAL_TOKEN_KWARGS = frozenset({"bos_token", "eos_token", "pad_token", "unk_token"})

# Private-use characters tried as the sentinel delimiter; one absent from data and template is used.
_SENTINEL_CANDIDATES = [chr(c) for c in range(0xE000, 0xE100)]


class TemplateError(ValueError):
    """The chat template could not be compiled or rendered (the message says why)."""


class _RaisedByTemplate(Exception):
    pass


def _raise_exception(message: str):
    raise _RaisedByTemplate(str(message))


def _tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Member order and non-ASCII text are kept: the prompt must show the caller's JSON as sent.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _plain(obj: Any) -> Any:
    """A JSON-like deep copy (mappings -> dict, sequences -> list) so rendering never mutates input."""
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _prepare_messages(messages: Iterable[Mapping]) -> list[dict]:
    """Copy messages; tool-call arguments sent as a JSON object string become that object."""
    out = []
    for message in messages:
        message = _plain(message)
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call.get("function"), dict) else call
            args = function.get("arguments")
            if isinstance(args, str):
                try:
                    parsed = json.loads(args) if args.strip() else {}
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict):
                    function["arguments"] = parsed
        out.append(message)
    return out


def _map_strings(obj: Any, fn) -> Any:
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, dict):
        return {(fn(k) if isinstance(k, str) else k): _map_strings(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_strings(v, fn) for v in obj]
    return obj


class ChatTemplate:
    """A Jinja chat template rendered in an immutable sandbox (Hugging Face conventions)."""

    def __init__(self, source: str):
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template syntax error at line {exc.lineno}: {exc.message}") from None

    @classmethod
    def from_file(cls, path) -> "ChatTemplate":
        try:
            source = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise TemplateError(f"cannot read chat template {path}: {exc.strerror or exc}") from None
        return cls(source)

    def _render(self, context: dict) -> str:
        try:
            return self._template.render(**context)
        except _RaisedByTemplate as exc:
            raise TemplateError(f"chat template refused the request: {exc}") from None
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None

    @staticmethod
    def _context(messages, tools, add_generation_prompt, enable_thinking, kwargs) -> dict:
        return {
            **kwargs,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "enable_thinking": enable_thinking,
        }

    def render(
        self, messages, tools=None, add_generation_prompt: bool = True, enable_thinking: bool = True, **kwargs
    ) -> str:
        """The prompt text. Encode it through render_ids/render_segments, not as one string."""
        context = self._context(
            _prepare_messages(messages), _plain(tools) if tools else None,
            add_generation_prompt, enable_thinking, _plain(kwargs),
        )
        return self._render(context)

    def render_segments(
        self,
        messages,
        tools=None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        *,
        control_tokens: Iterable[str],
        **kwargs,
    ) -> list[tuple[str, bool]]:
        """The prompt as [(text, is_markup)]: markup segments are single control tokens the template
        wrote; text segments (template text and all data) contain no control tokens of the template
        and must be encoded with added tokens disallowed."""
        tokens = sorted({t for t in control_tokens if t}, key=len, reverse=True)
        messages = _prepare_messages(messages)
        tools = _plain(tools) if tools else None
        data_kwargs = {k: _plain(v) for k, v in kwargs.items() if k not in SPECIAL_TOKEN_KWARGS}
        markup_kwargs = {k: v for k, v in kwargs.items() if k in SPECIAL_TOKEN_KWARGS}
        if not tokens:
            text = self.render(messages, tools, add_generation_prompt, enable_thinking, **kwargs)
            return [(text, False)] if text else []

        seen: list[str] = []
        _map_strings([messages, tools, data_kwargs], lambda s: seen.append(s) or s)
        haystack = "".join(seen) + self.source
        mark = next((c for c in _SENTINEL_CANDIDATES if c not in haystack), None)
        if mark is None:
            raise TemplateError("message data uses every private-use sentinel character")
        index = {t: i for i, t in enumerate(tokens)}
        spelled = re.compile("|".join(re.escape(t) for t in tokens))

        def escape(s: str) -> str:
            return spelled.sub(lambda m: f"{mark}{index[m.group()]}{mark}", s)

        messages, tools, data_kwargs = _map_strings([messages, tools, data_kwargs], escape)
        context = {**data_kwargs, **markup_kwargs}
        text = self._render(self._context(messages, tools, add_generation_prompt, enable_thinking, context))

        segments: list[tuple[str, bool]] = []
        buf: list[str] = []
        pos = 0
        for m in re.finditer(f"{mark}(\\d+){mark}|" + spelled.pattern, text):
            buf.append(text[pos:m.start()])
            pos = m.end()
            if m.group(1) is not None:
                buf.append(tokens[int(m.group(1))])
            else:
                if any(buf):
                    segments.append(("".join(buf), False))
                buf = []
                segments.append((m.group(), True))
        buf.append(text[pos:])
        if any(buf):
            segments.append(("".join(buf), False))
        return segments

    def render_ids(
        self,
        tokenizer,
        messages,
        tools=None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        **kwargs,
    ) -> list[int]:
        """Render and encode: template markup as control tokens, all data as plain text.

        The control tokens are `tokenizer.added_tokens` (text -> id); a tokenizer without that
        mapping gets the rendered string encoded with added tokens allowed (no escaping)."""
        added = getattr(tokenizer, "added_tokens", None)
        if added is None:
            text = self.render(messages, tools, add_generation_prompt, enable_thinking, **kwargs)
            return tokenizer.encode(text, allow_special=True)
        ids: list[int] = []
        segments = self.render_segments(
            messages, tools, add_generation_prompt, enable_thinking, control_tokens=list(added), **kwargs
        )
        for text, is_markup in segments:
            ids.extend(tokenizer.encode(text, allow_special=is_markup))
        return ids


def render_ids(
    tokenizer,
    messages,
    tools=None,
    add_generation_prompt: bool = True,
    enable_thinking: bool = True,
    template: ChatTemplate | None = None,
    **kwargs,
) -> list[int]:
    """Encode a chat with `template` (required: core has no template of its own).

    See ChatTemplate.render_ids; `tokenizer` needs encode() and an added_tokens mapping."""
    if template is None:
        raise TemplateError("render_ids needs a chat template")
    return template.render_ids(tokenizer, messages, tools, add_generation_prompt, enable_thinking, **kwargs)
