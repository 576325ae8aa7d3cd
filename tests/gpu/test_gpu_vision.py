"""Qwen3.5 vision on CUDA: the tower in bf16 against the fp32 reference, and a media lane through
the GPU runner (reference-path prefill with spliced embeddings, then decode on the CUDA Graph fast
path with the lane's mRoPE offset) against the CPU fp32 runner, on a random converted VL artifact."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    from ninfer_qwen35.vl_testing import build_vl_artifact

    from ninfer_core.artifact import Artifact

    return Artifact.open(build_vl_artifact(str(tmp_path_factory.mktemp("vlgpu") / "vl.ninfer"), seed=2))


def rel(a, b) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max() / b.float().abs().max())


def test_media_lane_on_the_gpu_runner(art):
    import numpy as np
    from ninfer_qwen35.family import Qwen35Family
    from ninfer_qwen35.media import Qwen35MediaProcessor
    from ninfer_qwen35.vl_testing import token_id
    from PIL import Image

    from ninfer_core.engine.media_side import segment_side
    from ninfer_core.engine.model_api import DECODE, PREFILL, ForwardBatch, LaneSegment
    from ninfer_core.media.api import IMAGE, PreparedMedia

    fam = Qwen35Family()
    proc = Qwen35MediaProcessor(art.config)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (96, 128, 3), dtype=np.uint8))
    pv, grid, tokens = proc.prepare_image(img, 64)
    item = PreparedMedia(IMAGE, "9" * 64, pv, grid, tokens)
    prompt = [token_id("<|im_start|>"), 40, 41, token_id("<|vision_start|>"), token_id("<|image_pad|>"),
              token_id("<|vision_end|>"), 50, 51]
    exp = proc.expand(prompt, [item])
    media = type("M", (), {"positions": exp.positions, "position_delta": exp.position_delta, "spans": exp.spans})
    ids = [10_000 + i if any(s.start <= i < s.end for s in exp.spans) else t for i, t in enumerate(exp.ids)]
    n = len(ids)
    results = []
    for device in ("cpu", "cuda"):
        runner = fam.load(art, device=device)
        tower = fam.vision_tower(art, device, None)
        emb = tower.encode(item)
        runner.allocate_cache(8, 2)
        tables = {"full_attention": [1, 2, 3, 4]}
        pre = runner.forward(ForwardBatch([LaneSegment(0, tables, 0, ids, PREFILL, "last",
                                                       side=segment_side(media, 0, n, lambda it, e=emb: e))]))[0].logits
        steps = []
        for k, tok in enumerate([60, 61, 62]):
            seg = LaneSegment(0, tables, n + k, [tok], DECODE, side=segment_side(media, n + k, 1, None))
            steps.append(runner.forward(ForwardBatch([seg]))[0].logits)
        results.append((emb, pre, torch.stack(steps)))
    (e32, p32, d32), (e16, p16, d16) = results
    print(f"PARITY vision bf16 GPU vs fp32 CPU: tower {rel(e16, e32):.2e}, prefill {rel(p16, p32):.2e}, "
          f"decode {rel(d16, d32):.2e}")
    assert rel(e16, e32) <= 3e-2 and rel(p16, p32) <= 3e-2 and rel(d16, d32) <= 3e-2
