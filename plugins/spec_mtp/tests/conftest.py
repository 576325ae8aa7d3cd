import argparse
import importlib.util

from ninfer_core.contract import SpecContract


def _mtp_on_qwen35(kind):
    def load(workdir):
        from ninfer_qwen35.family import Qwen35Family
        from ninfer_qwen35.testing import build_tiny_artifact
        from ninfer_spec_mtp.backend import MtpBackend

        from ninfer_core.artifact import Artifact

        path = workdir / f"{kind}.ninfer"
        if not path.exists():
            build_tiny_artifact(path, kind=kind, seed=31, num_layers=4)
        art = Artifact.open(path)
        runner = Qwen35Family().load(art)
        return runner, MtpBackend.load(runner, art, argparse.Namespace(draft_tokens=3))

    return load


# The plugin contract suite (ninfer_core.contract): the backend's rules on a random Qwen3.5 model
# with an MTP head (the only family here that carries one), when that family is installed.
ninfer_contract = {
    "qwen35-dense": SpecContract(_mtp_on_qwen35("dense"), plugin="ninfer_spec_mtp.plugin",
                                 option_examples={"--draft-tokens": ["1", "15"]}),
} if importlib.util.find_spec("ninfer_qwen35") else {}
