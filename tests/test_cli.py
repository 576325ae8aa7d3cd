"""The `ninfer` command line: version, plugins listing, and serve's refusal of an unserved architecture."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from ninfer_core.artifact import TensorSpec, write_artifact
from ninfer_core.version import build_string

HAVE_QWEN35 = importlib.util.find_spec("ninfer_qwen35") is not None


def _ninfer(*args, env_extra=None, timeout=60):
    env = dict(os.environ)
    env.pop("NINFER_PLUGINS", None)
    env.pop("NINFER_DISABLE_PLUGIN_AUTOLOAD", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "ninfer_core.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _tiny_artifact(path, architecture: str):
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    manifest = {"name": "tiny", "architecture": architecture, "config": {"model_type": architecture},
                "tokenizer": {"type": "bpe", "ranks": "", "pattern": ".", "added_tokens": []}}
    write_artifact(path, manifest, [TensorSpec("w", t.dtype, tuple(t.shape), lambda: t)])
    return str(path)


def test_version_flags():
    out = _ninfer("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"ninfer {build_string()}"
    alias = subprocess.run([sys.executable, "-c", "import sys; from ninfer_core.cli import serve_main; "
                            "sys.exit(serve_main(['--version']))"], capture_output=True, text=True)
    assert alias.returncode == 0 and build_string() in alias.stdout


def test_plugins_lists_builtins_with_what_they_register():
    out = _ninfer("plugins")
    assert out.returncode == 0, out.stderr
    assert "kv_bf16  ninfer-core" in out.stdout and "kv dtype: bf16" in out.stdout
    assert "protocol: openai_chat" in out.stdout
    if HAVE_QWEN35:
        assert "qwen35  ninfer-qwen35" in out.stdout and "model family: qwen35" in out.stdout
    else:
        assert "qwen35" not in out.stdout


def test_plugins_unknown_name_exits_1():
    out = _ninfer("plugins", "--plugin", "definitely_not_installed")
    assert out.returncode == 1 and "definitely_not_installed" in out.stderr


@pytest.mark.parametrize("env", [
    pytest.param({}, id="as-installed"),
    pytest.param({"NINFER_DISABLE_PLUGIN_AUTOLOAD": "1"}, id="autoload-off"),
])
def test_serve_without_a_family_plugin_names_architecture_and_package(tmp_path, env):
    if HAVE_QWEN35 and not env:
        pytest.skip("ninfer-qwen35 is installed: it serves qwen3_5")
    art = _tiny_artifact(tmp_path / "m.ninfer", "qwen3_5")
    out = _ninfer("serve", art, "--port", "0", env_extra=env)
    assert out.returncode == 1
    assert "'qwen3_5'" in out.stderr and "ninfer-qwen35" in out.stderr


def test_serve_unknown_architecture_exits_1(tmp_path):
    art = _tiny_artifact(tmp_path / "m.ninfer", "mystery_arch")
    out = _ninfer("serve", art, "--port", "0")
    assert out.returncode == 1 and "'mystery_arch'" in out.stderr


def test_serve_corrupt_artifact_exits_1(tmp_path):
    art = _tiny_artifact(tmp_path / "m.ninfer", "qwen3_5")
    data = bytearray(open(art, "rb").read())
    open(art, "wb").write(bytes(data[: len(data) - 8]))
    out = _ninfer("serve", art, "--port", "0")
    assert out.returncode == 1 and "truncated" in out.stderr
