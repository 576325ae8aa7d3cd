"""`ninfer serve|convert|inspect|plugins` and the `ninfer-serve` alias."""

from __future__ import annotations

import argparse
import sys

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


def build_parser(host=None) -> argparse.ArgumentParser:
    """The command-line parser; `host` (a loaded PluginHost) adds the plugins' serve options."""
    from ninfer_core.config import add_serve_arguments

    p = argparse.ArgumentParser(prog="ninfer", description="NInfer LLM inference server")
    p.add_argument("--version", action="version", version=f"ninfer {build_string()}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve a .ninfer artifact over HTTP")
    add_serve_arguments(s)
    if host is not None:
        host.add_serve_options(s)

    c = sub.add_parser("convert", help="convert a Hugging Face checkpoint directory (or re-write a .ninfer) to .ninfer")
    c.add_argument("hf_dir", help="a Hugging Face checkpoint directory, or a .ninfer artifact to re-write")
    c.add_argument("out")
    c.add_argument("--mtp-proposal-head", type=int, default=None, metavar="N",
                   help="also store an optimised proposal head: the output-head rows of the tokenizer's added tokens "
                        "and the N most frequent tokens of --mtp-proposal-corpus (--spec mtp drafts through it)")
    c.add_argument("--mtp-proposal-corpus", default=None, metavar="FILE",
                   help="UTF-8 text whose token counts choose the proposal head's rows")
    c.add_argument("--name", default=None, help="model name stored in the manifest (default: the directory name)")
    c.add_argument("--no-progress", action="store_true")

    i = sub.add_parser("inspect", help="print an artifact's manifest summary")
    i.add_argument("artifact")
    i.add_argument("--json", action="store_true", help="print the whole manifest as JSON (tokenizer ranks elided)")
    i.add_argument("--verify", action="store_true", help="check every tensor's CRC32 (reads the whole file)")
    i.add_argument("--no-progress", action="store_true")

    b = sub.add_parser("bench", help="measure prefill/decode speed against the card's ceilings and transformers",
                       description="Build a model at a real shape with random weights on the GPU (or load an "
                                   "artifact) and print one table of measured rates, ratios and ceilings.")
    from ninfer_core.bench.run import add_bench_arguments

    add_bench_arguments(b)

    pl = sub.add_parser("plugins", help="list discovered plugins and what they register")
    pl.add_argument("--plugin", action="append", default=[], metavar="NAME")
    return p


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
    a = build_parser(host).parse_args(argv)
    if a.command == "serve":
        from ninfer_core.server.serve import run_serve

        return run_serve(a, host)
    if a.command == "convert":
        from ninfer_core.artifact.convert import run_convert

        return run_convert(a)
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
