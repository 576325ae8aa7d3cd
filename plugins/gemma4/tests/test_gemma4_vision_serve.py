"""End-to-end: images on a converted random Gemma 4 vision-language artifact (31B structure:
K=V global layers, a vision tower with standardization, media rows bidirectional in the sliding
layers), `ninfer serve --vision` on loopback and the real openai and anthropic clients.

Token counts follow the preprocessing's arithmetic: an image is resized, aspect kept, to whole
48-pixel cells inside its budget of soft tokens x 9 patches and takes ph * pw / 9 soft tokens
between <|image> and <image|> (the template's one <|image|> grows by tokens + 1).
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from gemma4_test_support import plugin_flags

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(600)


def _png(w: int, h: int, seed: int = 0) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _tokens(w: int, h: int, budget: int) -> int:
    from ninfer_gemma4.media import aspect_size

    ph, pw = (s // 16 for s in aspect_size(h, w, 16, budget * 9, 3))
    return ph * pw // 9


IMG = _png(300, 200)  # auto (280): 624 x 960 pixels, 39 x 60 patches, 260 soft tokens
BIG = _png(1024, 1024, 1)  # low 64, auto 256, high 1089 soft tokens


@pytest.fixture(scope="module")
def vl_artifact(tmp_path_factory):
    from ninfer_gemma4.testing import build_tiny_artifact, shrunk_vision_config

    return build_tiny_artifact(tmp_path_factory.mktemp("g4vl") / "g4vl.ninfer", kind="31b", seed=7,
                               vision=shrunk_vision_config(), bidirectional_vision=True)


@pytest.fixture(scope="module")
def server(vl_artifact, launch, tmp_path_factory):
    s = launch(vl_artifact, *plugin_flags(), "--vision", "--max-context", "4096", "--prefill-chunk", "64",
               log_dir=tmp_path_factory.mktemp("g4vl-logs"))
    yield s
    s.stop()


def _client(server):
    return openai.OpenAI(base_url=server.api_base, api_key="x", max_retries=0, timeout=300)


def _chat(c, content, max_tokens=5, history=()):
    r = c.chat.completions.with_raw_response.create(
        model="", messages=[*history, {"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    return r.parse(), r.http_response.json()


def _image_part(url, detail=None):
    part = {"type": "image_url", "image_url": {"url": url}}
    if detail is not None:
        part["image_url"]["detail"] = detail
    return part


def _base(c) -> int:
    got, _ = _chat(c, [{"type": "text", "text": "Describe it."}], max_tokens=0)
    return got.usage.prompt_tokens


def test_image_data_uri_takes_its_soft_tokens(server):
    assert _tokens(300, 200, 280) == 260
    with _client(server) as c:
        base = _base(c)
        got, raw = _chat(c, [{"type": "text", "text": "Describe it."}, _image_part(_uri(IMG))])
        assert got.usage.prompt_tokens == base + 260 + 2
        assert raw["timings"]["media_n"] == 1 and raw["timings"]["vision_encodes"] == 1
        assert got.choices[0].finish_reason in ("length", "stop")
        prompt = httpx.post(server.base_url + "/apply-template", timeout=60, json={"messages": [
            {"role": "user", "content": [{"type": "text", "text": "Describe it."}, _image_part(_uri(IMG))]}],
            "chat_template_kwargs": {"enable_thinking": False}}).json()["prompt"]
        # the placeholder grown into <|image> + soft tokens (media ids: no text) + <image|>
        assert "Describe it.<|image><image|><turn|>" in prompt


def test_detail_maps_to_gemma_budgets(server):
    with _client(server) as c:
        base = _base(c)
        counts = {}
        for detail in ("low", "auto", "high"):
            got, _ = _chat(c, [{"type": "text", "text": "Describe it."}, _image_part(_uri(BIG), detail)],
                           max_tokens=0)
            counts[detail] = got.usage.prompt_tokens - base - 2
        assert counts == {"low": 64, "auto": 256, "high": 1089}
        assert counts == {d: _tokens(1024, 1024, b) for d, b in (("low", 70), ("auto", 280), ("high", 1120))}


def test_second_turn_reuses_the_prefix_and_encodes_nothing(server):
    with _client(server) as c:
        content = [{"type": "text", "text": "What is in the picture?"}, _image_part(_uri(_png(200, 150, 5)))]
        n = _tokens(200, 150, 280)
        one, raw_one = _chat(c, content, max_tokens=4)
        assert raw_one["timings"]["vision_encodes"] == 1
        history = [{"role": "user", "content": content},
                   {"role": "assistant", "content": one.choices[0].message.content or "x"}]
        two, raw_two = _chat(c, "And its colours?", history=history)
        assert raw_two["timings"]["media_n"] == 1 and raw_two["timings"]["vision_encodes"] == 0
        assert two.usage.prompt_tokens_details.cached_tokens > n + 2
        # another image of the same size is another prompt: encoded, no reuse past it
        other = [{"type": "text", "text": "What is in the picture?"}, _image_part(_uri(_png(200, 150, 6)))]
        three, raw_three = _chat(c, "And its colours?", history=[{"role": "user", "content": other}, history[1]])
        assert raw_three["timings"]["vision_encodes"] == 1
        assert three.usage.prompt_tokens == two.usage.prompt_tokens
        assert three.usage.prompt_tokens_details.cached_tokens < one.usage.prompt_tokens - n


def test_anthropic_image_block_counts(server):
    anthropic = pytest.importorskip("anthropic")
    with anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=300) as c:
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": base64.b64encode(IMG).decode()}}
        counted = c.messages.count_tokens(model="x", messages=[{"role": "user", "content": [
            block, {"type": "text", "text": "Describe it."}]}])
        text = c.messages.count_tokens(model="x", messages=[{"role": "user", "content": "Describe it."}])
        assert counted.input_tokens - text.input_tokens == 260 + 2


def test_bad_media_keeps_its_code_and_the_server_serves(server):
    r = httpx.post(server.api_base + "/chat/completions", timeout=60, json={"model": "", "max_tokens": 1, "messages": [
        {"role": "user", "content": [_image_part("data:image/png;base64,@@@")]}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_media"
    assert r.json()["error"]["param"] == "messages[0].content[0].image_url.url"
    with _client(server) as c:
        got, _ = _chat(c, [_image_part(_uri(IMG))], max_tokens=1)
        assert got.usage.prompt_tokens > 260


@pytest.mark.parametrize("flags", [("--vision", "--vision-residency", "overlay"), ("--vision-cpu",)],
                         ids=["overlay", "cpu"])
def test_other_residencies_give_the_same_completion(server, vl_artifact, launch, tmp_path, flags):
    other = launch(vl_artifact, *plugin_flags(), *flags, "--max-context", "4096", "--prefill-chunk", "64",
                   "--request-log-jsonl", str(tmp_path / "requests.jsonl"), log_dir=tmp_path)
    try:
        content = [{"type": "text", "text": "Describe it."}, _image_part(_uri(_png(160, 120, 9)), "low")]
        with _client(server) as a, _client(other) as b:
            one, _ = _chat(a, content, max_tokens=6)
            two, raw = _chat(b, content, max_tokens=6)
        assert raw["timings"]["vision_encodes"] == 1
        assert two.usage.prompt_tokens == one.usage.prompt_tokens
        assert two.choices[0].message.content == one.choices[0].message.content
        import json

        records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
        done = [r for r in records if r["event"] == "request_done"][-1]
        start = next(r for r in records if r["event"] == "server_start")
        if "overlay" in flags:  # one window, funded from free KV pages
            assert done["vision_overlay"]["windows"] == 1 and done["vision_overlay"]["concurrent_windows"] == 1
            assert done["vision_overlay"]["window_bytes"] >= start["vision"]["window_bytes"]
            assert start["vision"]["residency"] == "overlay" and start["vision"]["device_bytes"] == 0
        else:
            assert "vision_overlay" not in done and start["vision"]["residency"] == "cpu"
    finally:
        other.stop()


def _mp4(frames: int = 8, size: int = 64, fps: int = 4) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        rng = np.random.default_rng(1)
        for _ in range(frames):
            img = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def test_short_video(server):
    pytest.importorskip("av")
    with _client(server) as c:
        base = _base(c)
        uri = "data:video/mp4;base64," + base64.b64encode(_mp4()).decode()
        got, raw = _chat(c, [{"type": "text", "text": "Describe it."}, {"type": "video_url", "video_url": {"url": uri}}])
        # 8 frames at 4 fps sampled at 2 fps: 4 frames of 64 x 64 pixels, each at the frame budget of
        # 70 (384 x 384 pixels, 64 soft tokens) with its markers and its "mm:ss" text
        assert raw["timings"]["media_n"] == 1 and raw["timings"]["vision_encodes"] == 1
        assert got.usage.prompt_tokens - base >= 4 * (64 + 2) - 1
        assert got.choices[0].finish_reason in ("length", "stop")
