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
