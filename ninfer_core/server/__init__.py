"""ninfer_core.server."""
