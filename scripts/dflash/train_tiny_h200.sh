#!/usr/bin/env bash
# Train ninfer-tiny's DFlash and DFlash2 drafters on one GPU (the h200 recipe: 8,192 rows of 512
# tokens, 6,000 steps per drafter), write them into the packaged artifact and print the acceptance
# table (MTP, DFlash, DFlash2 at K = 7 and 15 on held-out prompts, outputs checked against plain).
# Run from the repository root:  bash scripts/dflash/train_tiny_h200.sh [RUN_DIR]
# Needs the repo's packages installed (pip install -e . -e plugins/qwen35 -e plugins/tiny
# -e plugins/spec_mtp -e plugins/spec_dflash) and the trained ninfer-tiny artifact in the package.
set -euo pipefail
RUN="${1:-runs/dflash-h200}"
mkdir -p "$RUN"
python -m ninfer_tiny.train_dflash --recipe h200 --seed 0 --out "$RUN" --eval-prompts 48 --install 2>&1 | tee "$RUN/train.log"
python -m ninfer_core.cli bench --shape plugins/tiny/ninfer_tiny/data/ninfer-tiny.ninfer --spec mtp,dflash,dflash2 \
    --spec-k 7,15 --spec-batches 1,8 --spec-only --json "$RUN/bench.json" 2>&1 | tee "$RUN/bench.log"
