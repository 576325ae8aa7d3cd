"""The overlay window's fallback to the evicted tail of the text weights, and media encodes that
run beside other lanes' decode (spec "Vision residency").

The fallback tests drive a real converted random Qwen3.5 vision-language artifact on the CPU with a
KV pool too small to hold one window, so every encode borrows lm_head and the token embedding:
the completions equal the resident tower's, the text model answers the same before and after,
and every borrowed byte and KV page is back. The side-encode tests use the toy runner with an
encoder that blocks until the decode of another lane has advanced (a counter, never a clock).
"""

from __future__ import annotations

import base64
import io
import threading
from typing import ClassVar

import numpy as np
import pytest
import torch

from ninfer_core.config import EngineOptions
from ninfer_core.engine.api import GenerationRequest, SamplingParams
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.media_side import overlay_log_text, vision_overlay_report
from ninfer_core.media.api import IMAGE, EncodeJob, Expansion, MediaProcessor, MediaRef, MediaSpan
from ninfer_core.media.options import MediaOptions
from ninfer_core.media.prompt import MediaService
from ninfer_core.media.tail import WeightTail
from ninfer_core.testing import ToyRunner, ToyTokenizer, collect, run_async

GUARD_S = 60.0  # a hang guard on waits that the behaviour under test satisfies; never a timing check


def _png(w: int, h: int, seed: int = 0) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _uri(w=96, h=64, seed=0) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(w, h, seed)).decode()


# -- the weight tail --------------------------------------------------------------------------------
def test_weight_tail_borrows_whole_storages_in_rank_order_and_restores_every_byte():
    head = torch.randn(64, 16)
    embed = torch.randn(32, 16)
    tied = head.view(16, 64)  # a second view over the head's storage: one region, not two
    tail = WeightTail(lambda: (head, tied, embed))
    regions = tail.regions()
    assert [int(r.numel()) for r in regions] == [64 * 16 * 4, 32 * 16 * 4]
    want_head, want_embed = head.clone(), embed.clone()
    assert tail.borrow([64 * 16 * 4, 100]) is not None  # more than the head: the embedding joins
    window = tail.open
    assert [r.data_ptr() for r in window.regions] == [head.data_ptr(), embed.data_ptr()]
    with pytest.raises(RuntimeError, match="already open"):
        tail.borrow([16])
    for r in window.regions:  # the encode overwrites the borrowed weights
        r.fill_(0x5A)
    assert not torch.equal(head, want_head)
    tail.give_back(window)
    assert torch.equal(head, want_head) and torch.equal(embed, want_embed) and tail.open is None
    assert tail.last["evict_bytes"] == (64 + 32) * 16 * 4
    small = tail.borrow([100])  # the head alone covers it; the mirror taken before is reused
    assert len(small.regions) == 1 and tail.mirrors[0][1] is not None
    small.regions[0].zero_()
    tail.give_back(small)
    assert torch.equal(head, want_head)
    assert tail.borrow([(64 + 32) * 16 * 4 + 256]) is None  # the whole tail cannot hold it


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    testing = pytest.importorskip("ninfer_qwen35.vl_testing")
    from ninfer_qwen35.family import Qwen35Family

    from ninfer_core.artifact import Artifact

    # hidden 128: lm_head and the embedding (untied) hold a window; 8 KV pages do not
    art = Artifact.open(testing.build_vl_artifact(tmp_path_factory.mktemp("tail") / "vl.ninfer", seed=5,
                                                  hidden=128))
    return art, Qwen35Family()


def _engine(art, fam, residency: str, kv_capacity: int):
    from ninfer_core.media.residency import OverlayResidency, ResidentResidency
    from ninfer_core.tokenizer import Tokenizer

    runner = fam.load(art)
    cls = OverlayResidency if residency == "overlay" else ResidentResidency
    vision = cls.load(fam, art, runner, None)
    eng = Engine(runner, Tokenizer.from_section(art.tokenizer_section),
                 EngineOptions(max_context=512, kv_capacity=kv_capacity, prefill_chunk=64, prefix_reuse=False),
                 vision=vision)
    svc = MediaService(fam.media_processor(art), MediaOptions(vision=True), vocab_size=runner.info.vocab_size,
                       source_limit_bytes=1 << 20)
    return eng, svc, runner, vision


def _requests(fam, art, svc):
    proc = fam.media_processor(art)
    ids = [1, 2, proc.vision_start, proc.placeholder_ids[IMAGE], proc.vision_end, 3, 4]
    prompt, media = svc.expand_prompt(ids, [MediaRef(IMAGE, _uri())])
    greedy = SamplingParams(temperature=0.0)
    image = GenerationRequest(prompt_ids=prompt, sampling=greedy, max_tokens=8, media=media, ignore_eos=True)
    text = GenerationRequest(prompt_ids=[5, 6, 7, 8, 9, 10], sampling=greedy, max_tokens=8, ignore_eos=True)
    return image, text


def _serve(eng, *reqs):
    async def go():
        return [await collect(eng.submit(r)) for r in reqs]

    return run_async(go(), GUARD_S)


def test_overlay_streams_through_the_evicted_weight_tail_when_free_pages_cannot_cover(vl):
    art, fam = vl
    eng, svc, _, _ = _engine(art, fam, "resident", 4096)
    eng.start()
    try:
        want_image, want_text = _serve(eng, *_requests(fam, art, svc))
    finally:
        eng.shutdown()
        svc.shutdown()

    eng, svc, runner, overlay = _engine(art, fam, "overlay", 512)  # 8 pages: less than one window
    assert overlay.lender.pages_for(overlay.window_sizes()) is None
    weights = [t.clone() for t in runner.evictable_weights()]
    assert overlay.tail.capacity() >= sum(overlay.window_sizes())
    eng.start()
    try:
        image, text = _requests(fam, art, svc)
        before, got, after = _serve(eng, text, image, text)
        assert overlay.windows == {"kv": 0, "tail": 1, "allocator": 0}
        # the same kernels on the same bytes as the resident tower: the same completion
        assert got.token_ids == want_image.token_ids and got.finish.timings["vision_encodes"] == 1
        # the text model after the restore answers exactly as before it and as the resident server
        assert before.token_ids == after.token_ids == want_text.token_ids
        assert all(torch.equal(a, b) for a, b in zip(runner.evictable_weights(), weights))
        assert overlay.tail.open is None and eng.scheduler.pages.num_free == eng.pool_pages
        report = got.finish.context["vision_overlay"]
        assert report["windows"] == report["exclusive_windows"] == 1 and report["concurrent_windows"] == 0
        assert report["evict_bytes"] >= sum(overlay.window_sizes()) and report["staged_bytes"] > 0
        assert overlay.describe()["exclusive_windows"] == 1
    finally:
        eng.shutdown()
        svc.shutdown()


def test_overlay_log_text_names_the_windows_and_their_mode():
    conc = {"window": "kv", "ms": 12.0, "window_bytes": 10, "staged_bytes": 3 << 20}
    excl = {"window": "tail", "ms": 30.0, "window_bytes": 10, "staged_bytes": 1 << 20, "evict_bytes": 5 << 20,
            "evict_ms": 4.0, "restore_ms": 2.0}
    assert overlay_log_text(vision_overlay_report([conc, conc])) == \
        " overlay=2xconc 24 ms (evict 0.0 MiB 0 ms, restore 0 ms, staged 6.0 MiB)"
    assert overlay_log_text(vision_overlay_report([excl])) == \
        " overlay=1xexcl 30 ms (evict 5.0 MiB 4 ms, restore 2 ms, staged 1.0 MiB)"
    assert "overlay=2xmixed 42 ms" in overlay_log_text(vision_overlay_report([conc, excl]))
    assert overlay_log_text(None) == ""


# -- encodes beside decode ---------------------------------------------------------------------------
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


class _Counting(ToyRunner):
    """Counts decode forwards under a condition the encoder can wait on."""

    def __init__(self):
        super().__init__()
        self.decodes = 0
        self.cond = threading.Condition()

    def forward(self, batch):
        out = super().forward(batch)
        if any(s.kind == "decode" for s in batch.segments):
            with self.cond:
                self.decodes += 1
                self.cond.notify_all()
        return out


class _SlowEncoder:
    """An encode that runs until the other lane's decode has advanced `rounds` rounds (it never
    ends on its own if the worker is blocked in it: the hang guard then records that)."""

    name, max_item_tokens = "resident", 6

    def __init__(self, runner, rounds=5, exclusive=False):
        self.runner, self.rounds, self.exclusive = runner, rounds, exclusive
        self.started = threading.Event()
        self.rounds_seen: int | None = None

    def open(self, item):
        def run():
            self.started.set()
            r = self.runner
            with r.cond:
                n0 = r.decodes
                if not self.exclusive:
                    r.cond.wait_for(lambda: r.decodes >= n0 + self.rounds, GUARD_S)
                self.rounds_seen = r.decodes - n0
            return torch.zeros(item.tokens, 8)

        return EncodeJob(run, exclusive=self.exclusive)

    def encode(self, item):
        return self.open(item).run()

    def describe(self):
        return {"residency": self.name}


def _side_engine(exclusive: bool):
    runner = _Counting()
    enc = _SlowEncoder(runner, exclusive=exclusive)
    eng = Engine(runner, ToyTokenizer(), EngineOptions(max_context=8192, kv_capacity=8192, prefill_chunk=8,
                                                       prefix_reuse=False, max_concurrency=2), vision=enc)
    svc = MediaService(_Proc(), MediaOptions(vision=True), vocab_size=runner.info.vocab_size,
                       source_limit_bytes=1 << 20)
    return eng, svc, runner, enc


def _side_run(eng, svc, runner):
    ids, media = svc.expand_prompt([1, 2, 3, 7, 4, 5], [MediaRef(IMAGE, _uri(8, 8))])
    greedy = SamplingParams(temperature=0.0)
    # the text lane runs until the image is done (then cancelled): it cannot end before the encode
    long_text = GenerationRequest(prompt_ids=[10, 11, 12], sampling=greedy, max_tokens=8000, ignore_eos=True)
    image = GenerationRequest(prompt_ids=ids, sampling=greedy, max_tokens=4, ignore_eos=True, media=media)

    async def go():
        import asyncio

        first = asyncio.Event()
        handle = eng.submit(long_text)
        text = asyncio.ensure_future(collect(handle, lambda e: first.set() if e.kind == "delta" else None))
        await first.wait()  # the text lane decodes before the image arrives
        img = await collect(eng.submit(image))
        handle.cancel()
        return await text, img

    return run_async(go(), GUARD_S * 2)


def test_an_encode_runs_beside_the_decode_of_other_lanes():
    eng, svc, runner, enc = _side_engine(exclusive=False)
    eng.start()
    try:
        text, img = _side_run(eng, svc, runner)
        # the encode ended only once the other lane had decoded five rounds while it ran
        assert enc.started.is_set() and enc.rounds_seen is not None and enc.rounds_seen >= 5
        assert len(text.token_ids) >= 5 and len(img.token_ids) == 4
        assert img.finish.timings["vision_encodes"] == 1 and eng.media_encodes.in_flight == 0
        assert eng.media_encodes.yields >= 1  # the image lane yielded its prefill units meanwhile
    finally:
        eng.shutdown()
        svc.shutdown()


def test_an_exclusive_encode_runs_alone_on_the_worker():
    eng, svc, runner, enc = _side_engine(exclusive=True)
    eng.start()
    try:
        text, img = _side_run(eng, svc, runner)
        assert enc.started.is_set() and enc.rounds_seen == 0  # no decode round while its window was open
        assert len(text.token_ids) >= 1 and len(img.token_ids) == 4
        assert eng.media_encodes.yields == 0
    finally:
        eng.shutdown()
        svc.shutdown()


def test_a_failed_side_encode_fails_only_its_request():
    runner = _Counting()

    class Broken(_SlowEncoder):
        def open(self, item):
            def run():
                raise RuntimeError("tower exploded")

            return EncodeJob(run)

    eng = Engine(runner, ToyTokenizer(), EngineOptions(max_context=256, prefill_chunk=8, prefix_reuse=False),
                 vision=Broken(runner))
    svc = MediaService(_Proc(), MediaOptions(vision=True), vocab_size=runner.info.vocab_size,
                       source_limit_bytes=1 << 20)
    eng.start()
    try:
        ids, media = svc.expand_prompt([1, 7, 2], [MediaRef(IMAGE, _uri(8, 8))])
        greedy = SamplingParams(temperature=0.0)
        bad, good = _serve(eng, GenerationRequest(prompt_ids=ids, sampling=greedy, max_tokens=2, media=media),
                           GenerationRequest(prompt_ids=[3, 4], sampling=greedy, max_tokens=2, ignore_eos=True))
        assert bad.error is not None and bad.error.status == 500 and "tower exploded" in bad.error.message
        assert len(good.token_ids) == 2
    finally:
        eng.shutdown()
        svc.shutdown()
