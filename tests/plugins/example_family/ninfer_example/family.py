"""The family: builds an ExampleRunner from an artifact and states the chat format."""

from __future__ import annotations

from ninfer_core.engine.model_api import ModelFamily
from ninfer_core.tokenizer.chat_format import ChatFormat


class ExampleFamily(ModelFamily):
    name = "example"

    def load(self, artifact, device="cpu", dtype=None, options=None):
        from ninfer_example.runner import ExampleRunner

        if str(device) != "cpu":
            raise ValueError("the example family runs on the CPU only")
        weights = {name: artifact.get_tensor(name).float() for name in artifact.tensor_names()}
        cfg = artifact.config
        decay = getattr(options, "example_decay", None)
        eos = [t["id"] for t in artifact.tokenizer_section.get("added_tokens", [])
               if t["content"] in artifact.tokenizer_section.get("eos_tokens", [])]
        return ExampleRunner(weights, cfg, cfg["decay"] if decay is None else decay, tuple(eos))

    def chat_format(self, artifact) -> ChatFormat:
        return ChatFormat("example-chatml", turn_opener="<|im_start|>")
