"""The CI plugin matrix (.ci/run): each plugin package is tested alone with core and the local
packages it declares; every package runs the contract suite on itself."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = sorted(p.name for p in (ROOT / "plugins").glob("*/") if (p / "pyproject.toml").is_file())


def deps(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, str(ROOT / ".ci" / "plugin_deps"), *args], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    return out.split()


def test_local_dependencies_come_first():
    assert deps("plugins/tiny") == ["plugins/qwen35", "plugins/tiny"]  # tiny depends on ninfer-qwen35
    assert deps("plugins/spec_mtp") == ["plugins/qwen35", "plugins/spec_mtp"]  # its test extra
    assert deps("plugins/qwen35") == ["plugins/qwen35"]
    assert deps("--names", "plugins/tiny") == ["ninfer-qwen35", "ninfer-tiny"]


@pytest.mark.parametrize("plugin", PLUGINS)
def test_every_plugin_package_runs_the_contract_suite(plugin):
    conftest = ROOT / "plugins" / plugin / "tests" / "conftest.py"
    assert conftest.is_file() and re.search(r"^ninfer_contract\s*=", conftest.read_text(), flags=re.MULTILINE), \
        f"plugins/{plugin}/tests/conftest.py declares no ninfer_contract (docs/plugins/testing.md)"


def test_the_ci_script_runs_each_plugin_alone_then_all():
    run = (ROOT / ".ci" / "run").read_text()
    alone, together = run.index('python -m pytest "$p"'), run.index("=== ninfer-core with every plugin ===")
    assert run.index("=== ninfer-core alone ===") < alone < together
    assert "pip uninstall" in run[alone:together]
