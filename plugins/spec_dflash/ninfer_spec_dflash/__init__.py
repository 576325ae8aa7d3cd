"""ninfer-spec-dflash: the `--spec dflash` and `--spec dflash2` speculative backends (block-diffusion drafters)."""
