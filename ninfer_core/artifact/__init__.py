"""ninfer_core.artifact."""
