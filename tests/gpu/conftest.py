"""GPU tests: marked `gpu`, skipped without CUDA; run on the device through scripts/gpu_check.py."""

import os
import sys

import pytest

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "..", "plugins", "qwen35", "tests"))


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        cuda = False
    for item in items:
        if str(item.fspath).startswith(HERE):
            item.add_marker(pytest.mark.gpu)
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
