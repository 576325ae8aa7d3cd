"""docs/plugins/ stays true: every hook spec has a heading there (datasette's habit), every page is
linked from the index, and the tutorial quotes each file of tests/plugins/example_family verbatim."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from ninfer_core import hookspecs

DOCS = Path(__file__).resolve().parents[1] / "docs" / "plugins"
EXAMPLE = Path(__file__).resolve().parent / "plugins" / "example_family"
HOOKS = sorted(n for n, f in vars(hookspecs).items() if n.startswith("ninfer_") and inspect.isfunction(f))


def headings() -> dict[str, list[str]]:
    return {p.name: re.findall(r"^#{1,4} (.+)$", p.read_text(), flags=re.MULTILINE) for p in DOCS.glob("*.md")}


def test_the_hook_list_is_not_empty():
    assert "ninfer_register_model_families" in HOOKS and "ninfer_default_artifact" in HOOKS


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_spec_has_a_docs_heading(hook):
    found = [page for page, hs in headings().items() if any(re.match(rf"`?{hook}\b", h) for h in hs)]
    assert found, f"no heading in docs/plugins/*.md names the hook {hook} (add `## {hook}(...)` to its page)"


def test_every_page_is_linked_from_the_index():
    index = (DOCS / "index.md").read_text()
    missing = [p.name for p in DOCS.glob("*.md") if p.name != "index.md" and f"({p.name})" not in index]
    assert not missing, f"docs/plugins/index.md links none of {missing}"


def quoted_files() -> dict[str, str]:
    text = (DOCS / "tutorial.md").read_text()
    return dict(re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```\n", text, flags=re.DOTALL))


def test_the_tutorial_quotes_every_file_of_the_example_verbatim():
    quoted = quoted_files()
    files = sorted(str(p.relative_to(EXAMPLE)) for p in EXAMPLE.rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".toml"))
    assert sorted(quoted) == files, "the tutorial and tests/plugins/example_family list different files"
    for rel, text in quoted.items():
        assert text == (EXAMPLE / rel).read_text(), f"docs/plugins/tutorial.md quotes an old {rel}"
