"""NInfer model family plugin for Gemma 4 (text part)."""

__version__ = "0.1.0"
