"""Hook implementations of the Gemma 4 family plugin. Importing this module never imports torch."""

from __future__ import annotations

from ninfer_core import hookimpl

ARCHITECTURES = ["gemma4", "gemma4_text"]


@hookimpl
def ninfer_register_model_families(register):
    register("gemma4", "ninfer_gemma4.family:Gemma4Family", architectures=list(ARCHITECTURES))


@hookimpl
def ninfer_register_chat_templates(register):
    """`--chat-template gemma4`: the family's template (the one `ninfer convert` stores when a
    checkpoint has none)."""
    register("gemma4", "ninfer_gemma4.chat:GEMMA4_TEMPLATE")
