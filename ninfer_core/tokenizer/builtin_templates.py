"""`--chat-template NAME|FILE|SOURCE`: the built-in chat templates and how the option's value resolves.

llama-server takes a built-in template name (`--chat-template chatml`), or with --jinja inline
Jinja source, and a file through --chat-template-file. NInfer reads one value: a built-in name
first, then a file that exists, then inline source (a value holding `{%` or `{{`); anything else
is refused with the list of names. The built-ins are the formats NInfer's model families speak.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from ninfer_core.tokenizer.chat_template import ChatTemplate, TemplateError

# name -> template file under ninfer_core/tokenizer/templates
BUILTIN_TEMPLATES = {"chatml": "chatml.jinja", "qwen35": "qwen35.jinja", "qwen3.5": "qwen35.jinja"}


# The built-in template each first-party architecture's model family speaks; a family plugin may
# instead carry its own as a `chat_template` attribute (source text).
FAMILY_TEMPLATES = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35", "qwen3_5_text": "qwen35",
                    "qwen3_5_moe_text": "qwen35"}


def family_chat_template(family, architecture: str) -> tuple[str, str] | None:
    """(source, where it came from) of the chat template a model family bundles, or None.

    Used when an artifact (or a checkpoint being converted) has no template of its own, so chat
    requests are not refused for a configuration gap the family can fill."""
    source = getattr(family, "chat_template", None) if family is not None else None
    if isinstance(source, str) and source.strip():
        return source, f"the {architecture} model family's template"
    name = FAMILY_TEMPLATES.get(architecture)
    if name is not None:
        return builtin_template_source(name), f"the built-in {name} template of the {architecture} family"
    return None


def builtin_template_source(name: str) -> str:
    return (importlib.resources.files("ninfer_core.tokenizer").joinpath(f"templates/{BUILTIN_TEMPLATES[name]}")
            .read_text(encoding="utf-8"))


def resolve_chat_template(value: str) -> ChatTemplate:
    """The ChatTemplate an option value names; TemplateError with the reason otherwise."""
    if value in BUILTIN_TEMPLATES:
        return ChatTemplate(builtin_template_source(value))
    if Path(value).is_file():
        return ChatTemplate.from_file(value)
    if "{%" in value or "{{" in value:
        return ChatTemplate(value)
    raise TemplateError(f"--chat-template {value!r} is neither a built-in template "
                        f"({', '.join(sorted(BUILTIN_TEMPLATES))}) nor a file")
