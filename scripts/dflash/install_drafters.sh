#!/usr/bin/env bash
# Put trained drafters (RUN_DIR/dflash, RUN_DIR/dflash2: checkpoints in the published layout, as
# scripts/dflash/train_tiny_h200.sh writes them) into the packaged ninfer-tiny artifact, replacing
# its dflash and dflash2 components. Run from the repository root:
#   bash scripts/dflash/install_drafters.sh RUN_DIR
set -euo pipefail
RUN="${1:?usage: install_drafters.sh RUN_DIR}"
ART="${ART:-plugins/tiny/ninfer_tiny/data/ninfer-tiny.ninfer}"
python3 -m ninfer_core.cli convert "$ART" "$ART.part" --dflash "$RUN/dflash" --dflash2 "$RUN/dflash2" --no-progress
mv "$ART.part" "$ART"
python3 -m ninfer_core.cli inspect "$ART" | head -20
