"""Helpers the Flash-Next tests import (a module of its own name: `conftest` is ambiguous when the
repository's tests/ run in the same session)."""


def plugin_flags() -> list[str]:
    """`--plugin ninfer_flash_next.plugin` unless the package is installed (its entry point loads it)."""
    from ninfer_core.testing import plugin_flags as flags

    return flags("flash_next", "ninfer_flash_next.plugin")
