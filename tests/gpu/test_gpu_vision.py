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


def test_gemma4_tower_bf16_and_overlay_from_kv_pages(tmp_path):
    """The Gemma 4 tower (31B structure, shrunk) in bf16 on CUDA against its fp32 CPU reference, and
    the overlay's encode through a window borrowed from free KV pages on the device: the same
    embeddings as the resident tower, every page returned."""
    import numpy as np

    pytest.importorskip("ninfer_gemma4")
    from ninfer_gemma4.family import Gemma4Family
    from ninfer_gemma4.media import Gemma4MediaProcessor
    from ninfer_gemma4.testing import build_tiny_artifact, shrunk_vision_config
    from PIL import Image

    from ninfer_core.artifact import Artifact
    from ninfer_core.engine.pages import PagePool
    from ninfer_core.media.api import IMAGE, PreparedMedia
    from ninfer_core.media.window import PageLender, nbytes_of

    art = Artifact.open(build_tiny_artifact(tmp_path / "g4vl.ninfer", kind="31b", seed=3,
                                            vision=shrunk_vision_config(), bidirectional_vision=True))
    fam = Gemma4Family()
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (200, 300, 3), dtype=np.uint8))
    pv, grid, tokens = Gemma4MediaProcessor(art.config).prepare_image(img, 280)
    item = PreparedMedia(IMAGE, "8" * 64, pv, grid, tokens)
    e32 = fam.vision_tower(art, "cpu", torch.float32).encode(item)
    resident = fam.vision_tower(art, "cuda", torch.bfloat16)
    e16 = resident.encode(item)
    host = fam.vision_tower(art, "cpu", torch.bfloat16)
    host.pin()
    kv = [torch.zeros(64, 64, 1, 32, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    pool = PagePool(64)
    lender = PageLender(pool, lambda: kv)
    window = lender.borrow(nbytes_of(host.window_tensors(), host.dtype))
    assert window is not None and window.kind == "kv" and pool.num_free == 64 - len(window.pages)
    streamed = host.encode_streamed(item, "cuda", window)
    lender.give_back(window)
    assert pool.num_free == 64 and not any(t.any() for t in kv)
    print(f"PARITY gemma4 vision bf16 GPU vs fp32 CPU: tower {rel(e16, e32):.2e}; overlay equals resident "
          f"{torch.equal(streamed, e16)}")
    assert rel(e16, e32) <= 1e-2 and torch.equal(streamed, e16)


def test_overlay_through_the_weight_tail_and_beside_decode_on_cuda(tmp_path):
    """On the device: a KV pool too small for one window sends the overlay's encode through the
    evicted tail of the text weights (pinned mirror, restored in place): the same embeddings as the
    resident tower and every weight byte back; then a served image request through the engine's
    encoder thread (its own stream) gives the resident server's completion."""
    import numpy as np
    from ninfer_qwen35.family import Qwen35Family
    from ninfer_qwen35.media import Qwen35MediaProcessor
    from ninfer_qwen35.vl_testing import build_vl_artifact
    from PIL import Image

    from ninfer_core.artifact import Artifact
    from ninfer_core.engine.pages import PagePool
    from ninfer_core.media.api import IMAGE, PreparedMedia
    from ninfer_core.media.residency import OverlayResidency

    art = Artifact.open(build_vl_artifact(str(tmp_path / "vl128.ninfer"), seed=6, hidden=128))
    fam = Qwen35Family()
    img = Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 96, 3), dtype=np.uint8))
    pv, grid, tokens = Qwen35MediaProcessor(art.config).prepare_image(img, 64)
    item = PreparedMedia(IMAGE, "7" * 64, pv, grid, tokens)
    runner = fam.load(art, device="cuda")
    runner.allocate_cache(2, 1)
    resident = fam.vision_tower(art, "cuda", None).encode(item)
    overlay = OverlayResidency.load(fam, art, runner, None)
    overlay.attach(PagePool(2), runner)
    weights = [t.clone() for t in runner.evictable_weights()]
    got = overlay.encode(item)
    assert overlay.windows == {"kv": 0, "tail": 1, "allocator": 0} and overlay.tail.open is None
    assert got.device.type == "cpu" and got.is_pinned() and torch.equal(got.to("cuda"), resident)
    assert all(torch.equal(a, b) for a, b in zip(runner.evictable_weights(), weights))
    print(f"PARITY overlay weight-tail window on CUDA: equals resident {torch.equal(got.to('cuda'), resident)}, "
          f"evicted {overlay.last_encode['evict_bytes'] / 2**20:.2f} MiB in {overlay.last_encode['evict_ms']:.1f} ms, "
          f"restored in {overlay.last_encode['restore_ms']:.1f} ms")
