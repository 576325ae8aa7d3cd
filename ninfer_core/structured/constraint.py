"""One request's output constraint: the engine-facing object of structured output.

The engine (and a speculative round driver) sees four calls:

    c.needs_mask()                       # False while the request reasons, or once terminated
    c.fill_next_mask(bitmask, index=0)   # fill bitmask[index] (int32 words, CPU) for the next token
    c.accept(token_id) -> bool           # advance with a committed token; False: not admitted
    c.rollback(n)                        # undo the last n accepted tokens (drafts that lost)
    c.is_terminated()

A verify round fills one row per draft position by accepting the drafts tentatively and rolling
back: fill row 0, accept(d0), fill row 1, accept(d1), ..., then rollback(k) and accept the
verified prefix. Grammar state advances only with what the engine commits.

Phases: while the prompt leaves a reasoning block open nothing is masked; the reasoning-close token
switches to the format newlines, then to the grammar (thinking first, then constrained content).
"""

from __future__ import annotations

import collections

import numpy as np
import torch
import xgrammar as xgr

from ninfer_core.structured.tracker import Tracker

REASONING, CLOSE, ACTIVE = "reasoning", "close", "active"
MAX_ROLLBACK = 64  # tokens a rollback can undo (a verify round's drafts)


class Constraint:
    def __init__(self, compiled, vocab, *, in_reasoning: bool = False, think_end_ids=()):
        self.compiled = compiled
        self.vocab = vocab
        self.matcher = xgr.GrammarMatcher(compiled.grammar)
        self.tracker = Tracker(compiled.plan, vocab) if compiled.plan is not None else None
        self.think_end = frozenset(think_end_ids)
        self.phase = REASONING if (in_reasoning and self.think_end) else ACTIVE
        self._close_words = compiled.close_words
        self._tool_token = vocab.tool_open_id if compiled.with_tools else None
        self._started = False  # an ACTIVE token was accepted (tools: the first one picks the branch)
        self._history: collections.deque = collections.deque(maxlen=MAX_ROLLBACK)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab.size)  # [1, words] int32, CPU
        # the engine's mask job (ninfer_core.structured.masks): future, start time, token count
        self.job = None
        self.rows_job = None  # a verify round's draft-position masks (MaskStage.prefetch_rows)
        self.rows_started = 0.0
        self.job_started = 0.0
        self.mask_seconds: list[float] = []

    # -- state --------------------------------------------------------------------------------
    def needs_mask(self) -> bool:
        return self.phase != REASONING and not self.matcher.is_terminated()

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    # -- masks ---------------------------------------------------------------------------------
    def fill_next_mask(self, bitmask: torch.Tensor | None = None, index: int = 0) -> bool:
        """Fill bitmask[index] with the tokens admitted next; False when nothing is constrained now."""
        bitmask = self.bitmask if bitmask is None else bitmask
        if self.phase == REASONING:
            return False
        row = bitmask[index].numpy()
        if self.phase == CLOSE:
            row.view(np.uint32)[:] = self._close_words[: row.shape[0]]
            return True
        self.matcher.fill_next_token_bitmask(bitmask, index)
        if self.tracker is not None:
            self.tracker.restrict(row)
        return True

    # -- advancing -----------------------------------------------------------------------------
    def accept(self, token_id: int) -> bool:
        """Advance with a committed token; False (state unchanged) when the grammar refuses it."""
        token_id = int(token_id)
        if self.phase == REASONING:
            if token_id in self.think_end:
                self.phase = CLOSE
            self._history.append((REASONING, None, False, self._started))
            return True
        if self.phase == CLOSE:
            words = self._close_words
            if not (words[token_id >> 5] >> np.uint32(token_id & 31)) & np.uint32(1):
                return False
            self.phase = ACTIVE
            self._history.append((CLOSE, None, False, self._started))
            return True
        before = self.tracker.copy() if self.tracker is not None else None
        if not self.matcher.accept_token(token_id):
            return False
        if self.tracker is not None:
            if not self._started and token_id == self._tool_token:
                self.tracker = None  # the answer is a tool call: the JSON checks do not apply
            elif not self.tracker.feed(self.vocab.token_bytes[token_id]):
                self.matcher.rollback(1)
                self.tracker = before
                return False
        self._history.append((ACTIVE, before, True, self._started))
        self._started = True
        return True

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (at most MAX_ROLLBACK)."""
        if n > len(self._history):
            raise ValueError(f"cannot roll back {n} tokens, {len(self._history)} are kept")
        grammar_tokens = 0
        for _ in range(n):
            phase, tracker, in_grammar, started = self._history.pop()
            self.phase = phase
            self._started = started
            if in_grammar:
                grammar_tokens += 1
                self.tracker = tracker
        if grammar_tokens:
            self.matcher.rollback(grammar_tokens)
