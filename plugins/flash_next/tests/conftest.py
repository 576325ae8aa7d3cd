import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("flash_next")


@pytest.fixture(scope="session")
def artifact_path(tiny_dir):
    """A converted random Flash-Next checkpoint (4 layers: 3 GDN, one with PLE, 1 indexed attention)."""
    from ninfer_flash_next.testing import build_tiny_artifact

    return build_tiny_artifact(tiny_dir / "flash.ninfer", seed=3)


@pytest.fixture(scope="session")
def mtp_artifact_path(tiny_dir):
    from ninfer_flash_next.testing import build_tiny_artifact

    return build_tiny_artifact(tiny_dir / "flash-mtp.ninfer", seed=4, mtp=True)


@pytest.fixture(scope="session")
def loaded(artifact_path):
    """(artifact, transformers' model with its weights)."""
    from ninfer_flash_next.testing import hf_from_artifact

    from ninfer_core.artifact import Artifact

    art = Artifact.open(artifact_path)
    return art, hf_from_artifact(art)


@pytest.fixture(scope="session")
def launch():
    """tests/conftest.py's launch_server (a real `ninfer serve` subprocess), loaded by path."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "tests" / "conftest.py"
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location("ninfer_repo_tests_conftest", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.launch_server


@pytest.fixture(scope="session")
def converted(tiny_dir):
    """`ninfer convert` of a transformers-written random checkpoint (the CLI, as a user runs it)."""
    from ninfer_flash_next.testing import write_hf_checkpoint

    from ninfer_core.cli import main

    hf = write_hf_checkpoint(tiny_dir / "hf-flash", seed=7)
    out = str(tiny_dir / "converted.ninfer")
    assert main(["convert", str(hf), out, "--no-progress", "--name", "flash-next-tiny"]) == 0
    return out


def _contract_runner(workdir):
    from ninfer_flash_next.family import FlashNextFamily
    from ninfer_flash_next.testing import build_tiny_artifact

    from ninfer_core.artifact import Artifact

    path = workdir / "flash.ninfer"
    if not path.exists():
        build_tiny_artifact(path, seed=3)
    return FlashNextFamily().load(Artifact.open(str(path)))


# The plugin contract suite (ninfer_core.contract), run on the CPU reference runner.
from ninfer_core.contract import RunnerContract  # noqa: E402

ninfer_contract = {"flash_next": RunnerContract(
    _contract_runner, plugin="ninfer_flash_next.plugin",
    option_examples={"--expert-cache-mib": ["auto", "64"], "--expert-profile": ["experts.json"],
                     "--expert-profile-out": ["experts.json"], "--ngram-table": ["table.ninfer"],
                     "--ngram-io-depth": ["8"], "--ngram-ram-mib": ["16"], "--ngram-hot-profile": ["hot.json"]})}
