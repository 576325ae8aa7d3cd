"""ninfer_core.tokenizer: byte-level BPE tokenizer, chat templates and the reasoning splitter."""

from ninfer_core.tokenizer.bpe import Tokenizer, TokenizerError

__all__ = ["Tokenizer", "TokenizerError"]
