"""Hook implementations of the Flash-Next family plugin. Importing this module never imports torch."""

from __future__ import annotations

import argparse

from ninfer_core import hookimpl

ARCHITECTURES = ["qwen4_exp", "qwen4_exp_text"]


def _cache_mib(text: str):
    if text == "auto":
        return text
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB or auto, not {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return v


def _io_depth(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, not {text!r}") from None
    if not 1 <= v <= 1024:
        raise argparse.ArgumentTypeError("must be in 1..1024")
    return v


def _mib(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB, not {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return v


@hookimpl
def ninfer_register_model_families(register):
    register("flash_next", "ninfer_flash_next.family:FlashNextFamily", architectures=list(ARCHITECTURES))


@hookimpl
def ninfer_register_bench_shapes(register):
    # the first 4 layers at the real widths (the whole model does not fit one GPU: shapes.bench_config)
    register("qwen3.8-flash-next-4l", "ninfer_flash_next.shapes:FLASH_NEXT_4L")


@hookimpl
def ninfer_add_serve_options(add):
    add("--expert-residency", choices=("device", "host", "disk"), default=None,
        help="Flash-Next: routed expert banks in device memory, in (pinned) host memory, or left in the "
             "artifact's file and streamed into the device expert cache (default device)")
    add("--expert-cache-mib", type=_cache_mib, default=None, metavar="N|auto",
        help="with host or disk experts: device memory for the most recently used experts; 0 turns the "
             "host-mode cache off, disk mode needs one (default auto)")
    add("--expert-misses", choices=("staged", "mapped"), default=None,
        help="host experts: copy a missing expert into a cache slot (staged, default) or compute it where it "
             "lies (mapped)")
    add("--expert-profile", default=None, metavar="PATH",
        help="fill the expert cache from counts recorded for the same artifact and bank geometry")
    add("--expert-profile-out", default=None, metavar="PATH", help="record expert counts for this artifact")
    add("--ngram-table", default=None, metavar="PATH",
        help="Flash-Next: the n-gram table artifact of a model published without its table")
    add("--ngram-residency", choices=("disk", "ram", "ram-hot"), default=None,
        help="Flash-Next: n-gram rows from the table's file (disk, default), all in RAM, or a hot-row "
             "profile's rows in RAM and the rest from the file (ram-hot)")
    add("--ngram-io", choices=("buffered", "direct", "mmap"), default=None,
        help="Flash-Next: read rows through the page cache (buffered, default), past it (direct), or from a "
             "mapping (mmap)")
    add("--ngram-io-depth", type=_io_depth, default=None, metavar="N",
        help="Flash-Next: n-gram row reads in flight, 1..1024 (default 64)")
    add("--ngram-ram-mib", type=_mib, default=None, metavar="N",
        help="disk: budget for cached rows (default 0, off); ram-hot: budget for the profile's rows (default 4096)")
    add("--ngram-hot-profile", default=None, metavar="PATH",
        help="ram-hot: the hot-row profile (row ids, hottest first)")
    add("--no-ngram-table", action="store_true", default=None,
        help="Flash-Next: run without the n-gram table (a non-standard experimental mode; quality drops; "
             "default: off, the table is used)")
