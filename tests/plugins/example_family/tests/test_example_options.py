"""ninfer-example's own test beside the contract suite: its serve option reaches the runner."""

import argparse

import pytest
from ninfer_example.build import build_artifact
from ninfer_example.family import ExampleFamily
from ninfer_example.plugin import decay

from ninfer_core.artifact import Artifact


def test_example_decay_reaches_the_runner(tmp_path):
    art = Artifact.open(build_artifact(tmp_path / "e.ninfer", decay=0.9))
    assert ExampleFamily().load(art).decay == 0.9  # the artifact's
    assert ExampleFamily().load(art, options=argparse.Namespace(example_decay=0.25)).decay == 0.25
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        decay("1.5")


def test_the_kv_dtype_the_server_resolves_is_how_pages_are_stored(tmp_path):
    import torch

    from ninfer_core.engine.kv_bf16 import BF16, KVDtype
    from ninfer_core.engine.model_api import RunnerOptions

    runner = ExampleFamily().load(Artifact.open(build_artifact(tmp_path / "e.ninfer")))
    fp32_bytes = runner.cache_spec().kv_bytes_per_token
    runner.configure(RunnerOptions(kv_dtype=BF16))
    runner.allocate_cache(4, 2, 16)
    assert runner.k.dtype == torch.bfloat16 and runner.cache_spec().kv_bytes_per_token * 2 == fp32_bytes
    with pytest.raises(ValueError, match="cannot store KV as 'int3'"):
        runner.configure(RunnerOptions(kv_dtype=KVDtype("int3", "int3", 0.375)))
