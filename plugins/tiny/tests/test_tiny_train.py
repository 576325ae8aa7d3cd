"""A micro training run: the loss falls, the artifact is served by ninfer-qwen35 unchanged, the
training module agrees with the plugin's runner (main and MTP), and the default-artifact hook."""

import json
import os
from pathlib import Path

import pytest
import torch

from ninfer_core.artifact import Artifact
from ninfer_core.engine.model_api import SeqView
from ninfer_core.plugins import PluginHost, PluginSelection


def test_micro_training_decreases_the_loss_and_writes_an_artifact(micro_run):
    hist = micro_run["history"]
    assert hist[0]["step"] == 0 and hist[-1]["step"] == micro_run["steps"] - 1
    assert hist[-1]["main"] < hist[0]["main"] - 0.5
    assert hist[-1]["mtp"] < hist[0]["mtp"] - 0.5
    assert all(h["tok_s"] > 0 for h in hist)
    out = Path(micro_run["artifact"]).parent
    assert (out / "checkpoint.pt").is_file() and json.loads((out / "summary.json").read_text())["steps"] == 12
    art = Artifact.open(micro_run["artifact"])
    assert art.architecture == "qwen3_5_text" and art.components == ["text", "mtp"]
    cfg = art.config
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert all(art.tensor_dtype(n) == torch.bfloat16 for n in art.tensor_names())
    assert art.chat_template and art.tokenizer_section["added_tokens"][0]["id"] == 400
    art.close()


def test_training_is_deterministic_given_the_seed(micro_run, tmp_path):
    from ninfer_tiny.train import RECIPES, train

    again = train(tmp_path, RECIPES["micro"], seed=0, workers=1, device="cpu", steps=3)
    assert [h["loss"] for h in again["history"]][:1] == [micro_run["history"][0]["loss"]]
    other = train(tmp_path / "b", RECIPES["micro"], seed=0, workers=1, device="cpu", steps=3)
    assert Path(again["artifact"]).read_bytes() == Path(other["artifact"]).read_bytes()


def test_a_resumed_run_ends_with_the_same_weights(tmp_path):
    from ninfer_tiny.train import RECIPES, train

    whole = train(tmp_path / "whole", RECIPES["micro"], seed=1, workers=1, device="cpu", steps=6)
    train(tmp_path / "parts", RECIPES["micro"], seed=1, workers=1, device="cpu", steps=3)
    resumed = train(tmp_path / "parts", RECIPES["micro"], seed=1, workers=1, device="cpu", steps=6, resume=True)
    assert resumed["history"][0]["step"] == 3 and resumed["steps"] == 6
    assert Path(whole["artifact"]).read_bytes() == Path(resumed["artifact"]).read_bytes()


def test_fit_minutes_shortens_the_schedule_and_the_printed_count_reproduces_it(tmp_path):
    import dataclasses

    from ninfer_tiny.train import FIT_PROBE, FIT_SKIP, RECIPES, train

    end = FIT_SKIP + FIT_PROBE
    recipe = dataclasses.replace(RECIPES["micro"], steps=end + 20, warmup=end + 5, log_every=50)
    fitted = train(tmp_path / "fit", recipe, seed=2, workers=1, device="cpu", fit_minutes=0.001)
    assert fitted["steps"] == fitted["schedule_steps"] == end  # no time left after the probe
    again = train(tmp_path / "again", recipe, seed=2, workers=1, device="cpu", schedule_steps=end)
    assert again["steps"] == end
    assert Path(fitted["artifact"]).read_bytes() == Path(again["artifact"]).read_bytes()


def test_the_fit_probe_skips_the_warm_up_steps():
    """Slow first steps (set-up) must not count: the H200 probe read 0.50 s/step for ~0.28."""
    from ninfer_tiny.train import FIT_PROBE, FIT_SKIP, StepProbe

    now = [0.0]
    synced = []
    probe = StepProbe(clock=lambda: now[0], sync=lambda: synced.append(now[0]))
    answers = []
    for k in range(1, FIT_SKIP + FIT_PROBE + 10):
        now[0] += 3.0 if k <= FIT_SKIP else 0.25  # step k takes this long
        answers.append(probe.done(k))
    got = [a for a in answers if a is not None]
    assert got == [pytest.approx(0.25)]  # once, the steady-state time only
    assert answers.index(got[0]) == FIT_SKIP + FIT_PROBE - 1
    assert len(synced) == 2  # the GPU queue is drained before both clock readings


def test_fitted_steps():
    from ninfer_tiny.train import fitted_steps

    assert fitted_steps(25, 0.3, 300.0, 3000) == 25 + 1000
    assert fitted_steps(25, 0.3, 3000.0, 3000) == 3000  # never longer than the recipe
    assert fitted_steps(25, 0.3, -5.0, 3000) == 25  # no time left: stop where the probe ended


def test_attention_backend_is_math_only_on_cuda():
    from ninfer_tiny.train import attention_backend

    with attention_backend("cuda", "math"):
        assert torch.backends.cuda.math_sdp_enabled()
        assert not torch.backends.cuda.flash_sdp_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert not torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()  # restored
    for dev, choice in (("cuda", "auto"), ("cpu", "math")):
        with attention_backend(dev, choice):
            assert torch.backends.cuda.flash_sdp_enabled()
    with pytest.raises(ValueError):
        attention_backend("cuda", "flash")


def test_training_runs_the_torch_gdn_path_even_when_fla_is_installed(monkeypatch):
    """Simulate transformers having bound fla: its wrappers must be bypassed (fla's backward
    refuses to run on Hopper with Triton 3.6)."""
    import functools

    import transformers.models.qwen3_5.modeling_qwen3_5 as hf_mod
    from ninfer_tiny.model import TinyQwen, text_config

    calls = []
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn"):
        current = getattr(hf_mod, name)

        def fake_fla(*args, _name=name, **kwargs):
            calls.append(_name)
            raise RuntimeError("fla: backward not supported on this GPU")

        monkeypatch.setattr(hf_mod, name, functools.wraps(current)(fake_fla))  # as transformers wraps
    cfg = text_config(64, hidden=32, layers=4, heads=2, kv_heads=1, head_dim=16, lin_key_heads=1,
                      lin_value_heads=2, lin_head_dim=16, intermediate=64, eos_token_id=1)  # fmt: skip
    model = TinyQwen(cfg, seed=0)
    loss, _, _ = model(torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)))
    loss.backward()
    assert calls == [] and bool(loss.isfinite())
    gdn = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    assert len(gdn) == 3 and all(m.A_log.grad is not None for m in gdn)


def test_the_qwen35_plugin_loads_and_generates_from_the_artifact(micro_run):
    from ninfer_qwen35.family import Qwen35Family
    from ninfer_tiny.data import project_template

    from ninfer_core.tokenizer.bpe import Tokenizer

    h = PluginHost(PluginSelection(names=["qwen35"]), builtins=[]).load()
    art = Artifact.open(micro_run["artifact"])
    assert h.family_for_architecture(art.architecture).name == "qwen35"
    runner = Qwen35Family().load(art, device="cpu", dtype="float32")
    tok = Tokenizer(art.tokenizer_section)
    ids = project_template().render_ids(tok, [{"role": "user", "content": "What is 2 + 3?"}])
    runner.allocate_cache(num_pages=8, num_slots=1, page_size=16)
    seq = list(ids)
    logits = runner.prefill(SeqView(0, list(range(8)), 0), seq)
    for _ in range(5):
        seq.append(int(logits.argmax(-1).reshape(-1)[0]))
        logits = runner.decode([SeqView(0, list(range(8)), len(seq) - 1)], [seq[-1]])
    assert all(0 <= t < art.config["vocab_size"] for t in seq[len(ids):])
    art.close()


def test_training_module_matches_the_plugin_runner_main_and_mtp(micro_run):
    """The weights as trained (bf16-rounded) give the plugin's logits: names and MTP math agree."""
    from ninfer_qwen35.family import Qwen35Family
    from ninfer_tiny.model import TinyQwen

    art = Artifact.open(micro_run["artifact"])
    model = TinyQwen(art.config).eval()
    state = {n: art.get_tensor(n).float() for n in art.tensor_names()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    runner = Qwen35Family().load(art, device="cpu", dtype="float32")
    ids = torch.randint(0, 400, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        ref = model.lm_head(hidden)[0]
        mtp_ref = model.lm_head(model.mtp_hidden(ids[:, 1:], hidden[:, :-1], start=1))[0]
    runner.allocate_cache(num_pages=4, num_slots=1, page_size=16)
    got_h = runner.forward_hidden([SeqView(0, [0, 1, 2, 3], 0)], [ids[0].tolist()])
    got = runner.logits(got_h)
    mtp_got, _, _ = runner.mtp_forward(ids[0, 1:].tolist(), got_h[:-1], start=1)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4
    assert float((mtp_got - mtp_ref).abs().max() / mtp_ref.abs().max()) < 1e-4
    art.close()


def test_packaged_artifact_wins_over_the_random_default_in_either_registration_order(
    micro_run, monkeypatch, tmp_path
):
    import ninfer_qwen35.plugin
    import ninfer_tiny.plugin
    import ninfer_tiny.train
    import pluggy

    from ninfer_core import hookspecs

    shipped = tmp_path / "ninfer-tiny.ninfer"
    shipped.write_bytes(Path(micro_run["artifact"]).read_bytes())
    monkeypatch.setattr(ninfer_tiny.train, "package_artifact_path", lambda: shipped)
    # pluggy calls the most recently registered implementation first unless one is tryfirst:
    # register in both orders, so the test fails if the choice rested on load order.
    for order in ((ninfer_tiny.plugin, ninfer_qwen35.plugin), (ninfer_qwen35.plugin, ninfer_tiny.plugin)):
        pm = pluggy.PluginManager("ninfer")
        pm.add_hookspecs(hookspecs)
        for mod in order:
            pm.register(mod)
        assert pm.hook.ninfer_default_artifact(cache_dir=str(tmp_path / "cache")) == str(shipped)
    h = PluginHost(PluginSelection(names=["qwen35", "tiny"]), builtins=[]).load()
    assert h.default_artifact(str(tmp_path / "cache")) == str(shipped)
    assert not os.path.exists(tmp_path / "cache")  # the random default was never built


def test_without_a_packaged_artifact_the_hook_answers_none(monkeypatch, tmp_path):
    import ninfer_tiny.train
    from ninfer_tiny import plugin

    monkeypatch.setattr(ninfer_tiny.train, "package_artifact_path", lambda: tmp_path / "absent.ninfer")
    assert plugin.ninfer_default_artifact(str(tmp_path)) is None
    h = PluginHost(PluginSelection(names=["tiny"]), builtins=[]).load()
    assert h.default_artifact(str(tmp_path)) is None


def test_the_evaluation_runs_end_to_end_against_a_live_server(micro_run):
    from ninfer_tiny.evaluate import TARGETS, evaluate, format_table

    scores = evaluate(micro_run["artifact"], per_kind=2, prose_docs=2, max_tokens=12)
    assert set(scores) == {"tool", "json", "addition", "mtp", "ppl"}
    assert all(0.0 <= scores[k] <= 1.0 for k in TARGETS)
    assert 1.0 < scores["ppl"] < 10 * 512  # a barely trained model: above 1, below many times uniform
    table = format_table(scores, 2)
    assert "held-out prose perplexity" in table and table.count("\n") == 6


@pytest.mark.parametrize("bad", [["--recipe", "nope", "--out", "x"], []])
def test_train_cli_refuses_bad_arguments(bad, capsys):
    from ninfer_tiny.train import main

    with pytest.raises(SystemExit) as exc:
        main(bad)
    assert exc.value.code == 2


def test_importing_the_plugin_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, ninfer_tiny.plugin as p; p.packaged_artifact(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
