"""The plugin host: discovery through entry points (group "ninfer"), selection, registries.

Built-in features are ordinary plugins listed in DEFAULT_PLUGINS and registered through the same
hooks as outside ones. Discovery happens once, on first use (`PluginHost.load()`), never at import.

Selection (pytest `-p` style):
  * `--plugin NAME` (repeatable) or `NINFER_PLUGINS=a,b`: load only these entry-point plugins
    (built-ins still load). A dotted module path (`--plugin mypkg.myplugin`) is imported directly,
    without an entry point.
  * `no:NAME` in either list blocks that plugin, a built-in included.
  * `NINFER_DISABLE_PLUGIN_AUTOLOAD=1`: no entry-point plugin loads unless named.
A plugin that fails to import raises PluginLoadError naming its package and the error; two
distributions registering one entry-point name, or a hook implementation no spec declares, raise
RegistrationError naming both distributions (the plugin and its package).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Iterable

import pluggy

from ninfer_core import hookspecs

GROUP = "ninfer"

# Built-in plugins: (plugin name, module). Registered exactly as outside plugins are.
DEFAULT_PLUGINS: list[tuple[str, str]] = [
    ("kv_bf16", "ninfer_core.engine.kv_bf16"),
    ("kv_quant", "ninfer_core.quant.kv"),
    ("vision_residencies", "ninfer_core.media.residency"),
    ("ops", "ninfer_core.protocols.ops"),
    ("context_cache", "ninfer_core.engine.cache"),
    ("slots", "ninfer_core.protocols.slots"),
    ("openai_chat", "ninfer_core.protocols.openai_chat"),
    ("llamacpp", "ninfer_core.protocols.llamacpp"),
    ("openai_completions", "ninfer_core.protocols.openai_completions"),
    ("tokenize", "ninfer_core.protocols.tokenize_routes"),
    ("rerank", "ninfer_core.protocols.rerank"),
    ("anthropic", "ninfer_core.protocols.anthropic"),
    ("responses", "ninfer_core.protocols.responses"),
    ("webui", "ninfer_core.protocols.webui"),
]

# Hook name -> registry kind.
KINDS = {
    "model_family": "ninfer_register_model_families",
    "spec_backend": "ninfer_register_spec_backends",
    "kv_dtype": "ninfer_register_kv_dtypes",
    "vision_residency": "ninfer_register_vision_residencies",
    "prefix_cache": "ninfer_register_prefix_caches",
    "protocol": "ninfer_register_protocols",
    "chat_template": "ninfer_register_chat_templates",
    "bench_shape": "ninfer_register_bench_shapes",
}

# Architectures we know a package for, so a missing family names what to install (the project's
# catalog of distributions, kept outside this package: ninfer_catalog).
try:
    from ninfer_catalog import FAMILY_PACKAGES as KNOWN_FAMILY_PACKAGES
except ImportError:  # pragma: no cover - a core installed without its catalog: generic hints
    KNOWN_FAMILY_PACKAGES = {}


# Speculative backends and serve options we know a package for, so a missing one names what to install.
KNOWN_SPEC_PACKAGES = {"mtp": "ninfer-spec-mtp", "dflash": "ninfer-spec-dflash", "dflash2": "ninfer-spec-dflash"}
KNOWN_OPTION_PACKAGES = {
    "--draft-tokens": "ninfer-spec-mtp", "--lm-head-draft": "ninfer-spec-mtp",
    "--full-draft-head": "ninfer-spec-mtp", "--adaptive-mtp": "ninfer-spec-mtp",
    "--mtp-attention-window": "ninfer-spec-mtp",
}


class PluginError(Exception):
    """Base of plugin problems; str() is a message for the user."""


class PluginLoadError(PluginError):
    def __init__(self, name: str, package: str, error: BaseException):
        self.name, self.package, self.error = name, package, error
        super().__init__(
            f"plugin {name!r} from package {package} failed to load: {type(error).__name__}: {error}"
        )


class RegistrationError(PluginError):
    pass


class MissingFamilyError(PluginError):
    def __init__(self, architecture: str, known: Iterable[str]):
        self.architecture = architecture
        pkg = KNOWN_FAMILY_PACKAGES.get(architecture)
        hint = (
            f"install the package {pkg} (pip install {pkg})"
            if pkg
            else "install a model-family plugin package that serves it"
        )
        served = ", ".join(sorted(known)) or "none"
        super().__init__(
            f"no installed plugin serves the architecture {architecture!r}: {hint}. "
            f"Architectures served by installed plugins: {served}."
        )


@dataclass
class Registration:
    kind: str
    name: str
    target: str | Any
    plugin: str
    package: str
    extra: dict = field(default_factory=dict)

    def load(self) -> Any:
        """Import the "module:attribute" target (or return a non-string target as is)."""
        if not isinstance(self.target, str):
            return self.target
        mod, _, attr = self.target.partition(":")
        obj = importlib.import_module(mod)
        for part in attr.split(".") if attr else []:
            obj = getattr(obj, part)
        return obj


@dataclass
class OptionSpec:
    """One serve option a plugin adds (`ninfer_add_serve_options`)."""

    flags: tuple[str, ...]
    kwargs: dict
    plugin: str
    package: str

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or next((f for f in self.flags if f.startswith("--")), self.flags[0]
                                               ).lstrip("-").replace("-", "_")


@dataclass
class LoadedPlugin:
    name: str
    package: str
    version: str
    module: str
    builtin: bool


@dataclass
class PluginSelection:
    """Which plugins to load; built from `--plugin` values and the environment."""

    names: list[str] = field(default_factory=list)  # allow-list (entry-point names or dotted modules)
    blocked: set[str] = field(default_factory=set)
    autoload: bool = True

    @classmethod
    def from_sources(cls, cli: Iterable[str] = (), env: dict | None = None) -> "PluginSelection":
        env = os.environ if env is None else env
        names: list[str] = []
        blocked: set[str] = set()
        raw = [s.strip() for s in env.get("NINFER_PLUGINS", "").split(",") if s.strip()]
        for item in list(raw) + [c.strip() for c in cli if c and c.strip()]:
            if item.startswith("no:"):
                blocked.add(item[3:])
            elif item not in names:
                names.append(item)
        autoload = env.get("NINFER_DISABLE_PLUGIN_AUTOLOAD", "").strip() not in ("1", "true", "yes")
        return cls(names=names, blocked=blocked, autoload=autoload)


def _entry_point_dist(ep) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return ("unknown", "")
    try:
        return (dist.metadata["Name"] or dist.name, dist.version or "")
    except Exception:  # noqa: BLE001 - a fake or odd distribution object
        return (getattr(dist, "name", "unknown"), getattr(dist, "version", ""))


class PluginHost:
    """Loads plugins once and keeps one registry per hook family."""

    def __init__(self, selection: PluginSelection | None = None, entry_points: list | None = None,
                 builtins: list[tuple[str, str]] | None = None):
        self.selection = selection or PluginSelection()
        self._entry_points = entry_points  # injected by tests; None means importlib.metadata
        self._builtins = DEFAULT_PLUGINS if builtins is None else builtins
        self.pm = pluggy.PluginManager("ninfer")
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[LoadedPlugin] = []
        self._registries: dict[str, dict[str, Registration]] | None = None
        self._options: list[OptionSpec] | None = None
        self._loaded = False

    # discovery ------------------------------------------------------------------------------
    def _discover(self) -> list:
        if self._entry_points is not None:
            return list(self._entry_points)
        return list(metadata.entry_points(group=GROUP))

    def _register_module(self, name: str, module_path: str, package: str, version: str, builtin: bool):
        try:
            module = importlib.import_module(module_path)
        except Exception as e:  # noqa: BLE001 - every import failure is reported, never skipped
            raise PluginLoadError(name, package, e) from e
        self._add(name, module, package, version, module_path, builtin)

    def _add(self, name, module, package, version, module_path, builtin):
        if self.pm.has_plugin(name):
            other = next(p for p in self.plugins if p.name == name)
            raise RegistrationError(
                f"two plugins are named {name!r}: one from {other.package}, one from {package}"
            )
        self.pm.register(module, name=name)
        self.plugins.append(LoadedPlugin(name, package, version, module_path, builtin))

    def load(self) -> "PluginHost":
        """Discover and import the selected plugins, once."""
        if self._loaded:
            return self
        sel = self.selection
        for name, mod in self._builtins:
            if name not in sel.blocked:
                self._register_module(name, mod, "ninfer-core", _core_version(), True)
        eps = _entry_points_by_name(self._discover(), sel.blocked)
        wanted = [n for n in sel.names if n not in sel.blocked]
        for ep_name, ep in eps.items():
            if ep_name in sel.blocked:
                continue
            if not sel.autoload or sel.names:
                if ep_name not in wanted:
                    continue
            package, version = _entry_point_dist(ep)
            try:
                module = ep.load()
            except Exception as e:  # noqa: BLE001
                raise PluginLoadError(ep_name, package, e) from e
            self._add(ep_name, module, package, version, getattr(ep, "value", ep_name), False)
        for name in wanted:
            if name in eps or self.pm.has_plugin(name):
                continue
            if "." in name:
                # A dotted module path: loaded without an entry point, as `pytest -p` does.
                self._register_module(name, name, f"module {name}", "", False)
            else:
                known = ", ".join(sorted(eps)) or "none"
                raise PluginError(
                    f"plugin {name!r} was requested but no installed package provides it "
                    f"(entry-point plugins found: {known})"
                )
        self._check_hooks()
        self._loaded = True
        return self

    def _check_hooks(self) -> None:
        """Refuse a hook implementation no spec declares (a misspelled `ninfer_` name would otherwise
        never be called), naming the plugin and its package; pluggy's `check_pending` finds them."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            plugin = next((p for p in self.plugins if self.pm.get_plugin(p.name) is e.plugin), None)
            who = f"plugin {plugin.name!r} ({plugin.package})" if plugin else "a plugin"
            names = sorted(n for n in dir(e.plugin) if n.startswith("ninfer_") and not hasattr(hookspecs, n))
            raise RegistrationError(
                f"{who} implements {', '.join(names) or 'a hook'} but no hook spec has that name "
                f"(misspelled? the hooks are listed in ninfer_core/hookspecs.py)") from e

    # registries -----------------------------------------------------------------------------
    def _build_registries(self) -> dict[str, dict[str, Registration]]:
        regs: dict[str, dict[str, Registration]] = {k: {} for k in KINDS}
        for kind, hook_name in KINDS.items():
            hook = getattr(self.pm.hook, hook_name)
            for impl in hook.get_hookimpls():
                plugin = next(p for p in self.plugins if p.name == impl.plugin_name)

                def register(name: str, target: Any, _kind=kind, _plugin=plugin, **extra):
                    taken = regs[_kind].get(name)
                    if taken is not None:
                        raise RegistrationError(
                            f"{_kind.replace('_', ' ')} {name!r} is registered twice: by plugin "
                            f"{taken.plugin!r} ({taken.package}) and by plugin {_plugin.name!r} "
                            f"({_plugin.package})"
                        )
                    regs[_kind][name] = Registration(_kind, name, target, _plugin.name, _plugin.package, extra)

                impl.function(register=register)
        # One architecture may be served by one family only.
        owners: dict[str, Registration] = {}
        for reg in regs["model_family"].values():
            for arch in reg.extra.get("architectures", []) or [reg.name]:
                if arch in owners:
                    o = owners[arch]
                    raise RegistrationError(
                        f"architecture {arch!r} is claimed by model family {o.name!r} ({o.package}) "
                        f"and by {reg.name!r} ({reg.package})"
                    )
                owners[arch] = reg
        return regs

    def registry(self, kind: str) -> dict[str, Registration]:
        self.load()
        if self._registries is None:
            self._registries = self._build_registries()
        return self._registries[kind]

    def resolve(self, kind: str, name: str) -> Registration:
        """The one registration of `kind` called `name`; an unknown name lists the alternatives."""
        reg = self.registry(kind).get(name)
        if reg is None:
            alts = ", ".join(sorted(self.registry(kind))) or "none installed"
            raise PluginError(f"unknown {kind.replace('_', ' ')} {name!r}; available: {alts}")
        return reg

    def resolve_spec_backend(self, name: str) -> Registration:
        """The backend `--spec NAME` picks; an uninstalled known one names its package."""
        reg = self.registry("spec_backend").get(name)
        if reg is None:
            pkg = KNOWN_SPEC_PACKAGES.get(name)
            alts = ", ".join(sorted(self.registry("spec_backend"))) or "none installed"
            hint = f"; install the package {pkg} (pip install {pkg})" if pkg else ""
            raise PluginError(f"unknown speculative backend {name!r} (--spec){hint}; available: {alts}")
        return reg

    def serve_options(self) -> list[OptionSpec]:
        """Every option the loaded plugins add to `ninfer serve`, each flag once."""
        self.load()
        if self._options is not None:
            return self._options
        by_flag: dict[str, OptionSpec] = {}
        out: list[OptionSpec] = []
        for impl in self.pm.hook.ninfer_add_serve_options.get_hookimpls():
            plugin = next(p for p in self.plugins if p.name == impl.plugin_name)

            def add(*flags, _plugin=plugin, **kwargs):
                spec = OptionSpec(tuple(flags), dict(kwargs), _plugin.name, _plugin.package)
                seen = [by_flag[f] for f in flags if f in by_flag]
                if seen:
                    other = seen[0]
                    if other.flags != spec.flags or _signature(other.kwargs) != _signature(spec.kwargs):
                        raise RegistrationError(
                            f"serve option {flags[0]} is added twice with different settings: by plugin "
                            f"{other.plugin!r} ({other.package}) and by plugin {_plugin.name!r} ({_plugin.package})")
                    return  # the same option shared by two plugins
                for f in flags:
                    by_flag[f] = spec
                out.append(spec)

            impl.function(add=add)
        self._options = out
        return out

    def add_serve_options(self, parser) -> None:
        """Add the plugins' options to an argparse parser, one help group per plugin."""
        groups: dict[str, Any] = {}
        for spec in self.serve_options():
            g = groups.get(spec.plugin)
            if g is None:
                g = groups[spec.plugin] = parser.add_argument_group(f"{spec.plugin} ({spec.package})")
            g.add_argument(*spec.flags, **spec.kwargs)

    def family_for_architecture(self, architecture: str) -> Registration:
        fams = self.registry("model_family")
        served = {}
        for reg in fams.values():
            for arch in reg.extra.get("architectures", []) or [reg.name]:
                served[arch] = reg
        if architecture not in served:
            raise MissingFamilyError(architecture, served)
        return served[architecture]

    def default_artifact(self, cache_dir) -> str | None:
        self.load()
        return self.pm.hook.ninfer_default_artifact(cache_dir=cache_dir)

    def describe(self) -> list[dict]:
        """One row per loaded plugin: name, package, version and what it registers."""
        regs = {k: self.registry(k) for k in KINDS}
        rows = []
        for p in self.plugins:
            what = [f"{k.replace('_', ' ')}: {r.name}" for k, rr in regs.items() for r in rr.values() if r.plugin == p.name]
            if p.builtin is False and self.pm.get_plugin(p.name) is not None:
                if self.pm.hook.ninfer_default_artifact.get_hookimpls() and any(
                    i.plugin_name == p.name for i in self.pm.hook.ninfer_default_artifact.get_hookimpls()
                ):
                    what.append("default artifact")
            rows.append({"name": p.name, "package": p.package, "version": p.version,
                         "builtin": p.builtin, "registers": what})
        return rows


def _entry_points_by_name(eps: Iterable, blocked: set[str]) -> dict:
    """Entry points by plugin name. One distribution seen twice (an editable install beside a path
    entry) is one plugin; two distributions registering one name is an error naming both, since
    keeping either would silently drop the other's plugin. A blocked name is not looked at."""
    out: dict = {}
    for ep in eps:
        if ep.name in blocked:
            continue
        other = out.get(ep.name)
        if other is None:
            out[ep.name] = ep
            continue
        mine, theirs = _entry_point_dist(ep), _entry_point_dist(other)
        if mine[0] == theirs[0] and getattr(ep, "value", None) == getattr(other, "value", None):
            continue
        raise RegistrationError(
            f"two installed distributions register the plugin name {ep.name!r} in entry-point group "
            f"{GROUP!r}: {theirs[0]} ({getattr(other, 'value', '?')}) and {mine[0]} "
            f"({getattr(ep, 'value', '?')}); uninstall one, or block the name with no:{ep.name}")
    return out


def _signature(kwargs: dict) -> dict:
    """What must agree for two plugins to share one option: argparse settings but the help text, a
    type converter compared by name (each package defines its own)."""
    return {k: (getattr(v, "__name__", repr(v)) if callable(v) else v) for k, v in kwargs.items()
            if k not in ("help", "metavar")}


def _core_version() -> str:
    from ninfer_core.version import VERSION

    return VERSION


Callback = Callable[..., None]
