"""`ninfer serve` on a quantised artifact (convert --quantize int8, --kv-dtype int8, --lm-head-q6)
with the openai client, and the refused planned KV dtypes."""

from __future__ import annotations

import argparse

import openai
import pytest

pytest.importorskip("ninfer_qwen35")

from ninfer_qwen35.testing import build_tiny_artifact

from ninfer_core.artifact.convert import _encoding_of, convert_artifact


@pytest.fixture(scope="module")
def quant_server(tmp_path_factory, launch):
    from qwen_format import qwen35_tokenizer_section

    d = tmp_path_factory.mktemp("quant")
    src = build_tiny_artifact(str(d / "src.ninfer"), tokenizer_section=qwen35_tokenizer_section())
    out = str(d / "int8.ninfer")
    convert_artifact(src, out, encoding=_encoding_of(argparse.Namespace(quantize="int8", group_size=None)))
    server = launch(out, "--kv-dtype", "int8", "--lm-head-q6", log_dir=d)
    yield server
    server.stop()


def test_serves_a_quantised_artifact_with_int8_kv(quant_server):
    with openai.OpenAI(base_url=quant_server.api_base, api_key="x", max_retries=0, timeout=300) as c:
        r = c.chat.completions.create(model=c.models.list().data[0].id, max_tokens=8, temperature=0,
                                      messages=[{"role": "user", "content": "hello"}])
        assert r.usage.completion_tokens >= 1
        again = c.chat.completions.create(model=r.model, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "hello"}])
        assert again.choices[0].message.content == r.choices[0].message.content  # greedy, prefix reused
    import httpx

    props = httpx.get(quant_server.base_url + "/props", timeout=30)
    assert props.status_code == 200


def test_serve_refuses_planned_kv_dtypes_naming_the_built_ones(tmp_path, launch):
    src = build_tiny_artifact(str(tmp_path / "src.ninfer"))
    with pytest.raises(RuntimeError) as e:
        launch(src, "--kv-dtype", "nvfp4", log_dir=tmp_path, timeout=60)
    assert "--kv-dtype nvfp4 is not built yet; available: bf16, fp8, int8, k8v4" in str(e.value)
