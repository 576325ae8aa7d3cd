"""ninfer_core.engine."""
