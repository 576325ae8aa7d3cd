"""One prefill chunk of the staged lane, run by the engine worker.

Owns the prefill unit: where the chunk ends (the prompt, `--prefill-chunk`, or a planned
context-cache capture frontier, split there or captured inside the forward into a reserved state
slot), the media embeddings its tokens need (encoded on first use), the forward, the prompt's
scores, the structured-output mask and the first sampled token with its logprob record, then the
captures and the progress event. The token is committed by the engine (`Engine._commit`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from ninfer_core.engine.api import EngineError, EngineEvent
from ninfer_core.engine.media_side import segment_side, whole_spans_end
from ninfer_core.engine.model_api import PREFILL, ForwardBatch, LaneSegment
from ninfer_core.engine.pages import pages_for
from ninfer_core.engine.request import SeqStatus
from ninfer_core.engine.sampler import sample, token_logprobs

if TYPE_CHECKING:
    from ninfer_core.engine.engine import Engine
    from ninfer_core.engine.request import Sequence

log = logging.getLogger("ninfer.engine")


def prefill_chunk(eng: Engine, seq: Sequence) -> None:
    """Run the staged lane's next prefill chunk (on the worker); the last one samples its first token.

    A lane whose chunk needs media still encoding yields the unit to another staged lane, or to
    the next decode rounds (media_side.MediaEncodes)."""
    encodes = getattr(eng, "media_encodes", None)
    if seq.request.media is not None and encodes is not None:
        try:
            ready = encodes.ready(seq)
        except Exception as exc:
            log.exception("media encode failed for request %s", seq.request_id)
            eng._fail(seq, exc)
            return
        if not ready:
            other = encodes.next_staged(seq)
            if other is None:
                encodes.wait(seq)
                return
            seq = other
    start = seq.num_cached
    end = min(start + eng.options.prefill_chunk, seq.prompt_len)
    snap = None  # (frontier, reserved state slot): a capture inside this chunk
    if eng.cache is not None:
        ahead = eng.cache.splits_ahead(seq)
        if ahead and ahead[0] < end:
            with eng._cv:
                slot = eng.cache.reserve_capture_slot(seq, ahead[0], time.monotonic())
            if slot is not None:
                # one forward leaves the frontier's state in the slot: no split, no copy
                snap = (ahead[0], slot)
                if len(ahead) > 1 and ahead[1] < end:
                    end = ahead[1]
            else:
                end = ahead[0]  # the chunk ends at the frontier; after_chunk copies the state
    if seq.request.media is not None and getattr(eng.runner, "whole_media_spans", False):
        moved = whole_spans_end(seq.request.media, start, end)
        if moved != end:
            end = moved
            if snap is not None and snap[0] >= end:  # the capture is no longer inside the chunk
                with eng._cv:
                    eng.cache.release_capture_slot(snap[1])
                snap = None
    chunk = seq.prompt_ids[start: end]
    pages = seq.pages[: pages_for(start + len(chunk), eng.page_size)]
    last = start + len(chunk) == seq.prompt_len
    segment = LaneSegment(seq.slot, {g: pages for g in eng.cache_spec.group_names}, start, chunk, PREFILL,
                          "last" if last else "none", eng.rounds.target_layers,
                          snapshot=None if snap is None else (snap[0] - start, snap[1]))
    t0 = time.monotonic()
    try:
        if seq.request.media is not None:
            segment.side = segment_side(seq.request.media, start, len(chunk),
                                        lambda item: _media_rows(eng, seq, item))
        out = eng.runner.forward(ForwardBatch([segment]))[0]
        logits = out.logits
        eng._launches += 1
        eng._flush()
        if last and seq.request.score_token_ids:
            seq.scores = _log_probs_of(logits, seq.request.score_token_ids)
        masked = eng._masks.apply(logits[-1] if logits.dim() == 2 else logits, [seq]) if last else {}
        if masked:
            raise masked[0]
        token = sample(logits, [seq.sampler])[0] if last and seq.max_tokens > 0 else None
        record = None
        if token is not None:
            row = logits[-1:] if logits.dim() == 2 else logits
            record = logprob_records(row, [seq], [token], [None])[0]
    except Exception as exc:
        log.exception("prefill failed for request %s", seq.request_id)
        if snap is not None:
            with eng._cv:
                eng.cache.release_capture_slot(snap[1])
        eng._fail(seq, exc)
        return
    eng.rounds.observed(seq, start, out.hidden)
    seq.num_cached += len(chunk)
    if last:
        seq.media_embeds = None  # the prompt is in the KV: its media embeddings are done with
    with eng._cv:
        eng.counters["computed_prefill_tokens"] += len(chunk)
        eng.counters["prefill_seconds"] += time.monotonic() - t0
    if eng.cache is not None and (snap is not None or not last):
        with eng._cv:
            if snap is not None:
                eng.cache.capture_reserved(seq, snap[0], snap[1], time.monotonic())
            if not last:
                eng.cache.after_chunk(seq, time.monotonic())
    if not last:
        if seq.request.progress:  # llama.cpp return_progress
            eng._post(seq, EngineEvent("progress", progress={"total": seq.prompt_len, "cache": seq.cache_n,
                                                          "processed": seq.num_cached}))
        return
    seq.t_first = time.monotonic()
    if token is None:  # max_tokens == 0: prompt processing only
        eng._finish(seq, "length", "context" if seq.at_context else "max_tokens", "")
        return
    seq.status = SeqStatus.DECODE
    eng._commit(seq, token, record)


def _media_rows(eng: Engine, seq: Sequence, item):
    """An item's embeddings [tokens, hidden]: encoded before the unit (MediaEncodes.ready), or
    here on first use."""
    got = seq.media_embeds if seq.media_embeds is not None else {}
    seq.media_embeds = got
    k = id(item)
    if k not in got:
        if eng.vision is None or getattr(eng, "media_encodes", None) is None:
            raise EngineError(400, "vision_disabled", "This server was started without --vision.")
        got[k] = eng.media_encodes.encode_now(seq, item)
    return got[k]


def logprob_records(logits, seqs: list[Sequence], tokens: list[int], forced: list) -> list:
    """The logprob record of each row's token for the lanes that asked for logprobs (None else)."""
    rows = [i for i, s in enumerate(seqs) if s.request.logprobs is not None and forced[i] is None]
    records = [None] * len(seqs)
    if rows:
        if logits.dim() == 1:
            logits = logits.unsqueeze(0)
        got = token_logprobs(logits[rows], [seqs[i].sampler for i in rows], [tokens[i] for i in rows],
                             [seqs[i].request.logprobs for i in rows])
        for i, r in zip(rows, got):
            records[i] = r
    return records


def _log_probs_of(logits, token_ids: list[int]) -> list[float]:
    """log-softmax over the whole vocabulary of the last row of `logits`, at `token_ids`."""
    row = logits[-1] if logits.dim() > 1 else logits  # [vocab]
    logp = torch.log_softmax(row.float(), dim=-1)
    return logp[torch.tensor(token_ids, dtype=torch.long, device=logp.device)].tolist()
