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
