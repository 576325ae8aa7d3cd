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


@hookimpl
def ninfer_register_bench_shapes(register):
    register("gemma4-31b", "ninfer_gemma4.shapes:GEMMA4_31B")
    register("gemma4-26b-a4b", "ninfer_gemma4.shapes:GEMMA4_26B_A4B")
