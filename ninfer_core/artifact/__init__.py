"""The .ninfer v3 artifact: one safetensors-layout file with a JSON manifest in its metadata.

See docs/artifact.md for the layout and docs/dev/CONTRACTS.md for the API contract.
"""

from ninfer_core.artifact.format import FORMAT_VERSION, ArtifactError, component_of
from ninfer_core.artifact.reader import Artifact
from ninfer_core.artifact.writer import TensorSpec, write_artifact

__all__ = ["FORMAT_VERSION", "Artifact", "ArtifactError", "TensorSpec", "component_of", "write_artifact"]
