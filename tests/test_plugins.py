"""Plugin discovery, selection and registration, with fake entry points (nothing installed)."""

from __future__ import annotations

import sys
import textwrap
import types

import pytest

from ninfer_core.plugins import (
    MissingFamilyError,
    PluginError,
    PluginHost,
    PluginLoadError,
    PluginSelection,
    RegistrationError,
)


class FakeDist:
    def __init__(self, name, version="1.2.3"):
        self.name, self.version = name, version
        self.metadata = {"Name": name}


class FakeEntryPoint:
    """Duck-types importlib.metadata.EntryPoint: name, value, dist, load()."""

    def __init__(self, name, module, dist):
        self.name, self.value, self.dist = name, module, FakeDist(dist)
        self.loads = 0

    def load(self):
        self.loads += 1
        import importlib

        return importlib.import_module(self.value)


@pytest.fixture
def make_module(monkeypatch):
    made = []

    def make(name: str, source: str):
        mod = types.ModuleType(name)
        exec(textwrap.dedent(source), mod.__dict__)
        monkeypatch.setitem(sys.modules, name, mod)
        made.append(name)
        return mod

    return make


FAMILY_SRC = """
from ninfer_core import hookimpl

@hookimpl
def ninfer_register_model_families(register):
    register("{name}", "fakefam:Family", architectures={archs!r})
"""


def _host(eps, **sel):
    return PluginHost(PluginSelection(**sel), entry_points=eps)


def test_discovery_registers_families_and_builtins(make_module):
    make_module("fake_fam_a", FAMILY_SRC.format(name="fama", archs=["arch_a"]))
    ep = FakeEntryPoint("fama", "fake_fam_a", "ninfer-fama")
    host = _host([ep])
    assert host.family_for_architecture("arch_a").package == "ninfer-fama"
    assert "bf16" in host.registry("kv_dtype")
    assert {"ops", "openai_chat"} <= set(host.registry("protocol"))
    rows = {r["name"]: r for r in host.describe()}
    assert rows["fama"]["package"] == "ninfer-fama" and rows["fama"]["version"] == "1.2.3"
    assert "model family: fama" in rows["fama"]["registers"]
    assert rows["kv_bf16"]["builtin"] and "kv dtype: bf16" in rows["kv_bf16"]["registers"]


def test_discovery_is_lazy_and_once(make_module):
    make_module("fake_fam_b", FAMILY_SRC.format(name="famb", archs=["arch_b"]))
    ep = FakeEntryPoint("famb", "fake_fam_b", "ninfer-famb")
    host = _host([ep])
    assert ep.loads == 0  # nothing at construction
    host.registry("model_family")
    host.registry("protocol")
    host.load()
    assert ep.loads == 1


def test_allow_list_loads_only_named(make_module):
    make_module("fake_fam_c", FAMILY_SRC.format(name="famc", archs=["arch_c"]))
    make_module("fake_fam_d", FAMILY_SRC.format(name="famd", archs=["arch_d"]))
    eps = [FakeEntryPoint("famc", "fake_fam_c", "ninfer-famc"), FakeEntryPoint("famd", "fake_fam_d", "ninfer-famd")]
    host = _host(eps, names=["famd"])
    assert set(host.registry("model_family")) == {"famd"}
    assert eps[0].loads == 0


def test_env_allow_list_and_blocking():
    sel = PluginSelection.from_sources(["x", "no:openai_chat"], env={"NINFER_PLUGINS": "a, b,no:c"})
    assert sel.names == ["a", "b", "x"]
    assert sel.blocked == {"c", "openai_chat"}
    assert sel.autoload
    sel = PluginSelection.from_sources([], env={"NINFER_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert not sel.autoload and sel.names == []


def test_blocked_builtin_is_not_loaded():
    host = _host([], blocked={"openai_chat"})
    assert "openai_chat" not in host.registry("protocol")
    assert "ops" in host.registry("protocol")


def test_autoload_disabled_loads_only_named(make_module):
    make_module("fake_fam_e", FAMILY_SRC.format(name="fame", archs=["arch_e"]))
    eps = [FakeEntryPoint("fame", "fake_fam_e", "ninfer-fame")]
    assert _host(eps, autoload=False).registry("model_family") == {}
    assert set(_host(eps, autoload=False, names=["fame"]).registry("model_family")) == {"fame"}


def test_dotted_module_plugin_without_entry_point(make_module):
    make_module("mypkg_myplugin", FAMILY_SRC.format(name="mine", archs=["arch_mine"]))
    # a dotted path: give the module a dotted name too
    sys.modules["mypkg.myplugin"] = sys.modules["mypkg_myplugin"]
    sys.modules.setdefault("mypkg", types.ModuleType("mypkg"))
    try:
        host = _host([], names=["mypkg.myplugin"])
        assert host.family_for_architecture("arch_mine").plugin == "mypkg.myplugin"
    finally:
        sys.modules.pop("mypkg.myplugin", None)
        sys.modules.pop("mypkg", None)


def test_unknown_named_plugin_is_an_error():
    with pytest.raises(PluginError, match="'nosuch' was requested"):
        _host([], names=["nosuch"]).load()


def test_broken_plugin_is_reported_with_package():
    class Broken(FakeEntryPoint):
        def load(self):
            raise ImportError("No module named 'missing_dep'")

    host = _host([Broken("broken", "fake_broken", "ninfer-broken")])
    with pytest.raises(PluginLoadError) as ei:
        host.load()
    msg = str(ei.value)
    assert "ninfer-broken" in msg and "missing_dep" in msg and "'broken'" in msg


def test_dotted_module_that_fails_to_import_is_reported():
    with pytest.raises(PluginLoadError, match="no_such_pkg_xyz.mod"):
        _host([], names=["no_such_pkg_xyz.mod"]).load()


def test_duplicate_registration_names_both_packages(make_module):
    make_module("fake_dup1", FAMILY_SRC.format(name="same", archs=["arch_x"]))
    make_module("fake_dup2", FAMILY_SRC.format(name="same", archs=["arch_y"]))
    eps = [FakeEntryPoint("dup1", "fake_dup1", "ninfer-dup-one"), FakeEntryPoint("dup2", "fake_dup2", "ninfer-dup-two")]
    with pytest.raises(RegistrationError) as ei:
        _host(eps).registry("model_family")
    assert "ninfer-dup-one" in str(ei.value) and "ninfer-dup-two" in str(ei.value)


def test_duplicate_architecture_names_both_packages(make_module):
    make_module("fake_arch1", FAMILY_SRC.format(name="one", archs=["shared_arch"]))
    make_module("fake_arch2", FAMILY_SRC.format(name="two", archs=["shared_arch"]))
    eps = [FakeEntryPoint("a1", "fake_arch1", "ninfer-one"), FakeEntryPoint("a2", "fake_arch2", "ninfer-two")]
    with pytest.raises(RegistrationError, match="shared_arch.*ninfer-one.*ninfer-two"):
        _host(eps).registry("model_family")


def test_duplicate_builtin_kv_dtype_is_refused(make_module):
    make_module("fake_kv", """
from ninfer_core import hookimpl

@hookimpl
def ninfer_register_kv_dtypes(register):
    register("bf16", "x:y")
""")
    with pytest.raises(RegistrationError, match="ninfer-core.*ninfer-kvfake"):
        _host([FakeEntryPoint("kvfake", "fake_kv", "ninfer-kvfake")]).registry("kv_dtype")


def test_missing_family_names_architecture_and_package():
    host = _host([])
    with pytest.raises(MissingFamilyError) as ei:
        host.family_for_architecture("qwen3_5")
    assert "qwen3_5" in str(ei.value) and "ninfer-qwen35" in str(ei.value)
    with pytest.raises(MissingFamilyError, match="'mystery'"):
        host.family_for_architecture("mystery")


def test_resolve_unknown_name_lists_alternatives():
    with pytest.raises(PluginError, match="unknown kv dtype 'int3'.*bf16"):
        _host([]).resolve("kv_dtype", "int3")
    assert _host([]).resolve("kv_dtype", "bf16").load().bytes_per_element == 2


def test_registration_targets_are_lazy(make_module):
    make_module("fake_lazy", """
from ninfer_core import hookimpl

@hookimpl
def ninfer_register_kv_dtypes(register):
    register("lazy8", "fake_lazy_target_not_imported:Thing")
""")
    host = _host([FakeEntryPoint("lazy", "fake_lazy", "ninfer-lazy")])
    reg = host.resolve("kv_dtype", "lazy8")
    assert "fake_lazy_target_not_imported" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        reg.load()
