"""Repository-level pytest setup: plugin test folders run only when their package is installed."""

import importlib.util
from pathlib import Path

collect_ignore = []
for plugin_dir in sorted((Path(__file__).parent / "plugins").glob("*/")):
    module = "ninfer_" + plugin_dir.name
    if importlib.util.find_spec(module) is None:
        collect_ignore.append(str(plugin_dir))
