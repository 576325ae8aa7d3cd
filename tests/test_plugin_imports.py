"""Dependency direction (ARCHITECTURE.md): plugins -> ninfer_core's public API only; never a plugin ->
another plugin, never core -> a plugin.

Every Python file under `plugins/*/` and `ninfer_core/` is parsed (ast, nothing is imported) and
each reference to a plugin's top-level module (the packages beside a plugin's pyproject.toml, e.g.
`ninfer_qwen35`) is collected: `import` / `from ... import` statements at any depth,
`importlib.import_module("...")` / `__import__("...")` with a literal name, and lazy registration
strings of the form "package.module:Name". The rules:

- a plugin's package code (anything outside its `tests/` folder) references no other plugin, and
  its pyproject.toml lists no other plugin's distribution in `dependencies` or in an extra other
  than `test`;
- a plugin's tests may use another plugin only where they skip without it: the import follows a
  module-level `pytest.importorskip("that_plugin...")`, or one earlier in the same function, or the
  file asks `importlib.util.find_spec("that_plugin...")` at module level (the conftests build their
  contract cases only when the family is installed);
- no file of ninfer_core references any plugin.

`KNOWN` lists the exceptions that exist today, each with its reason; a listed pair that is no longer
used fails the test too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import ninfer_core

ROOT = Path(ninfer_core.__file__).resolve().parent.parent
PLUGINS = ROOT / "plugins"

# (plugin folder, plugin module it uses) -> why it is allowed for now
KNOWN = {
    ("tiny", "ninfer_qwen35"): "ninfer-tiny is a Qwen3.5-architecture model with its training code: it builds its "
                               "tokenizer and template from qwen35's chat module and evaluates through its family "
                               "(a runtime dependency of the distribution; to be cut like flash_next's was)",
    ("tiny", "ninfer_spec_dflash"): "ninfer-tiny's drafter training (`python -m ninfer_tiny.train_dflash`, the "
                                    "`dflash` extra) builds the drafter model of ninfer-spec-dflash",
}  # fmt: skip

_REGISTRATION = re.compile(r"^(\w+)(?:\.\w+)*:\w+$")


@dataclass(frozen=True)
class Use:
    path: Path
    line: int
    module: str  # the plugin top-level module referenced
    guarded: bool  # a skip-when-absent guard covers it (see the module docstring)

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.line}: {self.module}"


def plugin_modules(plugins: Path) -> dict[str, str]:
    """{top-level module: plugin folder name} of every plugin folder with a pyproject.toml."""
    out = {}
    for folder in sorted(p for p in plugins.iterdir() if (p / "pyproject.toml").is_file()):
        for pkg in folder.iterdir():
            if pkg.is_dir() and pkg.name != "tests" and (pkg / "__init__.py").is_file():
                out[pkg.name] = folder.name
    return out


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _literal_arg(node: ast.Call) -> str | None:
    if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def _outside_functions(tree: ast.AST):
    """The nodes of a module that run at import (function bodies left out)."""
    todo = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def uses_in_file(path: Path, modules: set[str]) -> list[Use]:
    """Every reference of `path` to one of `modules`, with whether a skip guard covers it."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    top_guards: list[tuple[int, str]] = []  # module-level importorskip(...) calls: (line, name)
    find_spec: set[str] = set()  # names asked with find_spec(...) at module level
    for node in _outside_functions(tree):
        if isinstance(node, ast.Call) and (name := _literal_arg(node)) is not None:
            if _call_name(node) == "importorskip":
                top_guards.append((node.lineno, name.split(".")[0]))
            elif _call_name(node) == "find_spec":
                find_spec.add(name.split(".")[0])
    out: list[Use] = []

    def record(node, names, scopes):
        for full in names:
            top = full.split(".")[0]
            if top not in modules:
                continue
            guarded = top in find_spec or any(line < node.lineno and m == top for line, m in top_guards)
            for fn in scopes:  # an importorskip earlier in an enclosing function
                guarded = guarded or any(
                    isinstance(n, ast.Call) and _call_name(n) == "importorskip" and n.lineno < node.lineno
                    and (_literal_arg(n) or "").split(".")[0] == top for n in ast.walk(fn))
            out.append(Use(path, node.lineno, top, guarded))

    def visit(node, scopes):
        if isinstance(node, ast.Import):
            record(node, [a.name for a in node.names], scopes)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            record(node, [node.module], scopes)
        elif isinstance(node, ast.Call) and _call_name(node) in ("import_module", "__import__"):
            if (name := _literal_arg(node)) is not None:
                record(node, [name], scopes)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _REGISTRATION.match(node.value):
            record(node, [node.value.split(":")[0]], scopes)
        inner = scopes + [node] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else scopes
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, [])
    return out


def _py_files(folder: Path):
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def violations(plugins: Path, core: Path | None = None, known=None) -> tuple[list[str], set]:
    """(what breaks the rules, the KNOWN pairs actually used) for a plugins folder (and a core package)."""
    known = KNOWN if known is None else known
    modules = plugin_modules(plugins)
    bad, used_known = [], set()
    dists = {}
    for folder in sorted(p for p in plugins.iterdir() if (p / "pyproject.toml").is_file()):
        meta = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        dists[meta["name"]] = folder.name
    for folder in sorted(p for p in plugins.iterdir() if (p / "pyproject.toml").is_file()):
        others = {m for m, owner in modules.items() if owner != folder.name}
        for path in _py_files(folder):
            is_test = "tests" in path.relative_to(folder).parts
            for use in uses_in_file(path, others):
                pair = (folder.name, use.module)
                if pair in known:
                    used_known.add(pair)
                    continue
                if not is_test:
                    bad.append(f"{use.where(plugins.parent)} (package code imports another plugin)")
                elif not use.guarded:
                    bad.append(f"{use.where(plugins.parent)} (a test uses another plugin without skipping when "
                               f"it is absent: pytest.importorskip({use.module!r}) first)")
        meta = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        wanted = [("dependencies", d) for d in meta.get("dependencies", [])]
        wanted += [(f"optional-dependencies.{extra}", d) for extra, deps in meta.get("optional-dependencies", {}).items()
                   if extra != "test" for d in deps]
        for key, spec in wanted:
            dist = re.split(r"[ <>=!~;\[]", spec, maxsplit=1)[0]
            owner = dists.get(dist)
            if owner is None or owner == folder.name:
                continue
            mods = {m for m, o in modules.items() if o == owner}
            if any((folder.name, m) in known for m in mods):
                continue
            bad.append(f"{folder.relative_to(plugins.parent)}/pyproject.toml: {key} lists {dist} (another plugin)")
    if core is not None:
        for path in _py_files(core):
            for use in uses_in_file(path, set(modules)):
                bad.append(f"{use.where(core.parent)} (core imports a plugin)")
    return bad, used_known


def test_no_plugin_imports_another_and_core_imports_none():
    modules = plugin_modules(PLUGINS)
    assert {"ninfer_qwen35", "ninfer_flash_next", "ninfer_gemma4"} <= set(modules)  # the real tree is searched
    bad, used_known = violations(PLUGINS, ROOT / "ninfer_core")
    assert not bad, "dependency direction broken (ARCHITECTURE.md):\n" + "\n".join(bad)
    stale = set(KNOWN) - used_known
    assert not stale, f"KNOWN lists exceptions no longer used (remove them): {sorted(stale)}"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_scan_finds_each_kind_of_reference(tmp_path):
    plugins = tmp_path / "plugins"
    for name in ("alpha", "beta"):
        _write(plugins / name / "pyproject.toml", f'[project]\nname = "ninfer-{name}"\ndependencies = []\n')
        _write(plugins / name / f"ninfer_{name}" / "__init__.py", "")
    _write(plugins / "beta" / "pyproject.toml",
           '[project]\nname = "ninfer-beta"\ndependencies = ["ninfer-core", "ninfer-alpha>=0.1"]\n'
           '[project.optional-dependencies]\ntest = ["ninfer-alpha"]\n')
    pkg = plugins / "beta" / "ninfer_beta"
    _write(pkg / "a.py", "import ninfer_alpha.model\n")
    _write(pkg / "b.py", "def f():\n    from ninfer_alpha.layers import X\n")
    _write(pkg / "c.py", "import importlib\nm = importlib.import_module('ninfer_alpha.x')\n")
    _write(pkg / "d.py", "SPEC = 'ninfer_alpha.family:AlphaFamily'\nDOC = 'see ninfer_alpha.family'\n")
    _write(pkg / "ok.py", "import ninfer_beta.a\nimport ninfer_core\n")
    tests = plugins / "beta" / "tests"
    _write(tests / "test_guarded.py", "import pytest\npytest.importorskip('ninfer_alpha')\nimport ninfer_alpha.x\n")
    _write(tests / "test_late_guard.py", "import ninfer_alpha.x\nimport pytest\npytest.importorskip('ninfer_alpha')\n")
    _write(tests / "test_in_function.py",
           "import pytest\ndef test_a():\n    pytest.importorskip('ninfer_alpha')\n    import ninfer_alpha.x\n"
           "def test_b():\n    import ninfer_alpha.y\n")
    _write(tests / "conftest.py", "import importlib.util\ndef load():\n    from ninfer_alpha import x\n"
                                  "CASES = {'a': load} if importlib.util.find_spec('ninfer_alpha') else {}\n")
    core = tmp_path / "ninfer_core"
    _write(core / "engine.py", "def f():\n    import ninfer_beta\n")
    bad, _ = violations(plugins, core, known={})
    found = sorted(b.split(" (")[0] for b in bad)
    assert found == sorted([
        "ninfer_core/engine.py:2: ninfer_beta",
        "plugins/beta/ninfer_beta/a.py:1: ninfer_alpha", "plugins/beta/ninfer_beta/b.py:2: ninfer_alpha",
        "plugins/beta/ninfer_beta/c.py:2: ninfer_alpha", "plugins/beta/ninfer_beta/d.py:1: ninfer_alpha",
        "plugins/beta/pyproject.toml: dependencies lists ninfer-alpha",
        "plugins/beta/tests/test_in_function.py:6: ninfer_alpha",
        "plugins/beta/tests/test_late_guard.py:1: ninfer_alpha",
    ])
    # a KNOWN pair silences that plugin's uses and its dependency, and is reported as used
    bad, used = violations(plugins, None, known={("beta", "ninfer_alpha"): "reason"})
    assert bad == [] and used == {("beta", "ninfer_alpha")}
