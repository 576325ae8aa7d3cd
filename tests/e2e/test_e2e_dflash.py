"""`ninfer serve --spec dflash|dflash2` end to end on the trained ninfer-tiny (its artifact ships
both drafters): greedy chat output equal to a server without speculation on every prompt at
K = 7 and K = 15, aggregate and streaming, with drafts accepted; the request log's speculative
facts name the backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("ninfer_qwen35")
pytest.importorskip("ninfer_tiny")
pytest.importorskip("ninfer_spec_dflash")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(900)

PROMPTS = ["What is 38 + 47?", "Hello", "What is your name?", "Count from 3 to 9.", "What is 61 + 29?"]


def _conftest(request):
    return request.config.pluginmanager.get_plugin(str(Path(__file__).resolve().parents[1] / "conftest.py"))


def _chat(server, prompt, stream=False):
    client = openai.OpenAI(base_url=server.api_base, api_key="x")
    msgs = [{"role": "user", "content": prompt}]
    if not stream:
        r = client.chat.completions.create(model="ninfer-tiny", messages=msgs, temperature=0, max_tokens=80)
        m = r.choices[0].message
        return (getattr(m, "reasoning_content", None) or "") + "|" + (m.content or "")
    parts = []
    for chunk in client.chat.completions.create(model="ninfer-tiny", messages=msgs, temperature=0, max_tokens=80,
                                                stream=True):
        if chunk.choices:
            d = chunk.choices[0].delta
            parts.append((getattr(d, "reasoning_content", None) or "") + (d.content or ""))
    return "".join(parts)


@pytest.fixture(scope="module")
def plain(request, tmp_path_factory):
    c = _conftest(request)
    tmp = tmp_path_factory.mktemp("dfl-plain")
    s = c.launch_server(None, "--max-concurrency", "2", log_dir=tmp, env={"NINFER_CACHE_DIR": str(tmp / "cache")})
    yield s, {p: _chat(s, p) for p in PROMPTS}
    s.stop()


@pytest.mark.parametrize("k", ["7", "15"])
@pytest.mark.parametrize("spec", ["dflash", "dflash2"])
def test_output_equals_the_plain_server(request, tmp_path_factory, plain, spec, k):
    c = _conftest(request)
    tmp = tmp_path_factory.mktemp(f"{spec}-{k}")
    log = tmp / "requests.jsonl"
    s = c.launch_server(None, "--spec", spec, "--draft-tokens", k, "--ngram-draft-tokens", "0",
                        "--max-concurrency", "2", "--request-log-jsonl", str(log), log_dir=tmp,
                        env={"NINFER_CACHE_DIR": str(tmp / "cache")})
    try:
        for p in PROMPTS:
            assert _chat(s, p) == plain[1][p], p
        assert _chat(s, PROMPTS[3], stream=True) == plain[1][PROMPTS[3]].replace("|", "", 1)
    finally:
        s.stop()
    done = [json.loads(line) for line in log.read_text().splitlines() if '"request_done"' in line]
    facts = [d["speculative"] for d in done if d.get("speculative")]
    assert facts and all(f["backend"] == spec for f in facts)
    assert sum(f["accepted_tokens"] for f in facts) > 0
