import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("qwen35")


@pytest.fixture(scope="session")
def artifacts(tiny_dir):
    """kind -> path of the parity artifacts: dense with 8 layers, MoE with 4 (3 GDN : 1 full)."""
    from ninfer_qwen35.testing import build_tiny_artifact

    return {
        "dense": build_tiny_artifact(tiny_dir / "dense.ninfer", kind="dense", seed=1, num_layers=8),
        "moe": build_tiny_artifact(tiny_dir / "moe.ninfer", kind="moe", seed=2, num_layers=4),
    }


@pytest.fixture(scope="session")
def loaded(artifacts):
    """kind -> (artifact, transformers reference model)."""
    from qwen35_hf_reference import hf_causal_lm

    from ninfer_core.artifact import Artifact

    out = {}
    for kind, path in artifacts.items():
        art = Artifact.open(path)
        out[kind] = (art, hf_causal_lm(art))
    return out


def _contract_runner(kind):
    def load(workdir):
        from ninfer_qwen35.family import Qwen35Family
        from ninfer_qwen35.testing import build_tiny_artifact

        from ninfer_core.artifact import Artifact

        path = workdir / f"{kind}.ninfer"
        if not path.exists():  # 4 layers: 3 Gated DeltaNet and 1 full attention
            build_tiny_artifact(path, kind=kind, seed=3, num_layers=4)
        return Qwen35Family().load(Artifact.open(path))

    return load


# The plugin contract suite (ninfer_core.contract), run on the CPU reference runner of both variants.
from ninfer_core.contract import RunnerContract

ninfer_contract = {
    kind: RunnerContract(_contract_runner(kind), plugin="ninfer_qwen35.plugin") for kind in ("dense", "moe")
}
