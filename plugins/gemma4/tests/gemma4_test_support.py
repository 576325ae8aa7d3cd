"""Helpers the Gemma 4 tests import (a module of its own name: `conftest` is ambiguous when the
repository's tests/ run in the same session)."""


def plugin_flags() -> list[str]:
    """`--plugin ninfer_gemma4.plugin` unless the package is installed (its entry point loads it)."""
    from ninfer_core.testing import plugin_flags as flags

    return flags("gemma4", "ninfer_gemma4.plugin")
