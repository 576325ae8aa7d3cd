"""Hook implementations of ninfer-example. Importing this module imports neither torch nor the model."""

from __future__ import annotations

from ninfer_core import hookimpl


def decay(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"must be in [0, 1), got {value}")
    return value


@hookimpl
def ninfer_register_model_families(register):
    register("example", "ninfer_example.family:ExampleFamily", architectures=["example_lm"])


@hookimpl
def ninfer_add_serve_options(add):
    add("--example-decay", type=decay, default=None, metavar="D",
        help="the running sum's decay per token, in [0, 1) (default: the artifact's)")
