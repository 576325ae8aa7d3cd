"""Helpers the Flash-Next tests import (a module of its own name: `conftest` is ambiguous when the
repository's tests/ run in the same session)."""


def plugin_flags() -> list[str]:
    """`--plugin ninfer_flash_next.plugin` unless the package is installed (its entry point loads it)."""
    from importlib.metadata import entry_points

    if any(ep.name == "flash_next" for ep in entry_points(group="ninfer")):
        return []
    return ["--plugin", "ninfer_flash_next.plugin"]
