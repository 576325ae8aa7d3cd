"""The router's catalog: --models-dir and --models-preset (llama.cpp's INI preset format).

A models directory serves every `.ninfer` directly inside it under its file stem, and every
subdirectory holding exactly one `.ninfer` under the subdirectory's name. A preset is an INI file
read with configparser: `[*]` holds options for every model; any other section is a model whose
keys are `model` (or `artifact`) = PATH, `alias` = a, b, `load-on-startup` = true, and any serve
option without its leading dashes (`kv-capacity = 65536`; a flag is `model-suspend = true`). A
section named after a model of the directory configures that model and needs no path.
`dedup-cache-models = true` (in a model's section or in `[*]`; llama.cpp's key, whose router
hides the cache entry of a model a preset names) drops every --models-dir model that is the same
artifact file as that preset model and has no section of its own: its name becomes one of the
preset model's aliases, so a request naming it is served by the one Engine instead of a second
copy of the same weights, and GET /models lists the model once.

Each model's serve arguments are the preset's `[*]`, then its own section, then the command
line, parsed by the `ninfer serve` parser itself: argparse keeps the last value of an option, so
the command line wins over the preset and a model's section over `[*]`, and a bad value is
refused with the same message a single-model server gives.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import io
import os
from dataclasses import dataclass, field
from pathlib import Path

# Preset keys that describe the entry rather than pass to `ninfer serve`.
ENTRY_KEYS = {"model", "artifact", "alias", "load-on-startup", "dedup-cache-models"}
# Options that stay the router's: the listener and the key belong to it, not to one model.
ROUTER_ONLY = {"host", "port", "api-key", "stats-port", "models-dir", "models-preset", "models-max",
               "models-autoload", "no-models-autoload", "cors", "cors-origins", "webui-dir", "no-webui"}
TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off"}


class CatalogError(Exception):
    pass


@dataclass
class CatalogEntry:
    name: str
    path: str | None
    aliases: tuple[str, ...] = ()
    load_on_startup: bool = False
    preset_args: list[str] = field(default_factory=list)  # [*] then the model's own section


def scan_models_dir(directory: str) -> dict[str, str]:
    root = Path(directory)
    if not root.is_dir():
        raise CatalogError(f"--models-dir {directory}: not a directory")
    found: dict[str, str] = {}
    for entry in sorted(root.iterdir()):
        if entry.is_file() and entry.suffix == ".ninfer":
            found[entry.stem] = str(entry)
        elif entry.is_dir():
            inner = sorted(p for p in entry.iterdir() if p.is_file() and p.suffix == ".ninfer")
            if len(inner) == 1:
                found[entry.name] = str(inner[0])
    return found


def _flag_kinds(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    kinds: dict[str, argparse.Action] = {}
    for action in parser._actions:  # argparse keeps no public list of its actions
        for opt in action.option_strings:
            if opt.startswith("--"):
                kinds[opt[2:]] = action
    return kinds


def section_args(section: configparser.SectionProxy, parser: argparse.ArgumentParser, where: str) -> list[str]:
    """A preset section's serve options as command-line arguments."""
    kinds = _flag_kinds(parser)
    out: list[str] = []
    for key, value in section.items():
        key = key.strip().lower()
        if key in ENTRY_KEYS:
            continue
        if key in ROUTER_ONLY:
            raise CatalogError(f"{where}: {key} is the router's own option and cannot be set per model")
        action = kinds.get(key)
        if action is None:
            raise CatalogError(f"{where}: unknown option {key!r} (a serve option without its leading dashes)")
        if action.nargs == 0:  # a flag: true sets it, false leaves it unset
            v = value.strip().lower()
            if v in TRUE:
                out.append(f"--{key}")
            elif v not in FALSE:
                raise CatalogError(f"{where}: {key} is a flag: expected true or false, got {value!r}")
        else:
            out += [f"--{key}", value.strip()]
    return out


def _bool(value: str, where: str) -> bool:
    v = value.strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise CatalogError(f"{where}: expected true or false, got {value!r}")


def read_preset(path: str) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(interpolation=None, comment_prefixes=(";", "#"), inline_comment_prefixes=None,
                                   default_section="\x00none", strict=True)
    cp.optionxform = str  # keys as written; matched lower-cased
    try:
        with open(path, encoding="utf-8") as f:
            cp.read_file(f, source=path)
    except OSError as e:
        raise CatalogError(f"--models-preset {path}: {e.strerror or e}") from None
    except configparser.Error as e:
        raise CatalogError(f"--models-preset {path}: {e.message if hasattr(e, 'message') else e}") from None
    return cp


def build_catalog(models_dir: str | None, preset: str | None, parser: argparse.ArgumentParser) -> list[CatalogEntry]:
    found = scan_models_dir(models_dir) if models_dir else {}
    entries: dict[str, CatalogEntry] = {n: CatalogEntry(n, p) for n, p in found.items()}
    if preset:
        cp = read_preset(preset)
        base = Path(preset).resolve().parent
        common = section_args(cp["*"], parser, f"{preset} [*]") if cp.has_section("*") else []
        for entry in entries.values():
            entry.preset_args = list(common)
        for name in cp.sections():
            if name == "*":
                continue
            sec = cp[name]
            where = f"{preset} [{name}]"
            raw = sec.get("model") or sec.get("artifact")
            path = str((base / raw).resolve()) if raw and not Path(raw).is_absolute() else raw
            if path is None and name not in entries:
                raise CatalogError(f"{where}: no model = PATH, and no model of --models-dir has this name")
            entry = entries.get(name) or CatalogEntry(name, path)
            if path is not None:
                entry.path = path
            entry.aliases = tuple(a.strip() for a in (sec.get("alias") or "").split(",") if a.strip())
            if "load-on-startup" in sec:
                entry.load_on_startup = _bool(sec["load-on-startup"], f"{where} load-on-startup")
            entry.preset_args = common + section_args(sec, parser, where)
            entries[name] = entry
    if preset:
        _dedup(entries, set(found), cp, preset)
    names: dict[str, str] = {}
    for e in entries.values():
        for n in (e.name, *e.aliases):
            if n in names and names[n] != e.name:
                raise CatalogError(f"the model name {n!r} is given to both {names[n]!r} and {e.name!r}")
            names[n] = e.name
    return list(entries.values())


def _same_file(a: str | None, b: str | None) -> bool:
    try:
        return bool(a and b) and os.path.samefile(a, b)
    except OSError:  # a path that does not exist is no artifact of another entry
        return False


def _dedup(entries: dict[str, CatalogEntry], directory: set[str], cp: configparser.ConfigParser,
           preset: str) -> None:
    """dedup-cache-models: fold the --models-dir models (without a section of their own) that are
    a preset model's artifact into that model as aliases."""
    common = cp["*"].get("dedup-cache-models") if cp.has_section("*") else None
    for name in cp.sections():
        if name == "*" or name not in entries:
            continue
        value = cp[name].get("dedup-cache-models", common)
        if value is None or not _bool(value, f"{preset} [{name}] dedup-cache-models"):
            continue
        entry = entries[name]
        for other in sorted(directory):
            if other != name and other in entries and not cp.has_section(other) \
                    and _same_file(entries[other].path, entry.path):
                del entries[other]
                entry.aliases = (*entry.aliases, other)


def model_arguments(entry: CatalogEntry, cli_argv: list[str], parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The namespace a single-model server started for this entry would parse."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args([*entry.preset_args, *cli_argv])
    except SystemExit:
        msg = err.getvalue().strip().splitlines()
        raise CatalogError(f"model {entry.name}: {msg[-1] if msg else 'invalid serve options'}") from None
    ns.artifact = entry.path
    return ns
