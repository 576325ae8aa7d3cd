"""The ninfer-tiny plugin: `ninfer serve` with no artifact serves the trained model when shipped.

Ordering: `ninfer_default_artifact` is a firstresult hook and pluggy calls implementations
marked `tryfirst` before unmarked ones (the qwen35 random default is unmarked), whatever order
the entry points were loaded in. So a packaged trained artifact wins, and without one this hook
answers None and the next implementation (the random default) answers.
"""

from __future__ import annotations

from ninfer_core import hookimpl


def packaged_artifact() -> str | None:
    """The artifact shipped inside the package, or None when the package has none."""
    from ninfer_tiny.train import package_artifact_path

    path = package_artifact_path()
    return str(path) if path.is_file() else None


@hookimpl(tryfirst=True)
def ninfer_default_artifact(cache_dir):
    """The trained ninfer-tiny artifact when the package ships one; otherwise None."""
    return packaged_artifact()
