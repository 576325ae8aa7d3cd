"""The version string: <VERSION>+<build id> (spec: Server version)."""

from __future__ import annotations

import functools
import os
import subprocess
from importlib import metadata
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


def _read_version() -> str:
    f = _ROOT / "VERSION"
    if f.is_file():
        return f.read_text().strip()
    try:
        return metadata.version("ninfer-core")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from an unpacked tree
        return "0.0.0"


VERSION = _read_version()


@functools.lru_cache(maxsize=1)
def build_string() -> str:
    """VERSION+build id; the id is NINFER_BUILD_ID or `git describe --always --tags --dirty`."""
    build = os.environ.get("NINFER_BUILD_ID")
    if not build and (_ROOT / ".git").exists():
        try:
            build = subprocess.run(
                ["git", "describe", "--always", "--tags", "--dirty"],
                cwd=_ROOT, capture_output=True, text=True, timeout=5,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            build = ""
    return f"{VERSION}+{build}" if build else VERSION
