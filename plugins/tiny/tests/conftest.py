import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
pytest.importorskip("ninfer_tiny")
pytest.importorskip("ninfer_qwen35")
pytest.importorskip("tokenizers")
pytest.importorskip("markov_draftjs")


@pytest.fixture(scope="session")
def micro_run(tmp_path_factory):
    """A micro training run (a few steps, tiny widths) and its summary."""
    from ninfer_tiny.train import RECIPES, train

    out = tmp_path_factory.mktemp("tiny-micro")
    return train(out, RECIPES["micro"], seed=0, workers=1, device="cpu")


def _shipped_runner(workdir):
    """The packaged trained artifact on the CPU, through the family its architecture names."""
    from ninfer_tiny.plugin import packaged_artifact

    from ninfer_core.artifact import Artifact
    from ninfer_core.plugins import PluginHost, PluginSelection

    path = packaged_artifact()
    if path is None:
        pytest.skip("this checkout ships no trained ninfer-tiny artifact")
    art = Artifact.open(path)
    reg = PluginHost(PluginSelection(names=["ninfer_qwen35.plugin"], autoload=False)).family_for_architecture(
        art.architecture)
    target = reg.load()
    return (target() if isinstance(target, type) else target).load(art)


# The plugin contract suite (ninfer_core.contract) on the shipped trained model: a real model's
# logits (not a random one's) through every runner rule.
from ninfer_core.contract import RunnerContract

ninfer_contract = {"shipped": RunnerContract(_shipped_runner, plugin="ninfer_tiny.plugin")}
