"""Each registry is resolved where its flag is read: the Loader hands the engine the KV dtype
`--kv-dtype` names and the prefix-cache builder the cache flags pick, both from the plugin host."""

from __future__ import annotations

import sys
import textwrap
import types

import pytest

from ninfer_core.config import EngineOptions
from ninfer_core.engine.cache import build_context_cache
from ninfer_core.engine.engine import Engine
from ninfer_core.plugins import DEFAULT_PLUGINS, PluginError, PluginHost, PluginSelection
from ninfer_core.server.loader import engine_plugins
from ninfer_core.testing import ToyRunner, ToyTokenizer

PLUGIN_SRC = """
from ninfer_core import hookimpl

BUILT = []
FAKE8 = object()

def build(runner, pages, options, state_bytes, page_size):
    BUILT.append((runner, state_bytes, page_size))
    return None

@hookimpl
def ninfer_register_kv_dtypes(register):
    register("fake8", "fake_registry.plugin:FAKE8")

@hookimpl
def ninfer_register_prefix_caches(register):
    register("checkpoint_catalog", "fake_registry.plugin:build")
    register("none", None)
"""


@pytest.fixture
def plugin(monkeypatch):
    mod = types.ModuleType("fake_registry.plugin")
    exec(textwrap.dedent(PLUGIN_SRC), mod.__dict__)  # noqa: S102 - a plugin module made in the test
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def _host(builtins):
    return PluginHost(PluginSelection(names=["fake_registry.plugin"], autoload=False), entry_points=[],
                      builtins=builtins)


def test_the_builtin_registrations_are_what_the_engine_gets():
    host = PluginHost(PluginSelection(autoload=False), entry_points=[])
    kv, cache = engine_plugins(host, EngineOptions(prefix_reuse=True))
    assert kv.name == "bf16" and cache is build_context_cache
    assert engine_plugins(host, EngineOptions(prefix_reuse=False))[1] is None  # --no-prefix-reuse: "none"


def test_a_plugins_kv_dtype_and_prefix_cache_reach_the_engine_and_runner(plugin):
    # The built-in context cache blocked: the plugin's "checkpoint_catalog" is the only one.
    host = _host([b for b in DEFAULT_PLUGINS if b[0] != "context_cache"])
    kv, cache = engine_plugins(host, EngineOptions(kv_dtype="fake8", prefix_reuse=True))
    assert kv is plugin.FAKE8 and cache is plugin.build

    seen = []
    runner = ToyRunner()
    runner.configure = seen.append
    engine = Engine(runner, ToyTokenizer(), EngineOptions(prefix_reuse=True), prefix_cache=cache, kv_dtype=kv)
    assert plugin.BUILT and plugin.BUILT[0][0] is runner  # the registry's builder made the cache
    assert engine.cache is None and engine.kv_dtype is plugin.FAKE8
    assert seen[0].kv_dtype is plugin.FAKE8


def test_an_unknown_kv_dtype_names_the_alternatives(plugin):
    host = _host([b for b in DEFAULT_PLUGINS if b[0] != "context_cache"])
    with pytest.raises(PluginError, match="unknown kv dtype 'int3'.*bf16.*fake8"):
        engine_plugins(host, EngineOptions(kv_dtype="int3"))


def test_protocols_reach_the_engine_only_through_its_client_interface():
    """No protocol module takes the engine's lock or reads its scheduler (ARCHITECTURE.md: the
    server reaches an Engine only through the engine client)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "ninfer_core"
    found = [f"{p.relative_to(root)}:{i}" for folder in ("protocols", "server") for p in (root / folder).glob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\b(eng|engine)\.(_cv|scheduler)\b", line)]
    assert not found, f"engine internals used by the HTTP side: {found}"
