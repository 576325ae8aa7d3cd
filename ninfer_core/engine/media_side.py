"""The side inputs of a request with media: rope positions and the embeddings of media rows.

The engine asks for a lane's segment [start, start + n): positions come from the prepared prompt
(past its end, index + position_delta on every axis), embeddings from the items whose spans the
segment overlaps, encoded once per request by the vision residency when first needed (a prefix
reused from the context cache never asks for the rows it covers, so its media is not encoded).
`MediaEncodes` runs those encodes beside other lanes' decode.
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
    from free KV pages run beside other lanes (concurrent); exclusive ones borrowed the evicted tail
    of the text weights (evict and restore times, bytes evicted); allocator windows are the last
    resort of a tail too small for one."""
    if not windows:
        return None
    kinds = [w["window"] for w in windows]
    return {"windows": len(windows), "concurrent_windows": kinds.count("kv") + kinds.count("allocator"),
            "exclusive_windows": kinds.count("tail"), "kv_windows": kinds.count("kv"),
            "allocator_windows": kinds.count("allocator"), "ms": sum(w["ms"] for w in windows),
            "window_bytes": max(w["window_bytes"] for w in windows),
            "staged_bytes": sum(w["staged_bytes"] for w in windows),
            "evict_bytes": sum(w.get("evict_bytes", 0) for w in windows),
            "evict_ms": sum(w.get("evict_ms", 0.0) for w in windows),
            "restore_ms": sum(w.get("restore_ms", 0.0) for w in windows)}


def overlay_log_text(report: dict | None) -> str:
    """The request log line's overlay=<windows>x<conc|excl|mixed> <ms> (evict <MiB> <ms>, restore
    <ms>, staged <MiB>) for a request_done.vision_overlay report; "" without one."""
    if not report:
        return ""
    excl, n = report["exclusive_windows"], report["windows"]
    mode = "excl" if excl == n else "conc" if excl == 0 else "mixed"
    mib = 1 << 20
    return (f" overlay={n}x{mode} {report['ms']:.0f} ms (evict {report['evict_bytes'] / mib:.1f} MiB "
            f"{report['evict_ms']:.0f} ms, restore {report['restore_ms']:.0f} ms, staged "
            f"{report['staged_bytes'] / mib:.1f} MiB)")


class MediaEncodes:
    """A lane's media encodes beside other lanes' decode (spec "Vision residency").

    Before a prefill unit the worker asks `ready(seq)`: every item the unit's rows overlap that is
    not encoded yet is opened by the vision residency (`VisionResidency.open`) and, unless the job
    is exclusive, handed to one encoder thread (one encode at a time, on a device stream of its
    own), and the lane yields its prefill unit: the worker runs other lanes' decode rounds (and
    another staged lane's prefill) meanwhile, and only waits, on the engine's condition, when
    nothing else can run. An exclusive job (an overlay window over the text weights' tail) runs
    on the worker itself, so nothing else runs until it closes."""

    def __init__(self, eng: Any):
        self.eng = eng
        self._pool = None  # concurrent.futures.ThreadPoolExecutor(1), made at the first job
        self._stream = None  # the encoder thread's CUDA stream
        self.in_flight = 0  # jobs submitted and not finished (a suspend waits for none)
        self.yields = 0  # prefill units a lane yielded while its encode ran

    # -- worker side ---------------------------------------------------------------------------
    def ready(self, seq: Any) -> bool:
        """True when the media of `seq`'s next prefill unit is encoded (the encodes it lacks are
        started, an exclusive one run, here); raises an encode's failure."""
        eng, media = self.eng, seq.request.media
        start = seq.num_cached
        end = min(start + eng.options.prefill_chunk, seq.prompt_len)
        got = seq.media_embeds if seq.media_embeds is not None else {}
        seq.media_embeds = got
        jobs = seq.media_jobs
        for k, fut in list(jobs.items()):  # collect what finished (its failure raises here)
            if fut.done():
                del jobs[k]
                got[k] = self._finish(seq, *fut.result())
        pending = bool(jobs)  # one job of a lane at a time: a queued job would hold its window idle
        for span in media.spans:
            k = id(span.item)
            if span.end <= start or span.start >= end or k in got or k in jobs:
                continue
            if pending:
                break
            job = self._open(span.item)
            if job.exclusive:
                got[k] = self._finish(seq, span.item, job, *self._timed(job))
                continue
            jobs[k] = self._submit(span.item, job)
            pending = True
        return not pending

    def encode_now(self, seq: Any, item: Any) -> Any:
        """An item's embeddings encoded on the worker (rows asked for outside `ready`)."""
        job = self._open(item)
        return self._finish(seq, item, job, *self._timed(job))

    def next_staged(self, seq: Any) -> Any:
        """Another staged lane whose next prefill unit can run now, or None (its failures end it)."""
        with self.eng._cv:
            others = [s for s in self.eng.scheduler.staged() if s is not seq]
        for s in others:
            try:
                if s.request.media is None or self.ready(s):
                    return s
            except Exception as exc:  # noqa: BLE001 - its encode failed: that lane fails, the others go on
                self.eng._fail(s, exc)
        return None

    def wait(self, seq: Any) -> None:
        """`seq` yielded its prefill unit: wait for its encode (or any news) unless a decode round,
        a cancellation, a control or background cache work can run now."""
        eng = self.eng
        self.yields += 1
        with eng._cv:
            if any(f.done() for f in seq.media_jobs.values()) or eng._stopping or eng._cancelled \
                    or eng._controls or eng.scheduler.decode_batch() \
                    or (eng.cache is not None and eng.cache.has_background_work()):
                return
            eng._cv.wait()  # an encode's end, a submit, a cancel or a control notifies

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # -- jobs ------------------------------------------------------------------------------------
    def _open(self, item: Any):
        from ninfer_core.media.api import EncodeJob

        vision = self.eng.vision
        opener = getattr(vision, "open", None)
        return opener(item) if opener is not None else EncodeJob(lambda: vision.encode(item))

    @staticmethod
    def _timed(job: Any) -> tuple:
        import time

        t0 = time.monotonic()
        return job.run(), time.monotonic() - t0

    def _submit(self, item: Any, job: Any):
        import concurrent.futures

        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ninfer-encode")
        with self.eng._cv:
            self.in_flight += 1
        fut = self._pool.submit(self._execute, item, job)
        fut.add_done_callback(self._done)
        return fut

    def _execute(self, item: Any, job: Any) -> tuple:
        """One job on the encoder thread: on its own CUDA stream, finished before it reports."""
        import torch

        dev = torch.device(getattr(self.eng.runner, "device", "cpu") or "cpu")
        if dev.type != "cuda":
            return item, job, *self._timed(job)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=dev)
        self._stream.wait_stream(torch.cuda.default_stream(dev))
        with torch.cuda.stream(self._stream):
            out, seconds = self._timed(job)
        self._stream.synchronize()
        return item, job, out, seconds

    def _done(self, fut: Any) -> None:
        with self.eng._cv:
            self.in_flight -= 1
            self.eng._cv.notify_all()

    def _finish(self, seq: Any, item: Any, job: Any, out: Any, seconds: float) -> Any:
        """Account a finished encode to its lane and the engine (on the worker)."""
        import torch

        if isinstance(out, torch.Tensor) and out.device.type == "cuda":
            out.record_stream(torch.cuda.current_stream(out.device))  # made on the encoder's stream
        if job.stats:  # an overlay window's facts (request_done.vision_overlay)
            seq.vision_windows.append(dict(job.stats))
        eng = self.eng
        with eng._cv:
            c = eng.vision_counters
            c["encodes"] += 1
            c["encoded_tokens"] += item.tokens
            c["encode_seconds"] += seconds
        seq.vision_encodes += 1
        seq.vision_seconds += seconds
        return out
