"""Hook implementations of the Qwen3.5 family plugin. Importing this module never imports torch."""

from __future__ import annotations

from ninfer_core import hookimpl

ARCHITECTURES = ["qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"]


@hookimpl
def ninfer_register_model_families(register):
    register("qwen35", "ninfer_qwen35.family:Qwen35Family", architectures=list(ARCHITECTURES))


@hookimpl
def ninfer_register_chat_templates(register):
    """The built-in names of the formats this family speaks (`--chat-template NAME`)."""
    register("qwen35", "ninfer_qwen35.chat:QWEN35_TEMPLATE")
    register("qwen3.5", "ninfer_qwen35.chat:QWEN35_TEMPLATE")
    register("chatml", "ninfer_qwen35.chat:CHATML_TEMPLATE")


@hookimpl
def ninfer_register_bench_shapes(register):
    register("qwen3.5-9b", "ninfer_qwen35.shapes:QWEN35_9B", default=True)
    register("qwen3.5-27b", "ninfer_qwen35.shapes:QWEN35_27B")
    register("qwen3.5-35b-a3b", "ninfer_qwen35.shapes:QWEN35_35B_A3B")


@hookimpl
def ninfer_default_artifact(cache_dir):
    """The small random-weight Qwen3.5 model `ninfer serve` runs when no artifact is named."""
    from ninfer_qwen35.default_model import ensure_default_artifact

    return ensure_default_artifact(cache_dir)


@hookimpl
def ninfer_add_serve_options(add):
    add("--gdn-state-fp16", action="store_true", default=False,
        help="keep the GDN recurrent state of StateImages (checkpoints, Host tier, slot and disk files) in FP16, "
             "which halves each Host StateImage (quality trades; default: FP32)")
