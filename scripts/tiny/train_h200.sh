#!/usr/bin/env bash
# Train ninfer-tiny on one GPU, ship it in the ninfer-tiny package and print the evaluation table.
# Run from the repository root:  bash scripts/tiny/train_h200.sh [RUN_DIR]
# Needs: torch (CUDA build), transformers, tokenizers, markov-draftjs, openai and the repo's packages
# installed (pip install -e . -e plugins/qwen35 -e plugins/tiny). See docs/tiny.md.
set -euo pipefail
RUN="${1:-runs/tiny}"
mkdir -p "$RUN"
python -m ninfer_tiny.train --recipe full --seed 0 --out "$RUN" --fit-minutes 13 --max-minutes 14.5 --install 2>&1 | tee "$RUN/train.log"
python -m ninfer_tiny.evaluate --artifact "$RUN/ninfer-tiny.ninfer" --per-kind 50 \
    --json "$RUN/eval.json" 2>&1 | tee "$RUN/eval.log"
ls -l plugins/tiny/ninfer_tiny/data/ninfer-tiny.ninfer
