"""Helpers the Gemma 4 tests import (a module of its own name: `conftest` is ambiguous when the
repository's tests/ run in the same session)."""


def plugin_flags() -> list[str]:
    """`--plugin ninfer_gemma4.plugin` unless the package is installed (its entry point loads it)."""
    from importlib.metadata import entry_points

    if any(ep.name == "gemma4" for ep in entry_points(group="ninfer")):
        return []
    return ["--plugin", "ninfer_gemma4.plugin"]
