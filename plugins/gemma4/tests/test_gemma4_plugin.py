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


def test_gemma4_template_is_a_built_in_name():
    from ninfer_gemma4.chat import GEMMA4_TEMPLATE

    from ninfer_core.plugins import PluginHost, PluginSelection
    from ninfer_core.tokenizer.builtin_templates import resolve_chat_template

    host = PluginHost(PluginSelection.from_sources(["ninfer_gemma4.plugin"]), builtins=[])
    assert host.registry("chat_template")["gemma4"].load() == GEMMA4_TEMPLATE
    assert resolve_chat_template("gemma4", host).source == GEMMA4_TEMPLATE
