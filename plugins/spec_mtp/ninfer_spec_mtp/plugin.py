"""Hook implementations of the MTP speculative backend. Importing this module never imports torch."""

from __future__ import annotations

import argparse

from ninfer_core import hookimpl

MAX_DRAFTS = 15


def draft_count(s: str) -> int:
    v = int(s)
    if not 1 <= v <= MAX_DRAFTS:
        raise argparse.ArgumentTypeError(f"must be in 1..{MAX_DRAFTS}, got {v}")
    return v


def window_size(s: str) -> int:
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def min_probability(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a probability, not {s!r}") from None
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {v}")
    return v


@hookimpl
def ninfer_register_spec_backends(register):
    register("mtp", "ninfer_spec_mtp.backend:MtpBackend")


@hookimpl
def ninfer_add_serve_options(add):
    # --draft-tokens, --lm-head-draft and --full-draft-head are shared with other speculative backends
    # (declared with the same settings there); the last two are MTP's own.
    add("--draft-tokens", type=draft_count, default=None, metavar="N",
        help=f"drafts a speculative round proposes per request, 1..{MAX_DRAFTS} (mtp default: 3)")
    add("--lm-head-draft", action="store_true",
        help="require the artifact's optimised proposal head (ninfer convert --mtp-proposal-head N)")
    add("--full-draft-head", action="store_true",
        help="draft through the full output head even when the artifact stores a proposal head")
    add("--adaptive-mtp", action="store_true",
        help="each round verifies min(3, K)..K drafts, the width favoured by the drafts' measured survival "
             "and the measured round cost")
    add("--mtp-attention-window", type=window_size, default=0, metavar="N",
        help="the MTP draft attends to the first 64 keys and the newest N (at least --draft-tokens + 1, whole "
             "64-key pages) before its query; verification keeps full attention (default 0: whole history)")
    add("--draft-min-p", type=min_probability, default=0.0, metavar="P",
        help="verify through the first draft whose probability under the draft head is at or below P; the "
             "full draft chain still runs (a draft head that runs its chain eagerly: Flash-Next; default 0: off)")
