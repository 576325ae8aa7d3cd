"""Repository-level pytest setup: plugin test folders run only when their package is installed."""

import importlib.util
from pathlib import Path

# The contract suite's pytest plugin, for a checkout whose ninfer-core is not installed from it
# (installed, its pytest11 entry point of the same name loads it and this is a no-op).
pytest_plugins = ["ninfer_core.testing"]

collect_ignore = []
for plugin_dir in sorted((Path(__file__).parent / "plugins").glob("*/")):
    module = "ninfer_" + plugin_dir.name
    if importlib.util.find_spec(module) is None:
        collect_ignore.append(str(plugin_dir))
