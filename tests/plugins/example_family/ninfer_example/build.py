"""Write a random-weight example artifact: `python -m ninfer_example.build OUT.ninfer [--seed N]`."""

from __future__ import annotations

import argparse
import base64

import torch

from ninfer_core.artifact import TensorSpec, write_artifact

ADDED = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer_section() -> dict:
    """Byte-level BPE: the 256 bytes (ids 0..255), then the chat markers."""
    ranks = "".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256))
    return {"type": "bpe", "ranks": ranks, "pattern": r"\s+|\S+",
            "added_tokens": [{"id": 256 + i, "content": c, "special": True} for i, c in enumerate(ADDED)],
            "eos_tokens": ["<|im_end|>", "<|endoftext|>"], "pad_token": "<|endoftext|>", "bos_token": None}


def build_artifact(path, seed: int = 0, vocab_size: int = 264, hidden: int = 32, decay: float = 0.9) -> str:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (vocab_size, hidden), "attn.q.weight": (hidden, hidden),
              "attn.k.weight": (hidden, hidden), "attn.v.weight": (hidden, hidden)}
    values = {name: torch.randn(shape, generator=gen) / (1.0 if name == "embed.weight" else hidden ** 0.5)
              for name, shape in shapes.items()}
    specs = [TensorSpec(name, torch.float32, shape, lambda n=name: values[n]) for name, shape in shapes.items()]
    manifest = {"name": "example", "architecture": "example_lm",
                "config": {"model_type": "example_lm", "vocab_size": vocab_size, "hidden_size": hidden,
                           "decay": decay, "max_position_embeddings": 4096},
                "tokenizer": tokenizer_section(), "chat_template": TEMPLATE}
    write_artifact(str(path), manifest, specs)
    return str(path)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(build_artifact(a.out, a.seed))
