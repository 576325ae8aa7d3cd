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
        next token's mask first (its job reads the matcher; it started at the last commit)."""
        c = constraint_of(seq)
        if c is None:
            return len(drafts)
        if not drafts or c.is_terminated() or not self._settle_job(c):
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

    def prefetch_rows(self, seq, drafts: list[int]) -> None:
        """Start the masks of draft positions 1..k on a host thread, to run while the verify forward
        does (call after `admitted`, with the drafts it kept, before the forward launches)."""
        c = constraint_of(seq)
        if c is None or not drafts:
            return
        self._settle_job(c)
        c.rows_started = time.monotonic()
        c.rows_job = self._executor().submit(_fill_rows, c, list(drafts))

    def _settle_job(self, c) -> bool:
        """The next token's mask job started (when needed) and finished; False when it failed (the
        row-0 `apply` reports that failure for this request)."""
        self.prefetch(c)
        if c.job is None:
            return True
        try:
            c.job.result(timeout=max(0.0, c.job_started + self.timeout_s - time.monotonic()))
            return True
        except Exception:  # noqa: BLE001 - apply() reports it
            return False

    def apply_rows(self, logits: torch.Tensor, seq, drafts: list[int]):
        """A constrained lane's verify rows [T, vocab], masked in place: row 0 by the next token's
        mask, row j by the mask after the first j drafts (`prefetch_rows` computed those while the
        forward ran). Returns (rows usable, EngineError or None): a draft whose following mask admits
        nothing ends the usable rows, and acceptance reads no further row."""
        c = constraint_of(seq)
        if c is None:
            return logits.shape[0], None
        job, c.rows_job = getattr(c, "rows_job", None), None
        if c.needs_mask():
            failed = self.apply(logits[0], [seq])
            if failed:
                if job is not None:
                    _quiet_wait(job, self.timeout_s)  # it reads the matcher: let it end first
                return 1, failed[0]
        if not drafts:
            return logits.shape[0], None
        if job is None:  # (not prefetched: nothing says the drafts' rows are admitted)
            return 1, None
        try:
            extra, masked, n = job.result(timeout=max(0.0, c.rows_started + self.timeout_s - time.monotonic()))
        except concurrent.futures.TimeoutError:
            _quiet_wait(job, None)
            return 1, mask_timeout(self.timeout_s)
        except Exception as e:  # noqa: BLE001 - a failed mask fails its own request only
            return 1, _mask_error(e)
        rows = [j + 1 for j in range(n - 1) if masked[j]]
        if rows:
            import xgrammar as xgr

            full = torch.zeros((logits.shape[0], extra.shape[1]), dtype=extra.dtype)
            for r in rows:
                full[r] = extra[r - 1]
            xgr.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True), indices=rows)
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


def _fill_rows(c, drafts: list[int]):
    """The masks after each draft prefix: (bitmask [k, words], row j+1 masked?, rows usable).
    The drafts are accepted tentatively and rolled back, whatever happens."""
    import xgrammar as xgr

    extra = xgr.allocate_token_bitmask(len(drafts), c.vocab.size)
    masked = [False] * len(drafts)
    n, accepted, filled, t0 = 1, 0, 0, time.perf_counter()
    try:
        for j, d in enumerate(drafts):
            if not c.accept(d):
                break
            accepted += 1
            if c.is_terminated():  # the grammar ended: the request stops at this token
                n += 1
                break
            if c.needs_mask():
                c.fill_next_mask(extra, j)
                filled += 1
                if not bool(extra[j].any()):
                    break
                masked[j] = True
            n += 1
    finally:
        c.rollback(accepted)
    if filled:
        c.mask_seconds.append((time.perf_counter() - t0) / filled)
    return extra, masked, n


def _quiet_wait(job, timeout) -> None:
    try:
        job.result(timeout=timeout)
    except Exception:  # noqa: BLE001 - its result is not needed
        pass


def _mask_error(e: Exception):
    from ninfer_core.engine.api import EngineError

    return EngineError(
        500,
        "grammar_mask_failed",
        f"The structured-output token mask failed: {type(e).__name__}",
        type_="server_error",
    )
