"""The GPU path's pieces, on the CPU: the GDN kernel glue (core's kernels, ninfer_core.accel, which run
their torch references here) gives the reference logits through prefill, decode and verify; the
bench's random artifact loads through the family's own loader and transformers' model sharing the
runner's tensors gives the same logits (so `ninfer bench` compares like with like)."""

import torch
from ninfer_flash_next.family import FlashNextFamily
from ninfer_flash_next.gpu.gdn import KernelGatedDeltaNet, use_kernels
from ninfer_flash_next.testing import tiny_config

from ninfer_core.engine.model_api import DECODE, LOGITS_ALL, VERIFY, ForwardBatch, LaneSegment, SeqView

TOKS = [5, 77, 300, 258, 12, 99, 401, 3, 3, 250, 17, 64, 200, 31, 8, 9, 123, 456, 78, 90]


def run(r):
    r.allocate_cache(8, 2)
    seq = SeqView(0, [2, 5], 0)
    rows = [r.prefill(seq, TOKS[:14], all_logits=True)]
    seq.num_cached = 14
    for t in TOKS[14:17]:
        rows.append(r.decode([seq], [t]))
        seq.num_cached += 1
    out = r.forward(ForwardBatch([LaneSegment(0, {"full_attention": [2, 5]}, 17, TOKS[17:], VERIFY, LOGITS_ALL)]))
    r.commit([(0, 2)])
    rows.append(out[0].logits)
    rows.append(r.forward(ForwardBatch([LaneSegment(0, {"full_attention": [2, 5]}, 19, [TOKS[19]], DECODE,
                                                    LOGITS_ALL)]))[0].logits)
    return torch.cat(rows)


def test_gdn_kernel_glue_matches_the_reference(loaded):
    art, _ = loaded
    want = run(FlashNextFamily().load(art))
    r = FlashNextFamily().load(art)
    use_kernels(r.model)
    assert sum(isinstance(layer.mixer, KernelGatedDeltaNet) for layer in r.model.layers) == 3
    got = run(r)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5


def test_random_artifact_and_shared_transformers_model_agree():
    fam = FlashNextFamily()
    cfg = tiny_config()
    art = fam.random_artifact(cfg, device="cpu", seed=1, dtype=torch.float32)
    r = fam.load(art)
    r.allocate_cache(4, 1)
    ours = r.prefill(SeqView(0, [0], 0), TOKS, all_logits=True)
    hf = fam.transformers_model(r, cfg)
    with torch.no_grad():
        ref = hf(torch.tensor([TOKS])).logits[0].float()
    assert float((ours - ref).abs().max() / ref.abs().max()) <= 1e-4
    assert hf.model.embed_tokens.weight.data_ptr() == r.model.embed_tokens.weight.data_ptr()  # shared, no copy


def test_gdn_kernel_glue_under_the_triton_interpreter():
    """The same check with the real Triton kernels (conv update / prefill, gated-delta decode and
    recurrent prefill), run by Triton's CPU interpreter in a child process."""
    import os
    import subprocess
    import sys

    import pytest

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("already under the interpreter")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k",
                        "glue_matches"], env=env, capture_output=True, text=True, timeout=600, check=False,
                       cwd=os.path.dirname(__file__))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "1 passed" in p.stdout


def test_bench_script_runs_on_the_cpu(tmp_path, capsys):
    """`python -m ninfer_flash_next.gpu.bench --smoke` (the tiny model on the CPU): every figure of
    the table is there, the rates are medians of the asked repeats, transformers' column and the
    host-expert line are filled, host experts decode the device's greedy tokens."""
    import json

    from ninfer_flash_next.gpu import bench

    out = tmp_path / "bench.json"
    assert bench.main(["--smoke", "--prefill", "24", "--hf-prefill", "20", "--prompt", "8", "--decode-steps", "3",
                       "--hf-decode-steps", "2", "--repeats", "3", "--hf-repeats", "1", "--host-cache-mib", "1",
                       "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["decode_runs"]) == 3 and res["decode_tok_s"] in res["decode_runs"]
    assert len(res["decode_long_runs"]) == 3 and res["prefill_tok_s"] > 0
    assert res["transformers"]["decode_tok_s"] > 0 and res["transformers"]["bf16_logits_rel_err"] <= 1e-4
    assert res["host"]["greedy_equal_to_device"] is True and res["host"]["bytes_per_token"] > 0
    text = capsys.readouterr().out
    assert "decode b1 tok/s after 24 (sparse attention)" in text and "scaled to 48 layers" in text
    assert "48 layers with experts on device" in text
