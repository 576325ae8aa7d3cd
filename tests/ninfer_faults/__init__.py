"""Test-only plugins that inject faults into a real server (see plugin.py)."""
