"""No module of `ninfer_core` is over 600 lines (issue 23: a module past that is split by
responsibility, as engine/cache.py and engine/engine.py were).

Lines are counted as `wc -l` counts them (newline characters), over every `.py` file of the
package, generated or not.
"""

from __future__ import annotations

from pathlib import Path

import ninfer_core

MAX_LINES = 600
CORE = Path(ninfer_core.__file__).resolve().parent


def oversized(root: Path, limit: int = MAX_LINES) -> list[str]:
    """'path: N lines' for each .py file under root longer than `limit` lines, longest first."""
    found = []
    for path in root.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        n = path.read_bytes().count(b"\n")
        if n > limit:
            found.append((n, path.relative_to(root.parent).as_posix()))
    return [f"{p}: {n} lines" for n, p in sorted(found, reverse=True)]


def test_no_module_in_ninfer_core_is_over_600_lines():
    modules = [p for p in CORE.rglob("*.py") if "__pycache__" not in p.parts]
    assert len(modules) > 100  # the whole package is measured, not an empty directory
    over = oversized(CORE)
    assert not over, f"modules over {MAX_LINES} lines (split them by responsibility): " + "; ".join(over)


def test_the_check_names_each_long_file_and_its_length(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "short.py").write_text("x = 1\n" * 600)
    (pkg / "sub" / "long.py").write_text("x = 1\n" * 601)
    (pkg / "longer.py").write_text("x = 1\n" * 700)
    (pkg / "notes.txt").write_text("x\n" * 900)  # only Python modules count
    assert oversized(pkg) == ["pkg/longer.py: 700 lines", "pkg/sub/long.py: 601 lines"]
