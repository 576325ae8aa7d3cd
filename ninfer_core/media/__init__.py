"""Image and video input: acquisition, decoding, prepared-payload caches, placeholder expansion,
and the built-in vision residencies (see `ninfer_core.media.api` for the contract)."""
