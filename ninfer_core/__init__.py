"""NInfer core: hook specs, plugin host, artifact format, tokenizer, engine and HTTP server."""

from ninfer_core.version import VERSION, build_string

__all__ = ["VERSION", "build_string", "hookimpl"]

import pluggy as _pluggy

hookimpl = _pluggy.HookimplMarker("ninfer")
