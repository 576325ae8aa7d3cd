"""Vision across pipeline stages (issue 26): `ninfer serve --devices cpu,cpu --vision` on a random
Qwen3.5 vision-language artifact (converted from transformers' own save_pretrained) answers an
image prompt through the openai client exactly as one device does, with the tower resident on
the first stage's device or on the CPU (`--vision-residency cpu`); `--vision-residency overlay`
is refused before anything loads."""

from __future__ import annotations

import base64
import io
import subprocess
import sys

import pytest

pytest.importorskip("ninfer_qwen35")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def vl_artifact(tmp_path_factory):
    from ninfer_qwen35.vl_testing import build_vl_artifact

    return build_vl_artifact(tmp_path_factory.mktemp("pipevl") / "vl.ninfer", seed=5)


def _image_uri(seed=3, w=64, h=48) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _ask(server) -> tuple[list, int]:
    """Two turns over one image; (each turn's (content, reasoning), second turn's cached tokens)."""
    client = openai.OpenAI(base_url=server.api_base, api_key="none")
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _image_uri()}},
                                         {"type": "text", "text": "What is in the picture?"}]}]
    out, cached = [], 0
    for turn in range(2):
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
        m = r.choices[0].message
        out.append((m.content or "", (m.model_extra or {}).get("reasoning_content") or ""))
        cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
        msgs += [{"role": "assistant", "content": m.content or ""}, {"role": "user", "content": "And then?"}]
        assert r.usage.prompt_tokens > 20 + turn  # the image's merged tokens are in the prompt
    return out, cached


def test_image_prompt_across_stages_equals_one_device(vl_artifact, launch, tmp_path):
    servers = []
    try:
        for flags in (["--vision"], ["--vision", "--devices", "cpu,cpu"],
                      ["--vision-residency", "cpu", "--vision", "--devices", "cpu,cpu", "--stage-layers", "1,3"]):
            servers.append(launch(vl_artifact, *flags, "--max-context", "1024", log_dir=tmp_path))
        want, _ = _ask(servers[0])
        assert any("".join(t) for t in want)
        for s in servers[1:]:
            assert "pipeline of 2 stages (gloo)" in s.log()
            got, cached = _ask(s)
            assert got == want
            assert cached > 0  # the second turn reused the image prefix captured across both stages
    finally:
        for s in servers:
            s.stop()


def test_overlay_vision_is_refused_with_devices(vl_artifact):
    r = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "serve", vl_artifact, "--port", "0", "--vision",
                        "--vision-residency", "overlay", "--devices", "cpu,cpu"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1
    assert ("error: --vision-residency overlay does not run with --devices (use resident or cpu: the tower stays "
            "on the first device)") in r.stderr
