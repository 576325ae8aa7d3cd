"""ninfer_core.tokenizer."""
