import argparse
import importlib.util

from ninfer_core.contract import SpecContract


def _on_qwen35(kind):
    def load(workdir):
        """A random Qwen3.5 target carrying random drafters of both kinds (built once per case)."""
        from ninfer_qwen35.family import Qwen35Family
        from ninfer_qwen35.testing import build_tiny_artifact
        from ninfer_spec_dflash.backend import DFlash2Backend, DFlashBackend
        from ninfer_spec_dflash.testing import random_drafter_checkpoint

        from ninfer_core.artifact import Artifact
        from ninfer_core.cli import main as cli

        path = workdir / "target.ninfer"
        if not path.exists():
            base = build_tiny_artifact(workdir / "base.ninfer", seed=31, num_layers=4)
            for k in ("dflash", "dflash2"):
                random_drafter_checkpoint(workdir / k, k, 64, 512, [1, 3], seed=4)
            assert cli(["convert", str(base), str(path), "--dflash", str(workdir / "dflash"),
                        "--dflash2", str(workdir / "dflash2"), "--no-progress"]) == 0
        art = Artifact.open(path)
        runner = Qwen35Family().load(art)
        backend = {"dflash": DFlashBackend, "dflash2": DFlash2Backend}[kind]
        return runner, backend.load(runner, art, argparse.Namespace(draft_tokens=7))

    return load


# The plugin contract suite (ninfer_core.contract): both backends' rules on a random Qwen3.5 target
# (the family here whose runner returns the layer outputs a drafter reads), when it is installed.
ninfer_contract = {
    kind: SpecContract(_on_qwen35(kind), plugin="ninfer_spec_dflash.plugin",
                       option_examples={"--draft-tokens": ["1", "15"]})
    for kind in ("dflash", "dflash2")
} if importlib.util.find_spec("ninfer_qwen35") else {}
