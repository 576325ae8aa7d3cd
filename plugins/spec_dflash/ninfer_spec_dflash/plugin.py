"""Hook implementations of the DFlash speculative backends. Importing this module never imports torch."""

from __future__ import annotations

import argparse

from ninfer_core import hookimpl

MAX_DRAFTS = 15


def draft_count(s: str) -> int:
    v = int(s)
    if not 1 <= v <= MAX_DRAFTS:
        raise argparse.ArgumentTypeError(f"must be in 1..{MAX_DRAFTS}, got {v}")
    return v


@hookimpl
def ninfer_register_spec_backends(register):
    register("dflash", "ninfer_spec_dflash.backend:DFlashBackend")
    register("dflash2", "ninfer_spec_dflash.backend:DFlash2Backend")


@hookimpl
def ninfer_add_serve_options(add):
    # shared with ninfer-spec-mtp (the same settings: core keeps one of each)
    add("--draft-tokens", type=draft_count, default=None, metavar="N",
        help=f"drafts a speculative round proposes per request, 1..{MAX_DRAFTS} (mtp default: 3)")
    add("--lm-head-draft", action="store_true",
        help="require the artifact's optimised proposal head (ninfer convert --mtp-proposal-head N)")
    add("--full-draft-head", action="store_true",
        help="draft through the full output head even when the artifact stores a proposal head")
