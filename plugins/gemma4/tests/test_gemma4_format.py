"""Gemma 4's chat format through core's streaming OutputDecoder, its tokenizer, and convert+load of
every published shape (E2B, E4B, 26B-A4B, 31B) at test size."""

import json
import subprocess
import sys

import pytest
from ninfer_gemma4.chat import GEMMA4_CHAT_FORMAT, GemmaToolSyntax
from ninfer_gemma4.testing import KINDS

from ninfer_core.server.output import OutputDecoder

SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMAS["get_weather"]}}]


def stream(text, chunk=3, **kw):
    dec = OutputDecoder(chat_format=GEMMA4_CHAT_FORMAT, **kw)
    events = []
    for i in range(0, len(text), chunk):
        events += dec.feed(text[i:i + chunk])
    events += dec.finish()
    return dec, events


def test_reasoning_channel_then_content():
    dec, _ = stream("<|channel>thought\nLet me think.<channel|>The answer is 4.", in_reasoning=False)
    assert dec.reasoning == "Let me think." and dec.content == "The answer is 4."


def test_prompt_opened_channel_and_plain_content():
    dec, _ = stream("step one<channel|>Done.", in_reasoning=True)
    assert (dec.reasoning, dec.content) == ("step one", "Done.")
    dec, _ = stream("Just text.", in_reasoning=False)
    assert (dec.reasoning, dec.content) == ("", "Just text.")


def test_tool_calls_stream_and_parse():
    text = ('Checking.<|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,days:3,metric:true}<tool_call|>'
            '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>')
    dec, events = stream(text, in_reasoning=False, tools=TOOLS)
    assert dec.content == "Checking."
    assert [json.loads(c.arguments) for c in dec.tool_calls] == [
        {"city": "Paris, FR", "days": 3, "metric": True}, {"city": "Oslo"}]
    assert not any("<|tool_call>" in e.text for e in events if e.kind == "content")


def test_broken_and_undeclared_calls():
    s = GemmaToolSyntax()
    r = s.parse('<|tool_call>call:get_weather{city:<|"|>Paris}', SCHEMAS)
    assert r.calls[0].name == "malformed_tool_call" and r.malformed
    r = s.parse('<|tool_call>call:launch{x:1}<tool_call|>', SCHEMAS)
    assert r.calls[0].name == "malformed_tool_call" and "launch" in r.calls[0].arguments
    r = s.parse('<|tool_call>call:launch{x:1}<tool_call|>', SCHEMAS, undeclared_as_text=True)
    assert not r.calls and r.content.startswith("<|tool_call>")
    r = s.parse("no calls here", SCHEMAS)
    assert not r.calls and r.content == "no calls here"


def test_forced_call_is_closed():
    dec, _ = stream('city:<|"|>Rome<|"|>', in_reasoning=False, tools=TOOLS,
                    forced_call=GEMMA4_CHAT_FORMAT.tools.forced_opener("get_weather"))
    assert [(c.name, json.loads(c.arguments)) for c in dec.tool_calls] == [("get_weather", {"city": "Rome"})]
    assert dec.forced_call_closed


def test_tokenizer_round_trip(gemma_artifacts):
    from ninfer_core.artifact import Artifact
    from ninfer_core.tokenizer import Tokenizer

    tok = Tokenizer.from_section(Artifact.open(gemma_artifacts["e2b"]).tokenizer_section)
    text = "Hello, world! é 日本 \x01"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.encode("<turn|>") == [106] and len(tok.encode("<turn|>", allow_special=False)) > 1
    assert tok.eos_token_ids == (1, 106, 50)
    assert tok.decode([100, 106]) == "<|channel>"  # markup survives decoding, turn control tokens do not


@pytest.mark.parametrize("kind", KINDS)
def test_convert_cli_and_load_every_shape(kind, tmp_path):
    import torch
    from ninfer_gemma4.family import Gemma4Family
    from ninfer_gemma4.testing import write_hf_checkpoint

    from ninfer_core.artifact import Artifact
    from ninfer_core.engine.model_api import SeqView

    hf = write_hf_checkpoint(tmp_path / kind, kind=kind)
    out = tmp_path / f"{kind}.ninfer"
    r = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "convert", str(hf), str(out)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    art = Artifact.open(str(out))
    assert art.architecture == "gemma4" and art.chat_template and "<|turn>" in art.chat_template
    runner = Gemma4Family().load(art)
    runner.allocate_cache(16, 2, page_size=8)
    logits = runner.prefill(SeqView(0, list(range(16)), 0), [2, 105, 300, 301])
    assert logits.shape == (512,) and torch.isfinite(logits).all()
    assert logits.abs().max() <= runner.cfg.final_logit_softcapping
