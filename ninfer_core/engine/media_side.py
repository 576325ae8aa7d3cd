"""The side inputs of a request with media: rope positions and the embeddings of media rows.

The engine asks for a lane's segment [start, start + n): positions come from the prepared prompt
(past its end, index + position_delta on every axis), embeddings from the items whose spans the
segment overlaps, encoded once per request by the vision residency when first needed (a prefix
reused from the context cache never asks for the rows it covers, so its media is not encoded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ninfer_core.engine.model_api import SideInputs


def segment_side(media: Any, start: int, n: int, embeds_of: Callable[[Any], Any] | None) -> SideInputs | None:
    """SideInputs for rows [start, start + n) of a lane whose request carries `media`
    (ninfer_core.media.api.MediaPrompt); `embeds_of(item)` gives an item's embeddings [tokens, hidden]."""
    import torch

    end = start + n
    pos = None
    if media.positions is not None:
        table = media.positions
        total = int(table.shape[-1])
        parts = []
        if start < total:
            parts.append(table[:, start: min(end, total)])
        if end > total:
            tail = torch.arange(max(start, total), end, dtype=torch.int64) + int(media.position_delta)
            parts.append(tail.expand(int(table.shape[0]), -1))
        pos = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    embeddings = []
    if embeds_of is not None:
        for span in media.spans:
            lo, hi = max(span.start, start), min(span.end, end)
            if lo < hi:
                emb = embeds_of(span.item)
                a = span.offset + lo - span.start
                embeddings.append((lo - start, emb[a: a + hi - lo]))
    if pos is None and not embeddings:
        return None
    return SideInputs(positions=pos, embeddings=embeddings)


def whole_spans_end(media: Any, start: int, end: int) -> int:
    """A prefill chunk's end [start, end) moved off any media span it would cut (a runner with
    `whole_media_spans`): to the span's start when the chunk begins before it, else to its end."""
    for span in media.spans:
        if span.start < end < span.end:
            return span.start if span.start > start else span.end
    return end


def vision_overlay_report(windows: list[dict] | None) -> dict | None:
    """request_done.vision_overlay: the overlay windows a request's encodes opened. Windows funded
    from free KV pages run beside other lanes (concurrent); exclusive ones (the text weights' tail
    unmapped) do not exist here; allocator windows are the fallback when no run of free pages covers
    one."""
    if not windows:
        return None
    kinds = [w["window"] for w in windows]
    return {"windows": len(windows), "concurrent_windows": kinds.count("kv"), "exclusive_windows": 0,
            "allocator_windows": kinds.count("allocator"), "ms": sum(w["ms"] for w in windows),
            "window_bytes": max(w["window_bytes"] for w in windows),
            "staged_bytes": sum(w["staged_bytes"] for w in windows)}
