"""The overlay residency's window (spec "Vision residency"): funded from free KV pages, out of
circulation while the loan is open, zeroed and returned after the encode; the allocator only when
free pages cannot cover it. And the engine never ends a prefill chunk inside a media span for a
runner that attends within one.

The tower is a real one: a converted random Qwen3.5 vision-language checkpoint on the CPU, whose
paged KV tensors the window is carved from exactly as on the device.
"""

from __future__ import annotations

import base64
import io
from typing import ClassVar

import numpy as np
import pytest
import torch

from ninfer_core.engine.media_side import whole_spans_end
from ninfer_core.engine.pages import PagePool
from ninfer_core.media.api import IMAGE, Expansion, MediaProcessor, MediaRef, MediaSpan, PreparedMedia
from ninfer_core.media.window import DeviceWindow, fits, nbytes_of


def _png(w: int, h: int, seed: int = 0) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_allocate_run_takes_consecutive_free_pages():
    pool = PagePool(10)
    held = pool.allocate(10)
    pool.free([held[i] for i in (1, 2, 4, 5, 6, 8)])
    assert pool.allocate_run(4) is None  # the free runs are 1-2, 4-6 and 8
    run = pool.allocate_run(3)
    assert run == [4, 5, 6] and pool.num_free == 3 and all(pool.refcount(p) == 1 for p in run)
    assert pool.allocate_run(2) == [1, 2] and pool.allocate_run(1) == [8] and pool.num_free == 0
    pool.free(run)
    assert sorted(pool.allocate(3)) == [4, 5, 6]


def test_window_placement_is_first_fit_by_size():
    assert fits([256, 768, 512], [768, 768])  # the largest first: 768 | 512 + 256
    assert not fits([512, 512, 512], [768, 768])
    assert fits([100, 100, 100], [512, 256]) and not fits([100, 100, 100], [512, 200])  # 256-byte slots
    regions = [torch.zeros(4096, dtype=torch.uint8), torch.zeros(2048, dtype=torch.uint8)]
    with torch.device("meta"):
        mod = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    DeviceWindow(regions, "kv").materialize([mod], torch.float32)
    ptrs = {p.data_ptr() for p in mod.parameters()}
    lo = [r.data_ptr() for r in regions]
    hi = [r.data_ptr() + r.numel() for r in regions]
    assert len(ptrs) == 4 and all(any(a <= p < b for a, b in zip(lo, hi)) for p in ptrs)


class _PageRunner:
    """The cache tensors of a paged runner: K and V per layer, page-major."""

    def __init__(self, pages: int, layers: int = 3, row=(64, 2, 16), dtype=torch.bfloat16):
        self.kv = [torch.zeros(pages + 1, *row, dtype=dtype) for _ in range(2 * layers)]  # +1: a scratch page

    def kv_page_tensors(self):
        return tuple(self.kv)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    testing = pytest.importorskip("ninfer_qwen35.vl_testing")
    from ninfer_qwen35.family import Qwen35Family

    from ninfer_core.artifact import Artifact

    art = Artifact.open(testing.build_vl_artifact(tmp_path_factory.mktemp("ovl") / "vl.ninfer", seed=4))
    return art, Qwen35Family()


def _item(art, fam, w=96, h=64):
    from PIL import Image

    proc = fam.media_processor(art)
    pv, grid, tokens = proc.prepare_image(Image.open(io.BytesIO(_png(w, h))).convert("RGB"), 256)
    return PreparedMedia(IMAGE, "d", pv, grid, tokens)


def _overlay(art, fam, runner):
    from ninfer_core.media.residency import OverlayResidency

    return OverlayResidency.load(fam, art, runner, None)


def test_overlay_borrows_free_pages_and_returns_them(vl):
    from ninfer_core.engine.request import Sequence  # noqa: F401  (the scheduler's sequence type)

    art, fam = vl
    resident = fam.vision_tower(art, "cpu", torch.float32)
    item = _item(art, fam)
    want = resident.encode(item)
    cpu = type("R", (), {"device": torch.device("cpu"), "dtype": torch.float32})()
    overlay = _overlay(art, fam, cpu)
    sizes = overlay.window_sizes()
    pool_pages = 64
    runner = _PageRunner(pool_pages)
    pool = PagePool(pool_pages)
    held = pool.allocate(8)  # a lane holds the first pages
    overlay.attach(pool, runner)
    need = overlay.lender.pages_for(sizes)
    assert need is not None and need < pool_pages - 8
    seen = {}
    real = overlay.tower.encode_streamed

    def watched(it, device, window):  # the loan while the encode runs
        seen.update(kind=window.kind, pages=list(window.pages), free=pool.num_free,
                    lent_free=[p for p in window.pages if p in pool._free],
                    admissible=pool.can_allocate(pool_pages - 8 - need + 1))
        return real(it, device, window)

    overlay.tower.encode_streamed = watched
    got = overlay.encode(item)
    assert torch.equal(got, want)  # the same kernels on the same bytes as the resident tower
    assert seen["kind"] == "kv" and len(seen["pages"]) == need and seen["lent_free"] == []
    # while the loan is open the pool has that many fewer pages: a request needing them waits
    assert seen["free"] == pool_pages - 8 - need and seen["admissible"] is False
    # afterwards every lent page is back in the pool and reads as zeros (nothing leaked)
    assert pool.num_free == pool_pages - 8 and overlay.lender.open_pages == 0
    assert pool.can_allocate(pool_pages - 8)
    for t in runner.kv:
        assert not t[seen["pages"][0]: seen["pages"][-1] + 1].any()
    assert overlay.describe()["kv_windows"] == 1 and overlay.describe()["allocator_windows"] == 0
    pool.free(held)


def test_overlay_falls_back_to_the_allocator_when_free_pages_cannot_cover(vl):
    art, fam = vl
    item = _item(art, fam)
    cpu = type("R", (), {"device": torch.device("cpu"), "dtype": torch.float32})()
    overlay = _overlay(art, fam, cpu)
    runner, pool = _PageRunner(64), PagePool(64)
    overlay.attach(pool, runner)
    need = overlay.lender.pages_for(overlay.window_sizes())
    held = pool.allocate(64)
    pool.free(held[::2])  # half the pages free, none consecutive: no run covers the window
    before = pool.num_free
    want = fam.vision_tower(art, "cpu", torch.float32).encode(item)
    assert torch.equal(overlay.encode(item), want)
    assert overlay.windows == {"kv": 0, "tail": 0, "allocator": 1} and pool.num_free == before
    assert need > 1
    # a KV cache smaller than one window always uses the fallback
    small = _overlay(art, fam, cpu)
    small.attach(PagePool(2), _PageRunner(2))
    assert small.lender.pages_for(small.window_sizes()) is None
    small.encode(item)
    assert small.windows == {"kv": 0, "tail": 0, "allocator": 1}


def test_window_sizes_are_the_front_and_two_blocks(vl):
    art, fam = vl
    tower = fam.vision_tower(art, "cpu", torch.float32)
    mods = tower.window_tensors()
    assert len(mods) == 3 and sum(nbytes_of(mods, torch.float32)) == tower.window_bytes()
    block = sum(p.numel() * 4 for p in tower.model.blocks[0].parameters())
    whole = sum(p.numel() * 4 for p in tower.model.parameters())
    assert tower.window_bytes() == whole - (len(tower.model.blocks) - 2) * block


def test_engine_lends_free_pages_to_the_overlay_and_gets_them_back(vl):
    """A served request through the engine: the encode borrowed a run of the engine's free pages,
    and once the request ended every page is free again (no prefix reuse holds any)."""
    from ninfer_core.config import EngineOptions
    from ninfer_core.engine.api import GenerationRequest, SamplingParams
    from ninfer_core.engine.engine import Engine
    from ninfer_core.media.options import MediaOptions
    from ninfer_core.media.prompt import MediaService
    from ninfer_core.testing import collect, run_async
    from ninfer_core.tokenizer import Tokenizer

    art, fam = vl
    runner = fam.load(art)
    overlay = _overlay(art, fam, runner)
    tok = Tokenizer.from_section(art.tokenizer_section)
    eng = Engine(runner, tok, EngineOptions(max_context=1024, kv_capacity=4096, prefill_chunk=64,
                                            prefix_reuse=False), vision=overlay)
    svc = MediaService(fam.media_processor(art), MediaOptions(vision=True), vocab_size=runner.info.vocab_size,
                       source_limit_bytes=1 << 20)
    eng.start()
    try:
        proc = fam.media_processor(art)
        ids = [1, 2, proc.vision_start, proc.placeholder_ids[IMAGE], proc.vision_end, 3, 4]
        uri = "data:image/png;base64," + base64.b64encode(_png(96, 64)).decode()
        prompt, media = svc.expand_prompt(ids, [MediaRef(IMAGE, uri)])
        req = GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(temperature=0.0), max_tokens=3,
                                media=media)
        async def go():
            return await collect(eng.submit(req))

        out = run_async(go())
        assert out.finish.timings["vision_encodes"] == 1
        assert overlay.windows["kv"] == 1 and overlay.windows["allocator"] == 0 and overlay.window_pages > 0
        assert eng.scheduler.pages.num_free == eng.pool_pages
        report = out.finish.context["vision_overlay"]  # request_done.vision_overlay
        assert report["windows"] == report["concurrent_windows"] == 1 and report["allocator_windows"] == 0
        assert report["window_bytes"] >= sum(overlay.window_sizes()) and report["staged_bytes"] > 0
    finally:
        eng.shutdown()
        svc.shutdown()


class _Proc(MediaProcessor):
    placeholder_ids: ClassVar[dict] = {IMAGE: 7}

    def prepare_image(self, image, max_merged):
        return torch.zeros(4, 3), (1, 2, 2), 6

    def expand(self, ids, items):
        out, spans, it = [], [], iter(items)
        for t in ids:
            if t == 7:
                item = next(it)
                spans.append(MediaSpan(len(out), item.tokens, item))
                out += [7] * item.tokens
            else:
                out.append(t)
        return Expansion(out, spans)


def test_whole_spans_end():
    item = PreparedMedia(IMAGE, "d", None, (1,), 6)
    media = type("M", (), {"spans": [MediaSpan(3, 6, item), MediaSpan(12, 6, item)]})
    assert whole_spans_end(media, 0, 4) == 3  # the chunk would cut the first item: it ends before it
    assert whole_spans_end(media, 3, 7) == 9  # a chunk starting at the item runs to its end
    assert whole_spans_end(media, 5, 7) == 9  # resumed inside it (a reused prefix): to its end
    assert whole_spans_end(media, 0, 9) == 9 and whole_spans_end(media, 9, 12) == 12
    assert whole_spans_end(media, 9, 14) == 12


def test_engine_never_ends_a_chunk_inside_a_span_of_a_whole_span_runner():
    from ninfer_core.config import EngineOptions
    from ninfer_core.engine.api import GenerationRequest, SamplingParams
    from ninfer_core.engine.engine import Engine
    from ninfer_core.media.options import MediaOptions
    from ninfer_core.media.prompt import MediaService
    from ninfer_core.testing import ToyRunner, ToyTokenizer, collect, run_async

    class WholeSpans(ToyRunner):
        whole_media_spans = True

        def __init__(self):
            super().__init__()
            self.prefills = []

        def configure(self, options):
            self.max_segment = options.max_segment_tokens
            super().configure(options)

        def forward(self, batch):
            for s in batch.segments:
                if s.kind == "prefill":
                    self.prefills.append((s.start, s.start + len(s.tokens)))
            return super().forward(batch)

    class Encoder:
        name, max_item_tokens = "resident", 6

        def encode(self, item):
            return torch.zeros(item.tokens, 8)

        def describe(self):
            return {"residency": self.name}

    runner = WholeSpans()
    eng = Engine(runner, ToyTokenizer(), EngineOptions(max_context=256, prefill_chunk=4, prefix_reuse=False),
                 vision=Encoder())
    assert runner.max_segment == 6  # forwards sized for the largest item
    svc = MediaService(_Proc(), MediaOptions(vision=True), vocab_size=runner.info.vocab_size,
                       source_limit_bytes=1 << 20)
    eng.start()
    try:
        uri = "data:image/png;base64," + base64.b64encode(_png(8, 8)).decode()
        ids, media = svc.expand_prompt([1, 2, 3, 7, 4, 5, 6, 7, 8], [MediaRef(IMAGE, uri), MediaRef(IMAGE, uri)])
        async def go():
            return await collect(eng.submit(GenerationRequest(prompt_ids=ids, sampling=SamplingParams(
                temperature=0.0), max_tokens=1, media=media)))

        run_async(go())
        assert runner.prefills == [(0, 3), (3, 9), (9, 12), (12, 18), (18, 19)]
    finally:
        eng.shutdown()
        svc.shutdown()
