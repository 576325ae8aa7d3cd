"""Media in a chat prompt: the parts protocols found, acquired and prepared, placeholders expanded.

Protocols put a media part in a message's content list as {"type": "image"|"video", "media":
MediaRef}. `MediaService.expand_prompt` runs after the chat template rendered the prompt (one
placeholder per part, in message order): it acquires every item (data URI or URL), prepares it
through the cache (decode -> resize -> patch input on a bounded worker pool), lets the family grow
each placeholder into the item's tokens and replaces those with identity ids (see media.api).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ninfer_core.engine.api import EngineError
from ninfer_core.media.api import (
    IDENTITY_SPACE,
    VIDEO,
    MediaProcessor,
    MediaPrompt,
    MediaRef,
    PreparedMedia,
)
from ninfer_core.media.cache import LiveBudget, MediaCache
from ninfer_core.media.decode import decode_image, decode_video
from ninfer_core.media.options import MediaOptions
from ninfer_core.media.sources import acquire

MEDIA_KEY = "media"
VISION_ENVELOPE = 32768  # spec "Multimodal request": merged tokens of one request's media


def strip_media(messages: list[dict]) -> tuple[list[dict], list[MediaRef]]:
    """(messages the template renders, the media refs in message order). Parts keep their type
    ({"type": "image"}) so the template writes its placeholder; nested tool-result content lists
    are walked too."""
    refs: list[MediaRef] = []

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            ref = value.get(MEDIA_KEY)
            if isinstance(ref, MediaRef):
                refs.append(ref)
                return {k: v for k, v in value.items() if k != MEDIA_KEY}
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return [walk(m) for m in messages], refs


def has_media(messages: list[dict]) -> bool:
    def walk(value: Any) -> bool:
        if isinstance(value, dict):
            return isinstance(value.get(MEDIA_KEY), MediaRef) or any(walk(v) for v in value.values())
        if isinstance(value, list):
            return any(walk(v) for v in value)
        return False

    return walk(messages)


def identity_ids(digest: str, length: int, vocab_size: int, offset: int = 0) -> list[int]:
    """The ids a media item's tokens carry in the prompt (unique per digest and row)."""
    base = int(digest[:15], 16) + offset
    return [vocab_size + (base + j) % IDENTITY_SPACE for j in range(length)]


@dataclass
class PrepareReport:
    """Request-scoped media facts (request log): acquisition and preprocessing time, cache outcome."""

    items: int = 0
    source_bytes: int = 0
    payload_bytes: int = 0
    acquire_s: float = 0.0
    preprocess_s: float = 0.0
    cache: dict = field(default_factory=lambda: {"hit": 0, "miss": 0, "single_flight": 0})


class MediaService:
    """Everything a server needs to turn media parts into a MediaPrompt (one per loaded model)."""

    def __init__(self, processor: MediaProcessor, options: MediaOptions, vocab_size: int,
                 source_limit_bytes: int, permit_timeout_s: float = 600.0):
        self.processor = processor
        self.options = options
        self.vocab_size = vocab_size
        self.source_limit = source_limit_bytes
        self.max_merged = min(options.merged_bound(), processor.max_merged_limit)
        self.live = LiveBudget(options.live_mib << 20)
        self.cache = MediaCache(options.cache_mib << 20, self.live)
        # spec "Execution behavior": media requests share one preparation permit (their items still
        # prepare concurrently on the pool), waited for within the pending timeout
        self._permit = threading.Semaphore(1)
        self.permit_timeout_s = permit_timeout_s
        threads = options.preprocess_threads or min(16, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ninfer-media")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def bound_for(self, ref: MediaRef) -> int:
        return self.processor.item_bound(ref.kind, ref.detail, self.max_merged)

    def _prepare(self, ref: MediaRef, report: PrepareReport) -> PreparedMedia:
        t0 = time.monotonic()
        data, mime = acquire(ref.url, self.source_limit, self.options.fetch_timeout_s, ref.param)
        t1 = time.monotonic()
        bound = self.bound_for(ref)
        h = hashlib.sha256(data)
        h.update(f"\0{ref.kind}\0{bound}".encode())
        digest = h.hexdigest()

        def build() -> PreparedMedia:
            if ref.kind == VIDEO:
                frames, times = decode_video(data, mime, ref.param, self.processor.video_fps,
                                             self.processor.video_max_frames)
                pv, grid, tokens, extra = self.processor.prepare_video(frames, times, bound)
            else:
                pv, grid, tokens = self.processor.prepare_image(decode_image(data, mime, ref.param), bound)
                extra = {}
            return PreparedMedia(ref.kind, digest, pv, tuple(int(g) for g in grid), int(tokens), extra)

        item, how = self.cache.get_or_build(digest, build)
        report.cache[how] += 1
        report.source_bytes += len(data)
        report.acquire_s += t1 - t0
        report.preprocess_s += time.monotonic() - t1
        return item

    def prepare(self, refs: list[MediaRef], report: PrepareReport | None = None) -> list[PreparedMedia]:
        """Every item of a request, prepared concurrently on the worker pool (first failure wins)."""
        report = report if report is not None else PrepareReport()
        total = 0
        for ref in refs:
            total += len(ref.url) if ref.url.startswith("data:") else 0
        if total * 3 // 4 > self.source_limit:
            raise EngineError(400, "media_budget_exceeded", f"The request's media hold about {total * 3 // 4} "
                              f"bytes, above the media source budget of {self.source_limit} bytes.",
                              param=refs[0].param if refs else None)
        if not self._permit.acquire(timeout=self.permit_timeout_s):
            raise EngineError(503, "request_queue_timeout", "The media preparation permit was not free before the "
                              "pending timeout (--pending-timeout-ms).")
        try:
            futures = [self._pool.submit(self._prepare, ref, report) for ref in refs]
            items = [fut.result() for fut in futures]
        finally:
            self._permit.release()
        report.items = len(items)
        report.payload_bytes = sum(i.nbytes for i in items)
        return items

    def expand_prompt(self, ids: list[int], refs: list[MediaRef]) -> tuple[list[int], MediaPrompt]:
        """Rendered ids (one placeholder per ref) -> (prompt ids with identity ids, MediaPrompt)."""
        want = [self.processor.placeholder_ids.get(r.kind) for r in refs]
        placeholders = set(self.processor.placeholder_ids.values())
        found = [i for i in ids if i in placeholders]
        if len(found) != len(refs) or any(a != b for a, b in zip(found, want)):
            raise EngineError(400, "invalid_prompt", f"The chat template wrote {len(found)} media placeholders for "
                              f"{len(refs)} media parts: media can only appear where the template places it "
                              "(user and tool-result content).", param="messages")
        report = PrepareReport()
        items = self.prepare(refs, report)
        payload = sum(i.nbytes for i in items)
        if payload > self.live.capacity:
            raise EngineError(400, "media_budget_exceeded", f"The request's prepared media take {payload} bytes, "
                              f"above --media-live-mib ({self.live.capacity >> 20} MiB).", param="messages")
        merged = sum(i.tokens for i in items)
        if merged > VISION_ENVELOPE:
            raise EngineError(400, "media_budget_exceeded", f"The request's media take {merged} merged tokens, above "
                              f"the vision envelope of {VISION_ENVELOPE}.", param="messages")
        exp = self.processor.expand(ids, items)
        out = list(exp.ids)
        for span in exp.spans:
            out[span.start: span.end] = identity_ids(span.item.digest, span.length, self.vocab_size, span.offset)
        return out, MediaPrompt(exp.spans, exp.positions, exp.position_delta, report)
