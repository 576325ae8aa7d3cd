import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def gemma_artifacts(tmp_path_factory):
    """kind -> converted random artifact (E2B-shaped: sliding+global, shared KV, PLE, double-wide MLP;
    26B-A4B-shaped: K=V global layers and the MoE block)."""
    d = tmp_path_factory.mktemp("gemma4")
    return {kind: _tiny_artifact(kind, d) for kind in KINDS}


KINDS = ("e2b", "26b-a4b")
_BUILT: dict = {}


def _tiny_artifact(kind, directory):
    """The session's random artifact of `kind` (seed by kind), built once into the first directory
    asked: the fixtures above and the contract cases below share it (the conversion is slow)."""
    from ninfer_gemma4.testing import build_tiny_artifact

    if kind not in _BUILT:
        _BUILT[kind] = build_tiny_artifact(directory / f"{kind}.ninfer", kind=kind, seed=KINDS.index(kind) + 1)
    return _BUILT[kind]


from gemma4_test_support import plugin_flags  # noqa: F401  (the tests import it from there)


@pytest.fixture(scope="session")
def launch():
    """tests/conftest.py's launch_server (a real `ninfer serve` subprocess), loaded by path: this
    folder's tests also run without the repository's tests/ in the session."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "tests" / "conftest.py"
    if str(path.parent) not in sys.path:  # its own imports (qwen_format) sit beside it
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location("ninfer_repo_tests_conftest", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod.launch_server


def _contract_runner(kind):
    def load(workdir):
        from ninfer_gemma4.family import Gemma4Family

        from ninfer_core.artifact import Artifact

        return Gemma4Family().load(Artifact.open(str(_tiny_artifact(kind, workdir))))

    return load


# The plugin contract suite (ninfer_core.contract) on both shapes: E2B (sliding + global, shared KV,
# PLE) and 26B-A4B (K=V global layers, MoE); prompts of 40 tokens cross the window of 8.
from ninfer_core.contract import RunnerContract

ninfer_contract = {kind: RunnerContract(_contract_runner(kind), plugin="ninfer_gemma4.plugin") for kind in KINDS}
