"""ninfer_core.protocols."""
