"""`ninfer bench` for Gemma 4 on the CPU: its shapes are registered, the random-weight artifact
loads through the family's loader, transformers' model over the same tensors gives the same logits,
and a smoke run over a converted artifact writes every figure (the real figures come from the GPU)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from gemma4_test_support import plugin_flags

from ninfer_core.engine.model_api import SeqView


def test_gemma4_shapes_are_registered_with_the_real_layer_pattern():
    from ninfer_gemma4.config import Gemma4Config
    from ninfer_gemma4.shapes import GEMMA4_26B_A4B, GEMMA4_31B

    from ninfer_core.bench.shapes import shapes
    from ninfer_core.plugins import PluginHost, PluginSelection

    host = PluginHost(PluginSelection.from_sources(["ninfer_gemma4.plugin"]))
    host.load()
    got = shapes(host)
    assert got["gemma4-31b"] == GEMMA4_31B and got["gemma4-26b-a4b"] == GEMMA4_26B_A4B
    c31 = Gemma4Config.from_hf(GEMMA4_31B, "gemma4_text")
    assert c31.num_hidden_layers == 60 and c31.layer_types.count("full_attention") == 10
    assert c31.layer_types[-1] == "full_attention" and c31.attention_k_eq_v and c31.sliding_window == 1024
    moe = Gemma4Config.from_hf(GEMMA4_26B_A4B, "gemma4_text")
    assert moe.enable_moe_block and (moe.num_experts, moe.top_k_experts) == (128, 8) and moe.num_hidden_layers == 30


@pytest.mark.parametrize("kind", ["e2b", "26b-a4b"])
def test_random_artifact_loads_and_transformers_shares_its_tensors(kind):
    from ninfer_gemma4.family import Gemma4Family
    from ninfer_gemma4.testing import shrunk_config

    cfg = shrunk_config(kind, multimodal=False)
    fam = Gemma4Family()
    runner = fam.load(fam.random_artifact(cfg, device="cpu", seed=3), device="cpu")
    hf = fam.transformers_model(runner, cfg)
    assert hf.model.embed_tokens.weight.data_ptr() == runner.model.embed_tokens.weight.data_ptr()
    runner.allocate_cache(16, 1, page_size=4)
    ids = [int(x) for x in torch.randint(3, cfg["vocab_size"], (20,), generator=torch.Generator().manual_seed(1))]
    ours = runner.prefill(SeqView(0, list(range(16)), 0), ids, all_logits=True)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0].float()
    assert float((ours - want).abs().max() / want.abs().max()) <= 1e-4


def test_bench_smoke_run_on_a_gemma4_artifact(gemma_artifacts, tmp_path):
    out = tmp_path / "b.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "bench", *plugin_flags(),
                        "--shape", str(gemma_artifacts["26b-a4b"]), "--device", "cpu", "--prefill-lens", "40",
                        "--decode-batches", "1,2", "--decode-steps", "3", "--decode-prompt", "12",
                        "--long-context", "60", "--long-chunk", "16", "--repeats", "1", "--hf-prefill-lens", "24",
                        "--hf-decode-batches", "1", "--hf-decode-steps", "2", "--http-clients", "1",
                        "--http-tokens", "4", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["prefill"]["40"]["tok_s"] > 0 and set(res["decode"]) == {"1", "2"}
    assert res["decode"]["1"]["vs_floor"] > 0 and res["decode_long"]["total_tok_s"] > 0
    assert "prefill" in res["transformers"], res["transformers"]
    assert "error" not in res["http"], res["http"]


def test_decode_floor_counts_the_window_of_the_ring_not_the_whole_ring():
    from ninfer_gemma4.family import Gemma4Family
    from ninfer_gemma4.testing import shrunk_config

    from ninfer_core.bench.run import step_bytes
    from ninfer_core.engine.model_api import RunnerOptions

    cfg = shrunk_config("26b-a4b", multimodal=False)
    fam = Gemma4Family()
    runner = fam.load(fam.random_artifact(cfg, device="cpu"), device="cpu")
    runner.configure(RunnerOptions(max_segment_tokens=64))
    spec = runner.cache_spec()
    per_token = spec.state_bytes // runner.ring_tokens
    facts = {"dense_bytes": 1000, "expert_bytes": 0, "experts": 0, "top_k": 0}
    window = cfg["sliding_window"]
    assert spec.state_bytes > (window + 1) * per_token  # the ring holds the chunk too
    assert step_bytes(facts, spec, 1, 500, runner) == 1000 + (window + 1) * per_token + 500 * spec.kv_bytes_per_token
    assert step_bytes(facts, spec, 2, 3, runner) == 1000 + 2 * (4 * per_token + 3 * spec.kv_bytes_per_token)
