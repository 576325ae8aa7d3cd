import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def gemma_artifacts(tmp_path_factory):
    """kind -> converted random artifact (E2B-shaped: sliding+global, shared KV, PLE, double-wide MLP;
    26B-A4B-shaped: K=V global layers and the MoE block)."""
    from ninfer_gemma4.testing import build_tiny_artifact

    d = tmp_path_factory.mktemp("gemma4")
    return {kind: build_tiny_artifact(d / f"{kind}.ninfer", kind=kind, seed=i + 1)
            for i, kind in enumerate(("e2b", "26b-a4b"))}


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
