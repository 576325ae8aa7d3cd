import subprocess
import sys

from ninfer_core.plugins import PluginHost, PluginSelection


def test_importing_the_plugin_does_not_import_torch():
    code = "import sys, ninfer_gemma4.plugin; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_family_registers_both_architectures():
    host = PluginHost(PluginSelection(names=["ninfer_gemma4.plugin"]), builtins=[]).load()
    for arch in ("gemma4", "gemma4_text"):
        assert host.family_for_architecture(arch).name == "gemma4"
