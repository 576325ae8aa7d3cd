"""The n-gram per-layer embedding (PLE) rows: hashing token n-grams to table rows.

For each PLE layer and each n-gram order 2..n, `heads_per_ngram` hashed heads: the n-gram
ending at a token is mixed as XOR_i(token[t - i] * multiplier[i]) (int64, no overflow: the
multipliers are below 2^63 / vocab) and reduced modulo the head's prime vocabulary, offset into the
layer's one table. A token reads (n - 1) * heads_per_ngram rows (16 for the published model); their
concatenation is its [ple_embed_dim] embedding. Tokens before the sequence start, and across an
end-of-sequence token, read as the EOS id (transformers' `_shift_right_ignore_eos`).
"""

from __future__ import annotations

import torch

from ninfer_flash_next.config import FlashNextConfig


class NgramHasher:
    """Row ids of one PLE layer's table for runs of tokens after a context of n - 1 tokens."""

    def __init__(self, cfg: FlashNextConfig, ple_index: int):
        sizes = cfg.ngram_head_sizes(ple_index)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.n, self.heads, self.eos = cfg.ngram_size, cfg.heads_per_ngram, int(cfg.eos_token_id)
        self.multipliers = torch.tensor(cfg.ngram_multipliers(ple_index), dtype=torch.int64, device="cpu")
        self.sizes = torch.tensor(sizes, dtype=torch.int64, device="cpu")
        self.offsets = torch.tensor(offsets, dtype=torch.int64, device="cpu")
        self.rows = cfg.ngram_table_rows(ple_index)

    def check_buffers(self, multipliers, sizes, offsets, where: str) -> None:
        """The checkpoint's stored hash buffers must be the ones the config derives."""
        for name, ours, theirs in (("layer_multipliers", self.multipliers, multipliers),
                                   ("ngram_heads_vocab_sizes", self.sizes, sizes),
                                   ("ngram_heads_offsets", self.offsets, offsets)):
            if theirs is not None and not torch.equal(ours, theirs.to(torch.int64).cpu()):
                raise ValueError(f"{where}.{name} does not match the n-gram hash the config derives")

    def row_ids(self, context: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """context [n-1] (the tokens before, EOS-filled at a sequence start), tokens [T] ->
        table rows [T, (n-1) * heads] (int64, CPU)."""
        hist = torch.cat([context.to(torch.int64).cpu(), tokens.to(torch.int64).cpu()])
        c = context.numel()
        t_len = tokens.numel()
        pos = torch.arange(c, c + t_len)
        eos_pos = torch.where(hist == self.eos, torch.arange(hist.numel()), -1)
        # the last EOS strictly before each position
        prev_eos = torch.cat([torch.tensor([-1]), torch.cummax(eos_pos, 0).values[:-1]])[pos]
        shifted = [hist[pos]]
        for s in range(1, self.n):
            src = hist[pos - s]
            valid = (pos - s) > prev_eos
            shifted.append(torch.where(valid, src, torch.full_like(src, self.eos)))
        blocks = []
        for order in range(2, self.n + 1):
            mixed = shifted[0] * self.multipliers[0]
            for i in range(1, order):
                mixed = torch.bitwise_xor(mixed, shifted[i] * self.multipliers[i])
            lo = (order - 2) * self.heads
            sizes, offs = self.sizes[lo: lo + self.heads], self.offsets[lo: lo + self.heads]
            blocks.append(torch.remainder(mixed[:, None], sizes[None]) + offs[None])
        return torch.cat(blocks, dim=-1)
