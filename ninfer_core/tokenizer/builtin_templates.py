"""`--chat-template NAME|FILE|SOURCE`: the built-in chat templates and how the option's value resolves.

llama-server takes a built-in template name (`--chat-template chatml`), or with --jinja inline
Jinja source, and a file through --chat-template-file. NInfer reads one value: a built-in name
first, then a file that exists, then inline source (a value holding `{%` or `{{`); anything else
is refused with the list of names. The built-ins are the formats the installed model families
speak: each family plugin registers its own through `ninfer_register_chat_templates` (core ships
none).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ninfer_core.tokenizer.chat_template import ChatTemplate, TemplateError


def builtin_templates(host: Any = None) -> dict:
    """name -> Registration of every built-in template the installed plugins register."""
    if host is None:
        from ninfer_core.plugins import PluginHost, PluginSelection

        host = PluginHost(PluginSelection.from_sources([]))
    return host.registry("chat_template")


def family_chat_template(family, architecture: str) -> tuple[str, str] | None:
    """(source, where it came from) of the chat template a model family bundles, or None.

    Used when an artifact (or a checkpoint being converted) has no template of its own, so chat
    requests are not refused for a configuration gap the family can fill. A family carries its
    template as a `chat_template` attribute (source text)."""
    source = getattr(family, "chat_template", None) if family is not None else None
    if isinstance(source, str) and source.strip():
        return source, f"the {architecture} model family's template"
    return None


def builtin_template_source(name: str, host: Any = None) -> str:
    """The source of the built-in template `name` (KeyError when no installed plugin registers it)."""
    source = builtin_templates(host)[name].load()
    if not isinstance(source, str):
        raise TemplateError(f"the built-in chat template {name!r} is not template source text")
    return source


def resolve_chat_template(value: str, host: Any = None) -> ChatTemplate:
    """The ChatTemplate an option value names; TemplateError with the reason otherwise."""
    names = builtin_templates(host)
    if value in names:
        return ChatTemplate(builtin_template_source(value, host))
    if Path(value).is_file():
        return ChatTemplate.from_file(value)
    if "{%" in value or "{{" in value:
        return ChatTemplate(value)
    listed = ", ".join(sorted(names)) or "none: no installed plugin registers one"
    raise TemplateError(f"--chat-template {value!r} is neither a built-in template ({listed}) nor a file")
