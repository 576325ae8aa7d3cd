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
