"""Micro-batches: one forward cut into pieces that follow each other through the stages, so that
stage s+1 runs piece j while stage s runs piece j+1.

A prefill chunk is cut along its tokens (piece j+1 attends over the K/V piece j wrote on the same
stage, and the recurrent state is carried in the slot from one piece to the next, so the result
is the chunk's); a decode or verify round is cut between lanes. A piece costs a stage nearly as
much weight traffic as the whole forward when the stage is memory bound, so a prefill chunk is cut
only when each piece still has `min_tokens` tokens.

A decode or verify round of several lanes is cut into one lane group per stage (`round_groups`):
stage s+1 runs group j while stage s runs group j+1, so every lane's round goes through the
stages together instead of each stage waiting for the whole round. The price is one more weight
read per stage and group; the runner's `round_groups` (1: whole rounds) picks.
"""

from __future__ import annotations

from dataclasses import replace

from ninfer_core.engine.model_api import (
    FINAL_HIDDEN,
    LOGITS_ALL,
    LOGITS_LAST,
    LOGITS_NONE,
    PREFILL,
    ForwardBatch,
    LaneSegment,
    SegmentOutput,
)


def plan(batch: ForwardBatch, stages: int, min_tokens: int, round_groups: int = 0) -> tuple[list[ForwardBatch], str]:
    """(pieces, how): how is "whole" (one piece), "lanes" (segments split between pieces) or
    "tokens" (the one prefill segment cut along its tokens). `round_groups` > 1 cuts a decode or
    verify round into that many lane groups (at most one lane each)."""
    segs = batch.segments
    total = sum(len(s) for s in segs)
    pieces = min(2 * stages, total // max(1, min_tokens))
    if all(s.kind != PREFILL for s in segs):
        pieces = min(max(pieces, round_groups), len(segs))
        if pieces < 2:
            return [batch], "whole"
        bounds = _even(len(segs), pieces)
        return [ForwardBatch(segs[a:b]) for a, b in bounds], "lanes"
    if pieces < 2:
        return [batch], "whole"
    if len(segs) != 1 or segs[0].side is not None:
        return [batch], "whole"
    seg = segs[0]
    at = seg.snapshot[0] if seg.snapshot is not None else None
    cuts = []
    for a, b in _even(len(seg), pieces):
        if at is not None and b == at and b + 1 < len(seg):
            b += 1  # a piece boundary exactly at the in-chunk capture: the capture stays inside a piece
        if cuts and a < cuts[-1][1]:
            a = cuts[-1][1]
        if a < b:
            cuts.append((a, b))
    if cuts[-1][1] != len(seg):
        cuts[-1] = (cuts[-1][0], len(seg))
    if len(cuts) < 2 or (at is not None and not any(a < at < b for a, b in cuts)):
        return [batch], "whole"
    out = []
    for i, (a, b) in enumerate(cuts):
        last = i == len(cuts) - 1
        logits = seg.logits if last else (LOGITS_ALL if seg.logits == LOGITS_ALL else LOGITS_NONE)
        snap = None
        if at is not None and a < at < b:
            snap = (at - a, seg.snapshot[1])
        out.append(ForwardBatch([replace(seg, start=seg.start + a, tokens=list(seg.tokens[a:b]), logits=logits,
                                         snapshot=snap)]))
    return out, "tokens"


def join(batch: ForwardBatch, how: str, outputs: list[list[SegmentOutput]]) -> list[SegmentOutput]:
    """The SegmentOutputs of `batch` from those of its pieces (in piece order)."""
    if how != "tokens":
        return [o for piece in outputs for o in piece]
    import torch

    seg = batch.segments[0]
    outs = [piece[0] for piece in outputs]
    if seg.logits == LOGITS_ALL:
        logits = torch.cat([o.logits for o in outs])
    else:
        logits = outs[-1].logits if seg.logits == LOGITS_LAST else None
    hidden = {k: torch.cat([o.hidden[k] for o in outs]) for k in outs[0].hidden}  # asked layers, FINAL_HIDDEN
    return [SegmentOutput(logits, hidden)]


def _even(n: int, parts: int) -> list[tuple[int, int]]:
    step, extra = divmod(n, parts)
    out, a = [], 0
    for i in range(parts):
        b = a + step + (1 if i < extra else 0)
        out.append((a, b))
        a = b
    return out


def output_rows(seg: LaneSegment) -> tuple[int, int]:
    """(logits rows, hidden rows) the last stage sends back for one segment."""
    n = len(seg)
    logits = {LOGITS_LAST: 1, LOGITS_ALL: n}.get(seg.logits, 0)
    return logits, n if FINAL_HIDDEN in seg.hidden else 0
