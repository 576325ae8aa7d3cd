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


def test_two_distributions_with_one_plugin_name_are_both_named(make_module):
    # Both used to be reduced to one by name: the first distribution's plugin vanished silently.
    make_module("fake_twin1", FAMILY_SRC.format(name="twina", archs=["arch_t1"]))
    make_module("fake_twin2", FAMILY_SRC.format(name="twinb", archs=["arch_t2"]))
    eps = [FakeEntryPoint("twin", "fake_twin1", "ninfer-twin-one"),
           FakeEntryPoint("twin", "fake_twin2", "ninfer-twin-two")]
    with pytest.raises(RegistrationError) as ei:
        _host(eps).load()
    msg = str(ei.value)
    assert "'twin'" in msg and "ninfer-twin-one" in msg and "ninfer-twin-two" in msg
    assert "fake_twin1" in msg and "fake_twin2" in msg
    assert eps[0].loads == 0 and eps[1].loads == 0  # refused before either is imported


def test_one_distribution_listed_twice_is_one_plugin(make_module):
    make_module("fake_twice", FAMILY_SRC.format(name="twice", archs=["arch_tw"]))
    eps = [FakeEntryPoint("twice", "fake_twice", "ninfer-twice"), FakeEntryPoint("twice", "fake_twice", "ninfer-twice")]
    host = _host(eps)
    assert host.family_for_architecture("arch_tw").package == "ninfer-twice"
    assert [p.name for p in host.plugins].count("twice") == 1


def test_blocking_a_colliding_name_loads_neither(make_module):
    eps = [FakeEntryPoint("twin", "fake_twin_x", "ninfer-x"), FakeEntryPoint("twin", "fake_twin_y", "ninfer-y")]
    host = _host(eps, blocked={"twin"})
    host.load()
    assert "twin" not in [p.name for p in host.plugins]


def test_misspelled_hook_implementation_fails_at_load(make_module):
    make_module("fake_typo", """
from ninfer_core import hookimpl

@hookimpl
def ninfer_register_model_familes(register):
    register("typo", "x:Y", architectures=["arch_typo"])
""")
    host = _host([FakeEntryPoint("typo", "fake_typo", "ninfer-typo")])
    with pytest.raises(RegistrationError) as ei:
        host.load()
    msg = str(ei.value)
    assert "ninfer_register_model_familes" in msg and "ninfer-typo" in msg and "'typo'" in msg


def test_every_installed_plugin_passes_the_hook_check():
    # The plugins of this checkout (NINFER_PLUGINS / entry points) implement only declared hooks.
    host = PluginHost(PluginSelection.from_sources())
    host.load()
    assert {"kv_bf16", "openai_chat"} <= {p.name for p in host.plugins}
