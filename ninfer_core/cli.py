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


def build_parser() -> argparse.ArgumentParser:
    from ninfer_core.config import add_serve_arguments

    p = argparse.ArgumentParser(prog="ninfer", description="NInfer LLM inference server")
    p.add_argument("--version", action="version", version=f"ninfer {build_string()}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve a .ninfer artifact over HTTP")
    add_serve_arguments(s)

    c = sub.add_parser("convert", help="convert a Hugging Face checkpoint directory to .ninfer")
    c.add_argument("hf_dir")
    c.add_argument("out")
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


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.command == "serve":
        from ninfer_core.server.serve import run_serve

        return run_serve(a)
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
