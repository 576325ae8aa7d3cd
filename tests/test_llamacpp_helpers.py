"""Shared by the raw-completion, tokenizer and rerank route tests (no tests of its own).

`raw_app` serves the real app over a real Engine whose model is the toy runner of
ninfer_core/testing.py with the real Qwen3.5 tokenizer: outputs are forced per prompt with a
ScriptPolicy (or any `policy(prefix) -> token`), so every response shape is deterministic while
admission, stop strings, limits and detokenisation are the engine's own.
"""

from __future__ import annotations

import json

import pytest

from ninfer_core.testing import ScriptPolicy, ToyRunner

BUILTINS = [("ops", "ninfer_core.protocols.ops"),
            ("openai_chat", "ninfer_core.protocols.openai_chat"),
            ("llamacpp", "ninfer_core.protocols.llamacpp"),
            ("openai_completions", "ninfer_core.protocols.openai_completions"),
            ("tokenize", "ninfer_core.protocols.tokenize_routes"),
            ("rerank", "ninfer_core.protocols.rerank")]

_TOKENIZER = None


def qwen_tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        from qwen_format import qwen35_tokenizer_section, with_format

        from ninfer_core.tokenizer import Tokenizer

        _TOKENIZER = with_format(Tokenizer.from_section(qwen35_tokenizer_section()))
    return _TOKENIZER


def script(pairs: dict[str, str], tok=None, eos: bool = True) -> ScriptPolicy:
    """Force `pairs[prompt]` (text) after a prompt that starts with `prompt`, then <|im_end|>."""
    tok = tok or qwen_tokenizer()
    end = tok.token_to_id("<|im_end|>")
    return ScriptPolicy({tuple(tok.encode(p)): tok.encode(out) for p, out in pairs.items()},
                        after=end if eos else None)


def sse(text: str) -> list:
    """SSE body -> [parsed data | "[DONE]" | ":comment"]."""
    out = []
    for block in text.split("\n\n"):
        if not block:
            continue
        if block.startswith(":"):
            out.append(block)
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error(r, status: int, code: str, param: str | None, type_: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    assert err["param"] == param, err
    assert err["type"] == type_, err
    assert err["message"]
    return err


def assert_idle(engine) -> None:
    snap = engine.snapshot()
    assert snap["lanes_active"] == 0 and snap["pending"] == 0 and snap["outstanding"] == 0, snap
    assert snap["pages_free"] == snap["pages_total"] and snap["slots_free"] == snap["slots_total"], snap


@pytest.fixture
def raw_app():
    """raw_app(policy=None, engine_options=None, **serve_options) -> (TestClient, ctx, engine, runner)."""
    from fastapi.testclient import TestClient
    from qwen_format import QWEN35_TEMPLATE
    from qwen_format import sampling_presets as qwen_sampling_presets

    from ninfer_core.config import EngineOptions, ServeOptions
    from ninfer_core.engine.engine import Engine
    from ninfer_core.plugins import PluginHost, PluginSelection
    from ninfer_core.server.app import create_app
    from ninfer_core.server.context import ServedModel, ServerContext
    from ninfer_core.tokenizer.chat_template import ChatTemplate

    made = []

    def make(policy=None, engine_options: dict | None = None, **options):
        tok = qwen_tokenizer()
        opts = ServeOptions(artifact="/models/toy.ninfer",
                            engine=EngineOptions(**{"max_context": 2048, **(engine_options or {})}), **options)
        runner = ToyRunner(vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids, policy=policy)
        engine = Engine(runner, tok, opts.engine)
        engine.start()
        ctx = ServerContext(options=opts, plugins=PluginHost(PluginSelection(autoload=False), builtins=BUILTINS),
                            tokenizer=tok, chat_template=ChatTemplate(QWEN35_TEMPLATE), engine=engine,
                            sampling_presets=qwen_sampling_presets())
        ctx.model = ServedModel(id="toy-model", artifact_path=opts.artifact, architecture="qwen3_5",
                                max_model_len=opts.engine.max_context, n_vocab=tok.vocab_size)
        ctx.mark_ready()
        client = TestClient(create_app(ctx))
        made.append((client, engine))
        return client, ctx, engine, runner

    yield make
    for client, engine in made:
        client.close()
        engine.runner.resume()
        engine.shutdown(timeout=30)
