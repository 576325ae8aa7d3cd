"""ninfer-example's tests: the plugin contract suite on its runner (ninfer_core.contract).

The pytest plugin `ninfer_core.testing` comes with ninfer-core (its pytest11 entry point); this file
only says what to check."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package, installed or not

from ninfer_core.contract import RunnerContract


def load_runner(workdir):
    """A fresh runner on a random artifact built once into `workdir`."""
    from ninfer_example.build import build_artifact
    from ninfer_example.family import ExampleFamily

    from ninfer_core.artifact import Artifact

    path = workdir / "example.ninfer"
    if not path.exists():
        build_artifact(path, seed=1)
    return ExampleFamily().load(Artifact.open(str(path)))


ninfer_contract = {
    "example": RunnerContract(load_runner, plugin="ninfer_example.plugin",
                              option_examples={"--example-decay": ["0.5", "0"]}),
}
