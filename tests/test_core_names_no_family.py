"""Core knows no model family: no file of the `ninfer_core` package names one or its markup.

What a family's prompts and answers look like (turn markers, reasoning and tool-call syntax, the
forced-call opener, the judging prompt of /v1/rerank, sampler presets, templates, tokenizer
sections, bench shapes) comes from the family plugin (`ModelFamily.chat_format`, the
`ninfer_register_chat_templates` and `ninfer_register_bench_shapes` hooks). Every file is read,
code, comments, docstrings and data alike, case-insensitively.
"""

from __future__ import annotations

import re
from pathlib import Path

import ninfer_core

# The names and markup of the families the project ships (issue 16's list).
FORBIDDEN = re.compile(r"<\|im_start\|>|<think>|qwen|gemma", re.IGNORECASE)
CORE = Path(ninfer_core.__file__).resolve().parent


def offending_lines(root: Path) -> list[str]:
    hits = []
    for path in sorted(root.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # a binary file: its bytes are searched as latin-1
            text = path.read_bytes().decode("latin-1")
        for n, line in enumerate(text.splitlines(), 1):
            m = FORBIDDEN.search(line)
            if m:
                hits.append(f"{path.relative_to(root.parent)}:{n}: {m.group(0)!r} in {line.strip()[:100]}")
    return hits


def test_no_file_in_ninfer_core_names_a_family_or_its_markup():
    files = [p for p in CORE.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert len(files) > 100  # the whole package is searched, not an empty directory
    hits = offending_lines(CORE)
    assert not hits, "ninfer_core names a model family or its markup:\n" + "\n".join(hits)


def test_the_search_finds_each_name_in_any_case(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "clean.py").write_text("x = 1  # nothing here\n")
    (pkg / "a.py").write_text("OPEN = '<think>'\n")
    (pkg / "sub" / "b.jinja").write_text("{{- '<|IM_START|>' -}}\n")
    (pkg / "sub" / "c.md").write_text("served by ninfer-Qwen35\n")
    (pkg / "d.json").write_text('{"arch": "GEMMA4"}\n')
    (pkg / "e.bin").write_bytes(b"\xff\xfe gemma \x00")
    hits = offending_lines(pkg)
    assert [h.split(":")[0] for h in hits] == ["pkg/a.py", "pkg/d.json", "pkg/e.bin", "pkg/sub/b.jinja",
                                               "pkg/sub/c.md"]
