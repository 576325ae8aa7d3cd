"""What every `ninfer` command line shares: the parser class, the help format, value checks and
environment variables.

- `CliParser` reports a bad option as `error: ...` with exit status 1 (startup errors are 1, spec
  "Stop the server"; argparse's own status 2 is the engine-failure status of `ninfer serve`).
- `HelpFormatter` appends each option's default and, for `serve`, its environment variable.
- `number(lo, hi)` / `integer(lo, hi)` are argparse types that check the range a request field of
  the same name accepts, refusing NaN and infinities.
- `env_arguments(parser, environ)` turns NINFER_<OPTION> variables into command-line arguments
  placed before the real ones, so an option given on the command line wins (llama.cpp's
  LLAMA_ARG_*, vLLM's VLLM_API_KEY): the API key need not appear in `ps`.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Mapping

ENV_PREFIX = "NINFER_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
# Options with an environment variable of their own (or none): --plugin is NINFER_PLUGINS, an allow-list
# read by the plugin host, and the help/version actions take no value.
_NO_ENV = ("--plugin", "--help", "--version")


class CliParser(argparse.ArgumentParser):
    """argparse's parser, but a usage error is `error: ...` on stderr and exit status 1."""

    def error(self, message: str):
        self.exit(1, f"error: {message} (see: {self.prog} --help)\n")


def env_name(action: argparse.Action) -> str | None:
    """NINFER_MAX_CONTEXT for --max-context; None for options without a variable."""
    longs = [o for o in action.option_strings if o.startswith("--")]
    if not longs or longs[0] in _NO_ENV:
        return None
    return ENV_PREFIX + longs[0][2:].replace("-", "_").upper()


class HelpFormatter(argparse.HelpFormatter):
    """Adds `(default: X)` to an option whose help does not already state its default, and
    `[env NINFER_X]` when the parser reads environment variables (`serve`)."""

    def __init__(self, prog: str, **kw):
        kw.setdefault("max_help_position", 38)
        kw.setdefault("width", 110)
        super().__init__(prog, **kw)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and action.default is not argparse.SUPPRESS and "default" not in text:
            shown = _shown_default(action)
            if shown is not None:
                text += f" (default: {shown})"
        if getattr(self, "_env", False):
            name = env_name(action)
            if name is not None:
                text += f" [env {name}]"
        return text.replace("%", "%%") if "%(" not in text else text


def _shown_default(action: argparse.Action) -> str | None:
    if isinstance(action, argparse._StoreTrueAction) and action.default is False:
        return "off"
    if isinstance(action, (argparse._StoreFalseAction, argparse._VersionAction, argparse._HelpAction)):
        return None
    d = action.default
    if d is None or d == []:
        return "none" if action.nargs != 0 else None
    if d is False:
        return None
    if isinstance(d, list):
        return ",".join(map(str, d))
    return str(d)


class EnvHelpFormatter(HelpFormatter):
    _env = True


def _range_text(lo, hi, lo_open: bool) -> str:
    left = "(" if lo_open else "["
    if hi is None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"{left}{lo}, {hi}]"


def number(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite float in [lo, hi] (lo excluded with `lo_open`)."""

    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {s!r}")
        if lo is not None and (v < lo or (lo_open and v == lo)) or hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be in {_range_text(lo, hi, lo_open)}, got {s}")
        return v

    parse.__name__ = "number"
    return parse


def integer(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in lo..hi (either bound may be open)."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f"{lo}..{hi}" if lo is not None and hi is not None else (f">= {lo}" if lo is not None
                                                                            else f"<= {hi}")
            raise argparse.ArgumentTypeError(f"must be in {rng}, got {v}")
        return v

    parse.__name__ = "integer"
    return parse


def on_off(s: str) -> bool:
    """`on`/`off` (also true/false, 1/0), as the spec's --log-colours and --log-stats-panel take."""
    v = s.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE[:-1]:
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {s!r}")


def env_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> list[str]:
    """The command-line arguments NINFER_<OPTION> variables stand for; SystemExit(1) with
    `error: NINFER_X: ...` for a value the option refuses."""
    out: list[str] = []
    for action in parser._actions:
        name = env_name(action)
        if name is None or name not in environ:
            continue
        raw = environ[name]
        flag = next(o for o in action.option_strings if o.startswith("--"))
        if action.nargs == 0:  # a flag: on/off
            value = raw.strip().lower()
            if value in _TRUE:
                out.append(flag)
            elif value not in _FALSE:
                _env_error(name, f"expected 1/true/on or 0/false/off, got {raw!r}")
            continue
        if action.type is not None:
            try:
                action.type(raw)
            except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
                _env_error(name, str(e))
        if action.choices is not None and raw not in action.choices:
            _env_error(name, f"expected one of {', '.join(map(str, action.choices))}, got {raw!r}")
        out += [flag, raw]
    return out


def _env_error(name: str, message: str) -> None:
    print(f"error: {name}: {message}", file=sys.stderr)
    raise SystemExit(1)
