"""The engine's mask stage: constrained requests' masks on host threads beside the forward.

The engine makes two calls (ninfer_core.engine.engine):
- `apply(logits, seqs)` after a forward and before sampling: waits for each constrained row's mask
  (computed on a host thread since that request's previous commit, so it overlaps the forward
  that produced these logits), applies it to its logits row in place (before penalties,
  temperature and the top-k/top-p/min-p filters, so log probabilities see it too) and returns
  {row index: EngineError} for rows whose mask failed (over MASK_TIMEOUT_S, or nothing admitted);
- `commit(seq, token)` when a token is committed: advances the request's grammar; returns an
  EngineError (500) when the grammar does not admit the token, else starts the next mask.
Unconstrained rows cost nothing; constrained and unconstrained requests share rounds.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import torch

from ninfer_core.structured.errors import grammar_violation, mask_timeout

MASK_TIMEOUT_S = 5.0
DRAFT_MASK_BUDGET_S = 0.004  # a constrained request drafts while its masks take at most this (spec)


def constraint_of(seq):
    return getattr(seq.request, "constraint", None)


class MaskStage:
    def __init__(self, threads: int = 2, timeout_s: float = MASK_TIMEOUT_S):
        self.threads, self.timeout_s = threads, timeout_s
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.threads, thread_name_prefix="ninfer-mask"
                )
            return self._pool

    def prefetch(self, c) -> None:
        """Start computing a constraint's next mask on a host thread (no-op when one is pending)."""
        if c is None or c.job is not None or not c.needs_mask():
            return
        c.job_started = time.monotonic()
        c.job = self._executor().submit(_fill, c)

    def apply(self, logits: torch.Tensor, seqs: list) -> dict:
        """Mask the constrained rows of `logits` ([B, vocab] or [vocab] for one row) in place."""
        rows, masks, failed = [], [], {}
        for i, seq in enumerate(seqs):
            c = constraint_of(seq)
            if c is None or not c.needs_mask():
                continue
            self.prefetch(c)
            job, c.job = c.job, None
            try:
                applies = job.result(timeout=max(0.0, c.job_started + self.timeout_s - time.monotonic()))
            except concurrent.futures.TimeoutError:
                failed[i] = mask_timeout(self.timeout_s)
                continue
            except Exception as e:  # noqa: BLE001 - a failed mask fails its own request only
                failed[i] = grammar_violation() if not str(e) else _mask_error(e)
                continue
            if not applies:
                continue
            if not bool(c.bitmask.any()):
                failed[i] = grammar_violation()
                continue
            rows.append(i)
            masks.append(c.bitmask)
        if rows:
            import xgrammar as xgr

            view = logits.unsqueeze(0) if logits.dim() == 1 else logits
            bitmask = torch.cat(masks).to(view.device, non_blocking=True)
            if len(rows) == view.shape[0]:
                xgr.apply_token_bitmask_inplace(view, bitmask)
            else:
                full = torch.zeros((view.shape[0], bitmask.shape[1]), dtype=bitmask.dtype, device=view.device)
                full[rows] = bitmask
                xgr.apply_token_bitmask_inplace(view, full, indices=rows)
        return failed

    def drafting_allowed(self, seq) -> bool:
        """A constrained request verifies drafts while its recent masks cost at most 4 ms each
        (the verification hides them), and decodes without drafts while they cost more; the next
        token's mask is measured every round, so drafting resumes once masks are cheap again."""
        c = constraint_of(seq)
        if c is None:
            return True
        recent = c.mask_seconds[-8:]
        return not recent or sum(recent) / len(recent) <= DRAFT_MASK_BUDGET_S

    def admitted(self, seq, drafts: list[int]) -> int:
        """How many leading drafts the request's grammar admits (accepted tentatively, rolled back):
        the rest are cut before the verify forward, so a refused draft costs no row. Waits for the
        next token's mask job first (it reads the matcher; it started at the last commit)."""
        c = constraint_of(seq)
        if c is None or not drafts or c.is_terminated():
            return len(drafts) if c is None or not c.is_terminated() else 0
        if c.job is not None:
            try:
                c.job.result(timeout=max(0.0, c.job_started + self.timeout_s - time.monotonic()))
            except Exception:  # noqa: BLE001 - apply() reports the failure for this request
                return 0
        n = 0
        for d in drafts:
            if not c.accept(d):
                break
            n += 1
            if c.is_terminated():
                break
        c.rollback(n)
        return n

    def apply_rows(self, logits: torch.Tensor, seq, drafts: list[int]):
        """A constrained lane's verify rows [T, vocab], masked in place: row 0 by the next token's
        mask, row j by the mask after the first j drafts (accepted tentatively, then rolled back).
        Returns (rows usable, EngineError or None): a draft the grammar refuses ends the rows (the
        row before it excludes it, so it is never accepted), and acceptance reads no further row.
        A draft that closes the reasoning block switches the following rows to the format's masks."""
        c = constraint_of(seq)
        if c is None:
            return logits.shape[0], None
        if c.needs_mask():
            failed = self.apply(logits[0], [seq])
            if failed:
                return 1, failed[0]
        if not drafts or c.is_terminated():
            return (1 if drafts else logits.shape[0]), None
        import xgrammar as xgr

        n, t0, masked = 1, time.perf_counter(), 0
        extra = xgr.allocate_token_bitmask(len(drafts), c.vocab.size)
        accepted = 0
        for j, d in enumerate(drafts[: logits.shape[0] - 1]):
            if not c.accept(d):
                break
            accepted += 1
            if c.is_terminated():  # the grammar ended: the request stops at this token
                n += 1
                break
            if c.needs_mask():
                c.fill_next_mask(extra, j)
                masked += 1
                if not bool(extra[j].any()):
                    break
                words = extra.shape[1]
                xgr.apply_token_bitmask_inplace(logits[n : n + 1], extra[j : j + 1, :words].to(logits.device))
            n += 1
        c.rollback(accepted)
        if masked:
            c.mask_seconds.append((time.perf_counter() - t0) / masked)
        return n, None

    def commit(self, seq, token: int):
        """Advance the request's grammar with a committed token; an EngineError when refused."""
        c = constraint_of(seq)
        if c is None:
            return None
        if c.job is not None:  # an unused mask (a forced token): let it finish before the matcher moves
            job, c.job = c.job, None
            try:
                job.result(timeout=self.timeout_s)
            except Exception:  # noqa: BLE001 - its result is not needed
                pass
        if not c.accept(token):
            return grammar_violation()
        self.prefetch(c)
        return None

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _fill(c) -> bool:
    t0 = time.perf_counter()
    applies = c.fill_next_mask()
    if applies:
        c.mask_seconds.append(time.perf_counter() - t0)
    return applies


def _mask_error(e: Exception):
    from ninfer_core.engine.api import EngineError

    return EngineError(
        500,
        "grammar_mask_failed",
        f"The structured-output token mask failed: {type(e).__name__}",
        type_="server_error",
    )
