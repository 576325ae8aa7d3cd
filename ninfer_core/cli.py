"""`ninfer serve|convert|inspect|plugins` and the `ninfer-serve` alias."""

from __future__ import annotations

import argparse
import os
import sys

from ninfer_core.cli_support import CliParser, EnvHelpFormatter, HelpFormatter, env_arguments
from ninfer_core.version import build_string


def _cmd_plugins(a: argparse.Namespace) -> int:
    from ninfer_core.plugins import PluginError, PluginHost, PluginSelection

    host = PluginHost(PluginSelection.from_sources(a.plugin))
    try:
        rows = host.describe()
    except PluginError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for r in rows:
        tag = " (built-in)" if r["builtin"] else ""
        print(f"{r['name']}  {r['package']} {r['version']}{tag}")
        for w in r["registers"]:
            print(f"    {w}")
    return 0


def _convert_check(manifest: dict) -> None:
    """`ninfer convert` refuses a checkpoint no model family can serve, and stores the family's
    bundled chat template when the checkpoint has none (and says so)."""
    from ninfer_core.artifact.format import ArtifactError
    from ninfer_core.plugins import (
        KNOWN_FAMILY_PACKAGES,
        MissingFamilyError,
        PluginError,
        PluginHost,
        PluginSelection,
    )
    from ninfer_core.tokenizer.builtin_templates import family_chat_template

    arch = manifest["architecture"]
    family = None
    try:
        reg = PluginHost(PluginSelection.from_sources([])).family_for_architecture(arch)
        target = reg.load()
        family = target() if isinstance(target, type) else target
    except MissingFamilyError as e:
        if arch not in KNOWN_FAMILY_PACKAGES:  # nothing NInfer knows of serves it: the artifact would be dead
            raise ArtifactError(f"cannot convert: {e}") from None
        pkg = KNOWN_FAMILY_PACKAGES[arch]
        print(f"note: serving this artifact needs the package {pkg} (pip install {pkg})", file=sys.stderr)
    except PluginError as e:
        raise ArtifactError(str(e)) from None
    if not manifest.get("chat_template"):
        found = family_chat_template(family, arch)
        if found is None:
            print("warning: the checkpoint has no chat template and its model family bundles none: chat requests "
                  "will be refused unless the server is started with --chat-template", file=sys.stderr)
        else:
            manifest["chat_template"], where = found
            print(f"note: the checkpoint has no chat template; storing {where}", file=sys.stderr)


def build_parser(host=None) -> argparse.ArgumentParser:
    """The command-line parser; `host` (a loaded PluginHost) adds the plugins' serve options."""
    from ninfer_core.cli_support import integer
    from ninfer_core.config import add_serve_arguments

    p = CliParser(prog="ninfer", description="NInfer LLM inference server", formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"ninfer {build_string()}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve a .ninfer artifact over HTTP", formatter_class=EnvHelpFormatter,
                       usage="%(prog)s [ARTIFACT] [options]", description="Serve one .ninfer artifact over OpenAI, Anthropic and llama.cpp HTTP APIs. Every "
                                   "option can also be set as an environment variable (shown beside it); the "
                                   "command line wins. Exit status: 0 stopped, 1 startup failure, 2 engine failure.")
    add_serve_arguments(s)
    if host is not None:
        host.add_serve_options(s)

    c = sub.add_parser("convert", help="convert a Hugging Face checkpoint directory (or re-write a .ninfer) to .ninfer",
                       formatter_class=HelpFormatter)
    c.add_argument("hf_dir", help="a Hugging Face checkpoint directory, or a .ninfer artifact to re-write")
    c.add_argument("out", help="the .ninfer file to write (written to OUT.tmp, then renamed)")
    c.add_argument("--mtp-proposal-head", type=integer(1), default=None, metavar="N",
                   help="also store an optimised proposal head: the output-head rows of the tokenizer's added tokens "
                        "and the N most frequent tokens of --mtp-proposal-corpus (--spec mtp drafts through it; "
                        "default: none)")
    c.add_argument("--mtp-proposal-corpus", default=None, metavar="FILE",
                   help="UTF-8 text whose token counts choose the proposal head's rows (default: none)")
    for kind in ("dflash", "dflash2"):
        c.add_argument(f"--{kind}", default=None, metavar="DIR",
                       help=f"also store a published {kind} drafter checkpoint (config.json + *.safetensors) as the "
                            f"artifact's {kind} component (--spec {kind} drafts through it; replaces one already stored)")
    c.add_argument("--name", default=None, help="model name stored in the manifest (default: the directory name)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    i = sub.add_parser("inspect", help="print an artifact's manifest summary", formatter_class=HelpFormatter)
    i.add_argument("artifact", help="the .ninfer file")
    i.add_argument("--json", action="store_true", help="print the whole manifest as JSON (tokenizer ranks elided)")
    i.add_argument("--verify", action="store_true", help="check every tensor's CRC32 (reads the whole file)")
    i.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    b = sub.add_parser("bench", help="measure prefill/decode speed against the card's ceilings and transformers",
                       description="Build a model at a real shape with random weights on the GPU (or load an "
                                   "artifact) and print one table of measured rates, ratios and ceilings.",
                       formatter_class=HelpFormatter)
    from ninfer_core.bench.run import add_bench_arguments

    add_bench_arguments(b)

    pl = sub.add_parser("plugins", help="list discovered plugins and what they register", formatter_class=HelpFormatter)
    pl.add_argument("--plugin", action="append", default=[], metavar="NAME",
                    help="list only this plugin (repeatable; default: every installed plugin)")
    return p


def _serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _serve_host(argv: list[str]):
    """Load the plugins `ninfer serve` will use before its command line is parsed, so their options
    parse (and show in --help). Returns (host, error message or None)."""
    from ninfer_core.plugins import KNOWN_OPTION_PACKAGES, PluginError, PluginHost, PluginSelection

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--plugin", action="append", default=[])
    known, _ = pre.parse_known_args(argv)
    host = PluginHost(PluginSelection.from_sources(known.plugin))
    try:
        added = {f for spec in host.serve_options() for f in spec.flags}
    except PluginError as e:
        return None, str(e)
    for arg in argv:
        flag = arg.split("=", 1)[0]
        pkg = KNOWN_OPTION_PACKAGES.get(flag)
        if pkg and flag not in added:
            return None, f"{flag} is an option of the package {pkg}, which is not installed (pip install {pkg})"
    return host, None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    host = None
    if argv and argv[0] == "serve":
        host, err = _serve_host(argv[1:])
        if err is not None:
            print(f"error: {err}", file=sys.stderr)
            return 1
    parser = build_parser(host)
    if argv and argv[0] == "serve" and not {"-h", "--help"} & set(argv):
        # NINFER_<OPTION> variables stand before the command line, which therefore wins
        argv = ["serve", *env_arguments(_serve_parser(parser), os.environ), *argv[1:]]
    a = parser.parse_args(argv)
    if a.command == "serve" and a.artifact is None:
        a.artifact = os.environ.get("NINFER_ARTIFACT") or None
    if a.command == "serve":
        from ninfer_core.server.serve import run_serve

        # the router parses each model's arguments (preset, then this command line) with this parser
        a.serve_argv, a.serve_parser = list(argv[1:]), _serve_parser(parser)
        return run_serve(a, host)
    if a.command == "convert":
        from ninfer_core.artifact.convert import run_convert

        return run_convert(a, check_manifest=_convert_check)
    if a.command == "inspect":
        from ninfer_core.artifact.inspect import run_inspect

        return run_inspect(a)
    if a.command == "plugins":
        return _cmd_plugins(a)
    if a.command == "bench":
        from ninfer_core.bench.run import run_bench

        return run_bench(a)
    return 2


def serve_main(argv: list[str] | None = None) -> int:
    """`ninfer-serve ARGS` is `ninfer serve ARGS`."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--version":
        print(f"ninfer {build_string()}")
        return 0
    return main(["serve", *argv])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
