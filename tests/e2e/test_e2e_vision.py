"""End-to-end: images and video on a converted random Qwen3.5 vision-language artifact.

The artifact is transformers' own Qwen3_5ForConditionalGeneration (random weights, small widths)
saved and run through `ninfer convert`; the servers are real (`ninfer serve --vision` on
loopback) and so are the clients (openai, anthropic, httpx), and a local HTTP server hands out the
image URLs. Token counts are checked against the preprocessing's own arithmetic: an image of
h x w pixels resized to multiples of 32 takes (h/32)*(w/32) tokens.
"""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from typing import ClassVar

import anthropic
import httpx
import numpy as np
import openai
import pytest

pytestmark = pytest.mark.timeout(600)


def _png(w: int, h: int, seed: int = 0) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


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


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


IMG = _png(300, 200)  # -> 320 x 224 at the 64-token minimum area: 10 x 7 = 70 tokens
def _gradient(w: int, h: int) -> bytes:
    from PIL import Image

    x = np.linspace(0, 255, w, dtype=np.uint8)[None, :, None].repeat(h, 0).repeat(3, 2)
    buf = io.BytesIO()
    Image.fromarray(x).save(buf, "PNG")
    return buf.getvalue()


BIG = _gradient(1024, 1024)  # high: 32 x 32 = 1024 tokens; low: 512 x 512 = 256 tokens


class _Files(http.server.BaseHTTPRequestHandler):
    files: ClassVar[dict] = {}

    def do_GET(self):
        if self.path == "/slow.png":  # past the server's --media-fetch-timeout-s
            time.sleep(4)
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png" if self.path.endswith(".png") else "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the server gave up on it (too large, too slow)
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def files():
    _Files.files = {"/img.png": IMG, "/huge.png": b"\x89PNG" + bytes(3 << 20), "/slow.png": IMG}
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture(scope="module")
def vl_artifact(tmp_path_factory):
    testing = pytest.importorskip("ninfer_qwen35.vl_testing")
    return testing.build_vl_artifact(str(tmp_path_factory.mktemp("vl") / "vl.ninfer"), seed=3)


@pytest.fixture(scope="module")
def vision(vl_artifact, launch, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vision-logs")
    server = launch(vl_artifact, "--vision", "--vision-max-merged", "1024", "--max-context", "4096",
                    "--max-request-mib", "2", "--media-fetch-timeout-s", "1.5", "--request-log-jsonl", str(logs / "requests.jsonl"), log_dir=logs)
    server.request_log = logs / "requests.jsonl"
    yield server
    server.stop()


def _client(server):
    return openai.OpenAI(base_url=server.api_base, api_key="x", max_retries=0, timeout=300)


def _chat(c, content, max_tokens=6, history=()):
    r = c.chat.completions.with_raw_response.create(
        model="", messages=[*history, {"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
        extra_body={"enable_thinking": False})
    return r.parse(), r.http_response.json()


def _model(server) -> str:
    return httpx.get(server.api_base + "/models", timeout=30).json()["data"][0]["id"]


def _text_tokens(c) -> int:
    """Prompt tokens of the same request with the image part left out."""
    got, _ = _chat(c, [{"type": "text", "text": "Describe it."}], max_tokens=0)
    return got.usage.prompt_tokens


def _image_part(url, detail=None):
    part = {"type": "image_url", "image_url": {"url": url}}
    if detail is not None:
        part["image_url"]["detail"] = detail
    return part


def test_image_data_uri_and_url_give_the_same_prompt_and_answer(vision, files):
    with _client(vision) as c:
        base = _text_tokens(c)
        a, raw_a = _chat(c, [{"type": "text", "text": "Describe it."}, _image_part(data_uri(IMG))])
        # the template's <|vision_start|><|image_pad|><|vision_end|>: one placeholder grown to 70 tokens
        assert a.usage.prompt_tokens == base + 2 + 70
        assert raw_a["timings"]["media_n"] == 1 and raw_a["timings"]["vision_encodes"] == 1
        b, raw_b = _chat(c, [{"type": "text", "text": "Describe it."}, _image_part(files + "/img.png")])
        assert b.usage.prompt_tokens == a.usage.prompt_tokens
        assert b.choices[0].message.content == a.choices[0].message.content
        # the same bytes, and the same prompt: the whole prompt but its frontier comes from the cache
        assert raw_b["timings"]["vision_encodes"] == 0 and b.usage.prompt_tokens_details.cached_tokens > 70


def test_detail_low_and_high_token_counts(vision):
    with _client(vision) as c:
        base = _text_tokens(c)
        counts = {}
        for detail in ("low", "high", "auto"):
            got, _ = _chat(c, [{"type": "text", "text": "Describe it."}, _image_part(data_uri(BIG), detail)],
                           max_tokens=0)
            counts[detail] = got.usage.prompt_tokens - base - 2
        assert counts == {"low": 256, "high": 1024, "auto": 1024}
        # Responses input_tokens counts the same expansion
        r = httpx.post(vision.api_base + "/responses/input_tokens", timeout=300, json={
            "model": _model(vision), "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "Describe it."},
                {"type": "input_image", "image_url": data_uri(BIG), "detail": "low"}]}]})
        assert r.status_code == 200, r.text
        r2 = httpx.post(vision.api_base + "/responses/input_tokens", timeout=300, json={
            "model": _model(vision), "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "Describe it."}]}]})
        assert r.json()["input_tokens"] - r2.json()["input_tokens"] == 2 + 256


def test_second_turn_reuses_the_prefix_and_encodes_nothing(vision):
    with _client(vision) as c:
        content = [{"type": "text", "text": "What is in the picture?"}, _image_part(data_uri(_png(256, 256, 7)))]
        one, raw_one = _chat(c, content, max_tokens=4)
        assert raw_one["timings"]["vision_encodes"] == 1
        history = [{"role": "user", "content": content},
                   {"role": "assistant", "content": one.choices[0].message.content or "x"}]
        two, raw_two = _chat(c, "And its colours?", history=history)
        assert raw_two["timings"]["media_n"] == 1 and raw_two["timings"]["vision_encodes"] == 0
        # the reused prefix (up to the turn closure) covers the image: nothing left to encode
        assert two.usage.prompt_tokens_details.cached_tokens > 64 + 2
        # another image at the same place and size is a different prompt: no reuse past it
        other = [{"type": "text", "text": "What is in the picture?"}, _image_part(data_uri(_png(256, 256, 8)))]
        three, raw_three = _chat(c, "And its colours?", history=[{"role": "user", "content": other},
                                                                  history[1]])
        assert raw_three["timings"]["vision_encodes"] == 1
        assert three.usage.prompt_tokens == two.usage.prompt_tokens
        assert three.usage.prompt_tokens_details.cached_tokens < one.usage.prompt_tokens - 64


def test_short_video(vision):
    with _client(vision) as c:
        base = _text_tokens(c)
        got, raw = _chat(c, [{"type": "text", "text": "Describe it."},
                             {"type": "video_url", "video_url": {"url": data_uri(_mp4(), "video/mp4")}}])
        # 8 frames at 4 fps span 1.75 s: sampled at 2 fps, 4 frames, two pairs at 256 x 256 (the
        # minimum area): 2 x 64 tokens, each pair with its own markers and timestamp text
        extra = got.usage.prompt_tokens - base
        assert raw["timings"]["media_n"] == 1 and raw["timings"]["vision_encodes"] == 1
        assert extra > 2 * 64 + 4
        assert got.choices[0].finish_reason in ("length", "stop")


def test_anthropic_image_blocks_and_token_count(vision):
    with anthropic.Anthropic(base_url=vision.base_url, api_key="x", max_retries=0, timeout=300) as c:
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": base64.b64encode(IMG).decode()}}
        msgs = [{"role": "user", "content": [block, {"type": "text", "text": "Describe it."}]}]
        counted = c.messages.count_tokens(model="x", messages=msgs, thinking={"type": "disabled"})
        text_only = c.messages.count_tokens(model="x", messages=[{"role": "user", "content": "Describe it."}],
                                            thinking={"type": "disabled"})
        assert counted.input_tokens - text_only.input_tokens == 2 + 70
        msg = c.messages.create(model="x", messages=msgs, max_tokens=4, thinking={"type": "disabled"})
        assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == counted.input_tokens
        # an image inside a tool result
        tools = [{"name": "look", "description": "take a photo", "input_schema": {"type": "object"}}]
        history = [{"role": "user", "content": "Take a photo."},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                 "content": [block, {"type": "text", "text": "done"}]}]}]
        with_image = c.messages.count_tokens(model="x", messages=history, tools=tools)
        history[2]["content"][0]["content"] = [{"type": "text", "text": "done"}]
        without = c.messages.count_tokens(model="x", messages=history, tools=tools)
        assert with_image.input_tokens - without.input_tokens == 2 + 70


def _post_chat(server, part):
    return httpx.post(server.api_base + "/chat/completions", timeout=120, json={
        "model": "", "max_tokens": 1, "messages": [{"role": "user", "content": [part]}]})


def _assert_error(r, status, code, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err


def test_media_errors_have_their_codes(vision, files):
    p = "messages[0].content[0].image_url.url"
    _assert_error(_post_chat(vision, _image_part("data:image/png;base64,@@not base64@@")), 400, "invalid_media", p)
    _assert_error(_post_chat(vision, _image_part(data_uri(b"plain words", "text/plain"))), 400, "invalid_media", p)
    _assert_error(_post_chat(vision, _image_part(data_uri(b"\x00\x01 not an image", "image/png"))), 400,
                  "invalid_media", p)
    _assert_error(_post_chat(vision, _image_part("file:///etc/hostname")), 400, "invalid_media", p)
    _assert_error(_post_chat(vision, _image_part(files + "/huge.png")), 400, "media_budget_exceeded", p)
    _assert_error(_post_chat(vision, _image_part(files + "/missing.png")), 502, "media_fetch_failed", p)
    _assert_error(_post_chat(vision, _image_part("http://127.0.0.1:9/x.png")), 502, "media_fetch_failed", p)
    _assert_error(_post_chat(vision, _image_part(files + "/slow.png")), 504, "media_fetch_timeout", p)
    _assert_error(_post_chat(vision, _image_part(data_uri(IMG), "ultra")), 400, "image_detail_not_supported",
                  "messages[0].content[0].image_url.detail")
    # Anthropic's envelope for the same failures
    r = httpx.post(vision.base_url + "/v1/messages", timeout=60, json={
        "model": "x", "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "%%%"}}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["code"] == "invalid_media" and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(vision.base_url + "/v1/messages", timeout=60, json={
        "model": "x", "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": "AAAA"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_media"
    r = httpx.post(vision.base_url + "/v1/messages", timeout=60, json={
        "model": "x", "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": files + "/slow.png"}}]}]})
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error", r.text
    assert r.json()["error"]["code"] == "media_fetch_timeout"
    # each is a counted preparation rejection, with its request-log record
    import json

    metrics = httpx.get(vision.base_url + "/metrics", timeout=30).text
    rejected = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("ninfer:requests_rejected_total"))
    assert rejected >= 11
    codes = [r.get("code") for r in map(json.loads, vision.request_log.read_text().splitlines())
             if r["event"] == "request_rejected"]
    for code in ("invalid_media", "media_budget_exceeded", "media_fetch_failed", "media_fetch_timeout",
                 "image_detail_not_supported"):
        assert code in codes, code
    # the server keeps serving
    with _client(vision) as c:
        got, _ = _chat(c, [_image_part(data_uri(IMG))], max_tokens=1)
        assert got.usage.prompt_tokens > 70


def test_without_vision_media_is_refused(vl_artifact, launch, tmp_path):
    server = launch(vl_artifact, log_dir=tmp_path)
    try:
        _assert_error(_post_chat(server, _image_part(data_uri(IMG))), 400, "vision_disabled")
        r = httpx.post(server.base_url + "/v1/messages/count_tokens", timeout=60, json={
            "model": "x", "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(IMG).decode()}}]}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "vision_disabled"
        models = httpx.get(server.api_base + "/models", timeout=30).json()["data"][0]
        assert models["architecture"]["input_modalities"] == ["text"]
    finally:
        server.stop()


@pytest.mark.parametrize("flags", [("--vision-cpu",), ("--vision", "--vision-residency", "overlay")],
                         ids=["cpu", "overlay"])
def test_other_residencies_give_the_same_completion(vision, vl_artifact, launch, tmp_path, flags):
    cpu = launch(vl_artifact, *flags, "--max-context", "4096", log_dir=tmp_path)
    try:
        content = [{"type": "text", "text": "Describe it."}, _image_part(data_uri(_png(128, 96, 5)))]
        with _client(vision) as a, _client(cpu) as b:
            one, _ = _chat(a, content, max_tokens=6)
            two, raw = _chat(b, content, max_tokens=6)
        assert raw["timings"]["vision_encodes"] == 1
        assert two.usage.prompt_tokens == one.usage.prompt_tokens
        assert two.choices[0].message.content == one.choices[0].message.content
        models = httpx.get(cpu.api_base + "/models", timeout=30).json()["data"][0]
        assert "image" in models["architecture"]["input_modalities"]
    finally:
        cpu.stop()


def test_request_log_records_media(vision):
    import json

    with _client(vision) as c:
        _chat(c, [_image_part(data_uri(_png(64, 64, 11)))], max_tokens=1)
        _chat(c, [_image_part(data_uri(_png(64, 64, 11)))], max_tokens=1)
    records = [json.loads(line) for line in vision.request_log.read_text().splitlines() if line.strip()]
    start = next(r for r in records if r["event"] == "server_start")
    assert start["vision"]["residency"] == "resident" and start["vision"]["max_merged_per_item"] == 1024
    media = [r["media"] for r in records if r["event"] == "request_start" and r.get("media")]
    last_two = media[-2:]
    assert [m["cache"] for m in last_two] == [{"hit": 0, "miss": 1, "single_flight": 0},
                                              {"hit": 1, "miss": 0, "single_flight": 0}]
    assert all(m["items"] == 1 and m["tokens"] == 64 and m["source_bytes"] > 0 for m in last_two)
    assert last_two[0]["digests"] == last_two[1]["digests"]
    done = [r for r in records if r["event"] == "request_done"][-1]
    assert done["timings_seconds"]["vision"] == 0.0  # the second one reused the first one's prefix


def test_responses_images_in_messages_tool_results_and_chains(vision, files):
    with _client(vision) as c:
        model = _model(vision)
        first = c.responses.create(model=model, max_output_tokens=4, reasoning={"effort": "none"}, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "What is it?"},
                                         {"type": "input_image", "image_url": files + "/img.png", "detail": "auto"}]}])
        text_only = c.responses.input_tokens.count(model=model, reasoning={"effort": "none"}, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "What is it?"}]}])
        assert first.usage.input_tokens - text_only.input_tokens == 2 + 70
        # a chained turn: the stored URL is fetched again, the prefix (image included) is reused
        second = c.responses.create(model=model, max_output_tokens=4, previous_response_id=first.id,
                                    reasoning={"effort": "none"}, input="And the colours?")
        assert second.usage.input_tokens_details.cached_tokens > 70
        # a function_call_output carrying an image
        call = {"type": "function_call", "call_id": "c1", "name": "photo", "arguments": "{}"}
        out = {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "here"}, {"type": "input_image", "image_url": data_uri(IMG)}]}
        tools = [{"type": "function", "name": "photo", "parameters": {"type": "object", "properties": {}}}]
        with_image = c.responses.input_tokens.count(model=model, tools=tools, input=[
            {"role": "user", "content": "Take a photo."}, call, out])
        out["output"] = [{"type": "input_text", "text": "here"}]
        without = c.responses.input_tokens.count(model=model, tools=tools, input=[
            {"role": "user", "content": "Take a photo."}, call, out])
        assert with_image.input_tokens - without.input_tokens == 2 + 70


def test_chat_tool_result_image_counts(vision):
    with _client(vision) as c:
        tools = [{"type": "function", "function": {"name": "photo", "parameters": {"type": "object"}}}]
        history = [{"role": "user", "content": "Take a photo."},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "t1", "type": "function", "function": {"name": "photo", "arguments": "{}"}}]}]

        def count(content):
            r = c.chat.completions.create(model="", max_tokens=0, tools=tools, messages=[
                *history, {"role": "tool", "tool_call_id": "t1", "content": content}])
            return r.usage.prompt_tokens

        assert count([{"type": "text", "text": "done"}, _image_part(data_uri(IMG))]) - count("done") == 2 + 70
        # media in a system message has no place in the prompt
        r = httpx.post(vision.api_base + "/chat/completions", timeout=60, json={"model": "", "max_tokens": 1,
                       "messages": [{"role": "system", "content": [_image_part(data_uri(IMG))]},
                                    {"role": "user", "content": "hi"}]})
        _assert_error(r, 400, "invalid_value", "messages[0].content[0].type")


def test_vision_startup_refusals(tiny_artifact, launch, tmp_path):
    for flags, why in ((("--vision",), "needs an artifact with a vision tower"),
                       (("--vision", "--vision-residency", "elsewhere"), "unknown vision residency 'elsewhere'")):
        with pytest.raises(RuntimeError) as e:
            launch(tiny_artifact, *flags, log_dir=tmp_path, timeout=120)
        assert why in str(e.value)
