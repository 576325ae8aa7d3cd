"""Media acquisition, the prepared-payload cache, identity ids and the engine's side inputs (no model)."""

from __future__ import annotations

import argparse
import base64
import io
import threading
import time
from typing import ClassVar

import pytest
import torch

from ninfer_core.engine.api import EngineError
from ninfer_core.engine.media_side import segment_side
from ninfer_core.engine.model_api import PREFILL, ForwardBatch, LaneSegment, SideInputs, check_batch
from ninfer_core.media.api import (
    IMAGE,
    Expansion,
    MediaProcessor,
    MediaPrompt,
    MediaRef,
    MediaSpan,
    PreparedMedia,
)
from ninfer_core.media.cache import MediaCache
from ninfer_core.media.decode import decode_image
from ninfer_core.media.options import MediaOptions, add_media_arguments, media_options_from_args
from ninfer_core.media.prompt import MediaService, identity_ids, strip_media
from ninfer_core.media.sources import acquire, decode_data_uri


def _png(w=8, h=8) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 200, 30)).save(buf, "PNG")
    return buf.getvalue()


def _code(fn) -> str:
    with pytest.raises(EngineError) as e:
        fn()
    return e.value.status, e.value.code, e.value.param


def test_data_uris():
    data = _png()
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    assert decode_data_uri(uri, 1 << 20, "p") == (data, "image/png")
    assert decode_data_uri("data:,a%20b", 100, "p") == (b"a b", None)
    assert _code(lambda: decode_data_uri("data:image/png;base64,@@@", 1 << 20, "p")) == (400, "invalid_media", "p")
    assert _code(lambda: decode_data_uri("data:image/png;base64,", 1 << 20, "p"))[1] == "invalid_media"
    assert _code(lambda: decode_data_uri(uri, 16, "p")) == (400, "media_budget_exceeded", "p")
    assert _code(lambda: acquire("ftp://host/x.png", 100, 1.0, "q")) == (400, "invalid_media", "q")
    assert _code(lambda: acquire("", 100, 1.0, "q"))[1] == "invalid_media"


def test_decode_refuses_what_is_not_an_image():
    assert decode_image(_png(5, 3), "image/png", "p").size == (5, 3)
    assert _code(lambda: decode_image(b"GIF89a broken", "image/gif", "p"))[1] == "invalid_media"
    assert _code(lambda: decode_image(_png(), "text/html", "p"))[1] == "invalid_media"


def _item(digest: str, nbytes: int) -> PreparedMedia:
    return PreparedMedia(IMAGE, digest, torch.zeros(nbytes, dtype=torch.uint8), (1, 2, 2), 1)


def test_cache_single_flight_and_lru():
    cache = MediaCache(capacity_bytes=250)
    calls = []
    gate = threading.Event()

    def build():
        calls.append(1)
        gate.wait(5)
        return _item("a", 100)

    got = []
    threads = [threading.Thread(target=lambda: got.append(cache.get_or_build("a", build))) for _ in range(3)]
    for t in threads:
        t.start()
    while not calls:
        time.sleep(0.001)
    gate.set()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({id(item) for item, _ in got}) == 1
    assert sorted(how for _, how in got) == ["miss", "single_flight", "single_flight"]
    assert cache.get_or_build("a", build)[1] == "hit"
    cache.get_or_build("b", lambda: _item("b", 100))
    cache.get_or_build("a", build)  # a is the most recent now
    cache.get_or_build("c", lambda: _item("c", 100))  # over 250 bytes: b goes first
    snap = cache.snapshot()
    assert snap["items"] == 2 and snap["bytes"] == 200 and snap["evictions"] == 1
    assert cache.get_or_build("b", lambda: _item("b", 100))[1] == "miss"


def test_cache_failures_are_shared_and_not_kept():
    cache = MediaCache(capacity_bytes=0)

    def bad():
        raise EngineError(400, "invalid_media", "no")

    with pytest.raises(EngineError):
        cache.get_or_build("x", bad)
    _, how = cache.get_or_build("x", lambda: _item("x", 10))
    assert how == "miss" and cache.snapshot()["items"] == 0  # capacity 0 retains nothing


def test_identity_ids_are_past_the_vocabulary_and_per_digest():
    a = identity_ids("ab" * 32, 50, 1000)
    b = identity_ids("cd" * 32, 50, 1000)
    assert min(a + b) >= 1000 and len(set(a)) == 50 and not set(a) & set(b)
    assert identity_ids("ab" * 32, 50, 1000, offset=50)[0] == a[-1] + 1


def test_segment_side_slices_positions_and_embeddings():
    item = _item("a" * 64, 4)
    item.tokens = 6
    emb = torch.arange(6 * 2, dtype=torch.float32).view(6, 2)
    spans = [MediaSpan(2, 3, item, 0), MediaSpan(7, 3, item, 3)]
    positions = torch.arange(12).view(1, -1).repeat(3, 1)
    media = MediaPrompt(spans, positions, position_delta=-4)
    side = segment_side(media, 1, 8, lambda it: emb)
    assert side.positions.shape == (3, 8)
    assert [(row, e.tolist()) for row, e in side.embeddings] == [(1, emb[0:3].tolist()), (6, emb[3:5].tolist())]
    tail = segment_side(media, 11, 3, None)  # past the prompt: index + delta on every axis
    assert tail.positions.tolist() == [[11, 8, 9]] * 3 and tail.embeddings == []
    part = side.slice(5, 8)
    assert part.positions.shape == (3, 3) and [(r, e.shape[0]) for r, e in part.embeddings] == [(1, 2)]


def test_check_batch_takes_identity_ids_only_under_embeddings():
    seg = LaneSegment(0, {"g": [0]}, 0, [1, 5000, 2], PREFILL)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        check_batch(ForwardBatch([seg]), 100, 1, 4, ["g"])
    seg.side = SideInputs(embeddings=[(1, torch.zeros(1, 4))])
    check_batch(ForwardBatch([seg]), 100, 1, 4, ["g"])


class _Processor(MediaProcessor):
    placeholder_ids: ClassVar[dict] = {IMAGE: 7}

    def prepare_image(self, image, max_merged):
        return torch.zeros(4, 3), (1, 2, 2), min(3, max_merged)

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


def test_service_expands_and_counts_cache_outcomes():
    svc = MediaService(_Processor(), MediaOptions(vision=True), vocab_size=100, source_limit_bytes=1 << 20)
    uri = "data:image/png;base64," + base64.b64encode(_png()).decode()
    msgs, refs = strip_media([{"role": "user", "content": [
        {"type": "image", "media": MediaRef(IMAGE, uri)}, {"type": "text", "text": "hi"}]}])
    assert msgs[0]["content"][0] == {"type": "image"} and len(refs) == 1
    ids, prompt = svc.expand_prompt([1, 7, 2], refs)
    assert len(ids) == 5 and ids[0] == 1 and ids[-1] == 2 and min(ids[1:4]) >= 100
    assert prompt.report.cache == {"hit": 0, "miss": 1, "single_flight": 0}
    again, prompt2 = svc.expand_prompt([1, 7, 2], refs)
    assert again == ids and prompt2.report.cache["hit"] == 1
    low = MediaRef(IMAGE, uri, "low")
    assert svc.expand_prompt([1, 7, 2], [low])[0] != ids  # the same bytes at low detail: another item
    with pytest.raises(EngineError) as e:
        svc.expand_prompt([1, 2], refs)  # the template wrote no placeholder for the part
    assert e.value.code == "invalid_prompt"
    svc.shutdown()


def test_options():
    p = argparse.ArgumentParser()
    add_media_arguments(p)
    o = media_options_from_args(p.parse_args(["--vision-cpu"]))
    assert o.vision and o.residency == "cpu" and o.merged_bound() == 256
    o = media_options_from_args(p.parse_args(["--vision", "--vision-max-merged", "512"]))
    assert o.residency == "resident" and o.merged_bound() == 512
    with pytest.raises(ValueError, match="requires --vision"):
        media_options_from_args(p.parse_args(["--vision-residency", "cpu"]))
    with pytest.raises(ValueError, match="conflicts"):
        media_options_from_args(p.parse_args(["--vision-cpu", "--vision-residency", "resident"]))


def test_media_budget_options_and_lenient_detail():
    from ninfer_core.media.parts import detail_of

    p = argparse.ArgumentParser()
    add_media_arguments(p)
    o = media_options_from_args(p.parse_args([]))
    assert (o.cache_mib, o.live_mib, o.preprocess_threads, o.lenient_image_detail) == (1024, 2048, 0, False)
    o = media_options_from_args(p.parse_args(["--vision", "--media-cache-mib", "0", "--media-live-mib", "64",
                                              "--media-preprocess-threads", "3", "--lenient-image-detail"]))
    assert (o.cache_mib, o.live_mib, o.preprocess_threads, o.lenient_image_detail) == (0, 64, 3, True)
    for bad in (["--media-live-mib", "0"], ["--media-preprocess-threads", "257"], ["--media-cache-mib", "-1"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    # an unknown detail: refused with its code and param, or read as auto when lenient
    assert [detail_of(v, "p", False) for v in (None, "auto", "low", "high")] == ["auto", "auto", "low", "high"]
    for v in ("ultra", 3, ""):
        with pytest.raises(EngineError) as e:
            detail_of(v, "messages[0].content[1].image_url.detail", False)
        assert (e.value.status, e.value.code, e.value.param) == (
            400, "image_detail_not_supported", "messages[0].content[1].image_url.detail")
        assert detail_of(v, "p", True) == "auto"


def test_live_budget_counts_payloads_until_their_last_reference():
    import gc

    from ninfer_core.media.cache import LiveBudget

    live = LiveBudget(250)
    cache = MediaCache(capacity_bytes=0, live=live)  # nothing retained: requests hold the payloads
    a, _ = cache.get_or_build("a", lambda: _item("a", 100))
    held = cache.get_or_build("b", lambda: _item("b", 100))
    assert live.used == 200 and held[0].nbytes == 100
    with pytest.raises(EngineError) as e:
        cache.get_or_build("c", lambda: _item("c", 100))
    assert e.value.code == "media_budget_exceeded"
    del a
    gc.collect()
    assert live.used == 100
    again = cache.get_or_build("c", lambda: _item("c", 100))
    assert live.used == 200 and again[1] == "miss"
    # retained payloads give their bytes back when a new build needs them (LRU first)
    live2 = LiveBudget(250)
    kept = MediaCache(capacity_bytes=1000, live=live2)
    kept.get_or_build("x", lambda: _item("x", 100))
    kept.get_or_build("y", lambda: _item("y", 100))
    kept.get_or_build("z", lambda: _item("z", 100))
    assert live2.used == 200 and kept.snapshot()["items"] == 2 and kept.get_or_build("y", lambda: None)[1] == "hit"


class _Encoder:
    name = "resident"

    def __init__(self):
        self.encoded = 0

    def encode(self, item):
        self.encoded += 1
        return torch.zeros(item.tokens, 8)

    def describe(self):
        return {"residency": self.name}


def test_engine_encodes_on_first_use_and_releases_payloads():
    """A toy engine: the media lane's prefill (in chunks of 4 across the image) asks for the item's
    rows once, and after the requests end no payload is held past the cache."""
    import gc

    from ninfer_core.config import EngineOptions
    from ninfer_core.engine.api import GenerationRequest, SamplingParams
    from ninfer_core.engine.engine import Engine
    from ninfer_core.testing import ToyRunner, ToyTokenizer, collect, run_async

    runner, vision = ToyRunner(), _Encoder()
    eng = Engine(runner, ToyTokenizer(), EngineOptions(max_context=512, prefill_chunk=4), vision=vision)
    eng.start()
    svc = MediaService(_Processor(), MediaOptions(vision=True, cache_mib=0), vocab_size=runner.info.vocab_size,
                       source_limit_bytes=1 << 20)
    uri = "data:image/png;base64," + base64.b64encode(_png()).decode()
    try:
        async def one(prompt):
            ids, media = svc.expand_prompt(prompt, [MediaRef(IMAGE, uri)])
            req = GenerationRequest(prompt_ids=ids, sampling=SamplingParams(greedy=True, temperature=0.0),
                                    max_tokens=2, media=media)
            out = await collect(eng.submit(req))
            return out.finish

        first = run_async(one([1, 2, 7, 3, 4, 5, 6, 8]))
        assert first.timings["vision_encodes"] == 1 and first.timings["media_n"] == 1 and vision.encoded == 1
        again = run_async(one([1, 2, 7, 3, 4, 5, 6, 8]))  # (reuse over media: tests/e2e/test_e2e_vision.py)
        assert again.usage.prompt_tokens == first.usage.prompt_tokens == 10
        del first, again
        eng.shutdown()  # the worker's last-iteration locals go with its thread
        gc.collect()
        assert svc.live.used == 0  # --media-cache-mib 0: nothing retained once the requests ended
        plain = Engine(ToyRunner(), ToyTokenizer(), EngineOptions(max_context=512))
        with pytest.raises(EngineError) as e:
            run_async(_submit_on(plain, svc, uri))
        assert e.value.code == "vision_disabled"
    finally:
        eng.shutdown()
        svc.shutdown()


async def _submit_on(engine, svc, uri):
    from ninfer_core.engine.api import GenerationRequest

    ids, media = svc.expand_prompt([1, 7, 2], [MediaRef(IMAGE, uri)])
    engine.submit(GenerationRequest(prompt_ids=ids, max_tokens=1, media=media))
