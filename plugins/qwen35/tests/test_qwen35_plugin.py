"""Registration through the plugin host, and the default artifact of `ninfer serve`."""

import os
import subprocess
import sys

from ninfer_core.artifact import Artifact
from ninfer_core.engine.model_api import SeqView
from ninfer_core.plugins import PluginHost, PluginSelection


def test_importing_the_plugin_does_not_import_torch():
    code = "import sys, ninfer_qwen35.plugin; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def host():
    return PluginHost(PluginSelection(names=["qwen35"]), builtins=[]).load()


def test_family_registered_for_every_architecture():
    h = host()
    for arch in ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"):
        reg = h.family_for_architecture(arch)
        assert reg.name == "qwen35" and reg.package == "ninfer-qwen35"
    from ninfer_qwen35.family import Qwen35Family

    assert h.resolve("model_family", "qwen35").load() is Qwen35Family


def test_chat_format_templates_presets_and_bench_shapes_come_from_the_family():
    """What core used to assume about Qwen3.5 is stated by the family (issue 16)."""
    from ninfer_qwen35.chat import CHATML_TEMPLATE, QWEN35_CHAT_FORMAT, QWEN35_TEMPLATE, SAMPLING_PRESETS
    from ninfer_qwen35.family import Qwen35Family

    from ninfer_core.bench.shapes import default_shape, shapes

    h = host()
    templates = {n: r.load() for n, r in h.registry("chat_template").items()}
    assert templates == {"qwen35": QWEN35_TEMPLATE, "qwen3.5": QWEN35_TEMPLATE, "chatml": CHATML_TEMPLATE}
    fam = Qwen35Family()
    assert fam.chat_format(None) is QWEN35_CHAT_FORMAT and fam.chat_template == QWEN35_TEMPLATE
    assert fam.sampling_presets("qwen3_5") == SAMPLING_PRESETS
    assert SAMPLING_PRESETS["thinking"]["top_k"] == 20 and SAMPLING_PRESETS["non_thinking"]["presence_penalty"] == 1.5
    fmt = QWEN35_CHAT_FORMAT
    assert (fmt.reasoning_open, fmt.reasoning_close, fmt.turn_opener) == ("<think>", "</think>", "<|im_start|>")
    assert fmt.tools.forced_opener("f") == "<tool_call>\n<function=f>\n"
    assert set(shapes(h)) == {"qwen3.5-9b", "qwen3.5-27b", "qwen3.5-35b-a3b"} and default_shape(h) == "qwen3.5-9b"
    assert shapes(h)["qwen3.5-35b-a3b"]["model_type"] == "qwen3_5_moe"


def test_default_artifact_is_built_once_and_served(tmp_path):
    from ninfer_qwen35.chat import QWEN35_TEMPLATE

    path = host().default_artifact(str(tmp_path))
    assert path and os.path.exists(path)
    assert os.path.basename(path).startswith("ninfer-tiny-random-") and path.endswith(".ninfer")
    mtime = os.stat(path).st_mtime_ns
    assert host().default_artifact(str(tmp_path)) == path
    assert os.stat(path).st_mtime_ns == mtime  # reused, not rebuilt
    assert [p for p in os.listdir(tmp_path) if p != os.path.basename(path)] == []  # no temp files left

    art = Artifact.open(path)
    assert art.name == "ninfer-tiny-random" and art.architecture == "qwen3_5"
    assert art.chat_template == QWEN35_TEMPLATE
    assert art.config["text_config"]["vocab_size"] == 248320

    from ninfer_qwen35.family import Qwen35Family

    from ninfer_core.tokenizer import Tokenizer

    tok = Tokenizer.from_section(art.tokenizer_section)
    runner = Qwen35Family().load(art)
    assert runner.info.vocab_size == 248320 and runner.info.eos_token_ids == tok.eos_token_ids
    runner.allocate_cache(4, 1)
    ids = tok.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    logits = runner.prefill(SeqView(0, [0], 0), ids)
    assert logits.shape == (248320,) and bool(logits.isfinite().all())


def test_default_artifact_bytes_are_deterministic(tmp_path):
    from ninfer_qwen35.default_model import build_default_artifact

    a = build_default_artifact(tmp_path / "a.ninfer")
    b = build_default_artifact(tmp_path / "b.ninfer")
    with open(a, "rb") as fa, open(b, "rb") as fb:
        assert fa.read() == fb.read()


def test_broken_default_artifact_is_rebuilt(tmp_path):
    from ninfer_qwen35.default_model import ensure_default_artifact

    path = ensure_default_artifact(tmp_path)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    assert ensure_default_artifact(tmp_path) == path
    assert os.path.getsize(path) == size
    Artifact.open(path).close()
