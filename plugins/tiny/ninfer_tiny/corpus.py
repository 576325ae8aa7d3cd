"""`python -m ninfer_tiny.corpus [--samples N] [--seed S] > corpus.txt`: ninfer-tiny's training data as
text (rendered conversations of the training side of the split), e.g. the corpus whose token counts
choose a proposal head's rows (`ninfer convert ninfer-tiny.ninfer out.ninfer --mtp-proposal-head N
--mtp-proposal-corpus corpus.txt`)."""

from __future__ import annotations

import argparse
import sys

from ninfer_tiny.data import make_sample, render


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=2000, help="conversations to write")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sample stream")
    a = ap.parse_args(argv)
    for i in range(a.samples):
        sys.stdout.write(render(make_sample(a.seed, i)))
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
