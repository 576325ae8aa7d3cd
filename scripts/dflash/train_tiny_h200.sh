#!/usr/bin/env bash
# Train ninfer-tiny's DFlash and DFlash2 drafters on one H200 inside one device call (<= 9 minutes):
# the h200 recipe (up to 8,192 rows of 512 tokens of the tiny plugin's conversations, up to 6,000
# steps per drafter) cut to fit a budget of BUDGET seconds (default 430): the target's rows 24%,
# DFlash 22%, DFlash2 28%, then the acceptance table (MTP, DFlash, DFlash2 at K = 7 and 15, greedy,
# held-out prompts, each output checked against plain decoding) in what is left.
#
#   bash scripts/dflash/train_tiny_h200.sh [RUN_DIR]        # RUN_DIR default: $OUT/dflash-h200
#
# RUN_DIR gets dflash/ and dflash2/ (published-layout checkpoints: config.json, model.safetensors),
# summary.json and train.log: six small files, so it comes back from a device call's $OUT. The merged
# artifact (22 MB) goes to /tmp. Back here, put the drafters into the packaged artifact with
#
#   bash scripts/dflash/install_drafters.sh RUN_DIR
#
# Needs the repository's packages importable (PYTHONPATH as docs/bench.md's device recipe, with
# plugins/spec_mtp and plugins/spec_dflash; NINFER_PLUGINS naming ninfer_qwen35, ninfer_tiny,
# ninfer_spec_mtp and ninfer_spec_dflash), fla from .whl/base.
set -euo pipefail
RUN="${1:-${OUT:-runs}/dflash-h200}"
BUDGET="${BUDGET:-430}"
mkdir -p "$RUN"
python3 -m ninfer_tiny.train_dflash --recipe h200 --seed 0 --out "$RUN" --eval-prompts 24 --budget "$BUDGET" \
    --merged-dir /tmp/dflash-merged 2>&1 | tee "$RUN/train.log"
