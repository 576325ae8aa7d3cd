"""End-to-end: `ninfer serve --vision --spec dflash|dflash2` on a converted random Qwen3.5
vision-language artifact carrying random drafters (`ninfer convert --dflash/--dflash2`).

The spec's combination: the drafter accelerates the generated text after the multimodal prefill
(vision encode and prefill stay outside speculation), so greedy output with images, a follow-up
turn that reuses the image prefix, and two image requests at once equals the output of the same
server without --spec, token for token (the chat logprobs' tokens), with drafts verified."""

from __future__ import annotations

import base64
import io
import json
import threading

import numpy as np
import pytest

pytest.importorskip("ninfer_qwen35")
pytest.importorskip("ninfer_spec_dflash")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(900)


def _png(w: int, h: int, seed: int) -> str:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image(seed, w=128, h=96):
    return {"type": "image_url", "image_url": {"url": _png(w, h, seed)}}


FIRST = [{"type": "text", "text": "What is in the picture?"}, _image(1)]
REQUESTS = [
    [{"role": "user", "content": FIRST}],
    [{"role": "user", "content": [_image(2, 64, 64), {"type": "text", "text": "And this one?"}]}],
    [{"role": "user", "content": "No picture this time."}],
]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from ninfer_qwen35.vl_testing import build_vl_artifact
    from ninfer_spec_dflash.testing import random_drafter_checkpoint

    from ninfer_core.cli import main as cli

    d = tmp_path_factory.mktemp("dfl-vl")
    base = build_vl_artifact(str(d / "vl.ninfer"), seed=3)
    for kind in ("dflash", "dflash2"):  # the VL text model: hidden 64, vocabulary 512, 4 layers
        random_drafter_checkpoint(d / kind, kind, 64, 512, [1, 3], seed=5)
    out = d / "vl-dflash.ninfer"
    assert cli(["convert", base, str(out), "--dflash", str(d / "dflash"), "--dflash2", str(d / "dflash2"),
                "--no-progress"]) == 0
    return str(out)


def _ask(server, messages, max_tokens=24):
    client = openai.OpenAI(base_url=server.api_base, api_key="x", max_retries=0, timeout=300)
    r = client.chat.completions.create(model="", messages=messages, max_tokens=max_tokens, temperature=0,
                                       logprobs=True, extra_body={"enable_thinking": False})
    ch = r.choices[0]
    tokens = [t.token for t in (ch.logprobs.content or [])] if ch.logprobs else []
    return {"content": ch.message.content, "tokens": tokens, "completion_tokens": r.usage.completion_tokens,
            "cached": (r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0)}


def _session(server):
    """Every request in order, a follow-up turn over the first image, then two image requests at once."""
    out = [_ask(server, m) for m in REQUESTS]
    follow = [{"role": "user", "content": FIRST}, {"role": "assistant", "content": out[0]["content"] or "x"},
              {"role": "user", "content": "Say more."}]
    out.append(_ask(server, follow))
    both: dict = {}
    threads = [threading.Thread(target=lambda i=i: both.__setitem__(i, _ask(server, REQUESTS[i], 32)))
               for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out += [both[0], both[1]]
    return out


@pytest.fixture(scope="module")
def plain(artifact, launch, tmp_path_factory):
    logs = tmp_path_factory.mktemp("dfl-vl-plain")
    s = launch(artifact, "--vision", "--max-context", "2048", "--max-concurrency", "2", log_dir=logs,
               env={"NINFER_CACHE_DIR": str(logs / "cache")})
    try:
        yield _session(s)
    finally:
        s.stop()


@pytest.mark.parametrize("spec", ["dflash", "dflash2"])
def test_vision_with_the_drafter_equals_vision_without(artifact, launch, tmp_path_factory, plain, spec):
    logs = tmp_path_factory.mktemp(f"dfl-vl-{spec}")
    log = logs / "requests.jsonl"
    s = launch(artifact, "--vision", "--spec", spec, "--draft-tokens", "7", "--ngram-draft-tokens", "0",
               "--max-context", "2048", "--max-concurrency", "2", "--request-log-jsonl", str(log), log_dir=logs,
               env={"NINFER_CACHE_DIR": str(logs / "cache")})
    try:
        got = _session(s)
    finally:
        s.stop()
    assert all(r["completion_tokens"] > 0 for r in plain)
    for i, (a, b) in enumerate(zip(plain, got)):
        assert b["tokens"] == a["tokens"], i
        assert b["content"] == a["content"], i
    assert got[3]["cached"] > 0  # the follow-up turn reused the image's prefix
    done = [json.loads(line) for line in log.read_text().splitlines() if '"request_done"' in line]
    facts = [d["speculative"] for d in done if d.get("speculative")]
    assert len(facts) == len(got) and all(f["backend"] == spec for f in facts)
    assert sum(f["model_drafted_tokens"] for f in facts) > 0  # the drafter proposed after the media prefill
