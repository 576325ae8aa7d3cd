"""Gemma 4 on CUDA (skipped without it): the Triton attention kernel at the real head geometry in
bf16, and the runner in bf16 against transformers at real widths (one period of the layer pattern,
random weights, the full 262k vocabulary) within 1e-2. scripts/gpu_check.py runs this module
(`--order gemma4`); each check prints one PARITY line.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Widths of the published text configs (google/gemma-4-31B, google/gemma-4-26B-A4B config.json,
# text_config); the layer count is cut to one period of the pattern (5 sliding + 1 global).
REAL_WIDTHS = {
    "31b": {"hidden_size": 5376, "intermediate_size": 21504, "num_attention_heads": 32, "num_key_value_heads": 16,
            "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 4, "sliding_window": 1024},
    "26b-a4b": {"hidden_size": 2816, "intermediate_size": 2112, "num_attention_heads": 16, "num_key_value_heads": 8,
                "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 2, "sliding_window": 1024,
                "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704},
}
TOL = 1e-2


class StateArtifact:
    """An in-memory artifact over a transformers model's weights (nothing written to disk)."""

    def __init__(self, config: dict, state: dict):
        self.config, self.architecture, self._state = config, config["model_type"], state
        self.tokenizer_section = None
        self.path = "<memory>"

    def tensor_names(self, component=None):
        return list(self._state)

    def has_tensor(self, name):
        return name in self._state

    def get_tensor(self, name):
        return self._state[name]


def real_config(kind: str) -> dict:
    from ninfer_gemma4.testing import shrunk_config

    cfg = shrunk_config(kind, vocab_size=262144, num_layers=6, multimodal=False)
    cfg.update(REAL_WIDTHS[kind], vocab_size_per_layer_input=262144, max_position_embeddings=131072)
    return cfg


def test_kernel_at_the_real_head_geometry_bf16():
    from gemma4_kernel_cases import check

    shapes = [  # sliding (H 32, KVH 16, D 256, window 1024) and global (KVH 4, D 512) of the 31B
        ([0, 3000, 5000], [2048, 1, 64], 32, 16, 256, 1024, 64),
        ([0, 3000, 5000], [2048, 1, 64], 32, 4, 512, 0, 64),
        ([700, 1500, 4000, 9000], [1, 1, 1, 1], 16, 8, 256, 1024, 64),  # 26B-A4B decode batch
    ]
    check(dtype=torch.bfloat16, device="cuda", tol=TOL, shapes=shapes)
    print("PARITY gemma4 kernel bf16 at real head geometry: ok")


@pytest.mark.parametrize("kind", ["31b", "26b-a4b"])
def test_runner_bf16_parity_with_transformers_at_real_widths(kind):
    from ninfer_gemma4.family import Gemma4Family
    from ninfer_gemma4.testing import hf_model

    from ninfer_core.engine.model_api import LOGITS_ALL, ForwardBatch, LaneSegment

    cfg = real_config(kind)
    ref = hf_model(cfg, seed=3, std=0.02).to("cuda", torch.bfloat16)
    state = {k: v for k, v in ref.state_dict().items()}
    runner = Gemma4Family().load(StateArtifact(cfg, state), device="cuda", dtype="bfloat16")
    runner.allocate_cache(64, 2, page_size=64)
    groups = runner.cache_spec().group_names
    ids = torch.randint(3, 262144, (1500,), generator=torch.Generator().manual_seed(5)).tolist()  # past the window
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids], device="cuda")).logits[0].float()
    tables = {g: list(range(32)) for g in groups}
    got = torch.cat([runner.forward(ForwardBatch([LaneSegment(0, tables, s, ids[s:s + 512], logits=LOGITS_ALL)]))[0]
                     .logits.float() for s in range(0, len(ids), 512)])
    err = float((got - want).abs().max() / want.abs().max())
    print(f"PARITY gemma4 {kind} bf16 (6 layers at real widths, 1500 tokens in chunks of 512): "
          f"max relative logits error {err:.2e}")
    assert err <= TOL
