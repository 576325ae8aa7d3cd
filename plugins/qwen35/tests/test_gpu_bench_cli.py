"""`ninfer bench` end to end on the CPU with a tiny artifact (a smoke run: the real figures come
from the GPU), its refusals, and its --help."""

import json
import os
import subprocess
import sys

import pytest

from ninfer_core.bench.run import render_table, step_bytes


def _bench(*args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "ninfer_core.cli", "bench", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def tiny(artifacts):
    return str(artifacts["dense"])


def test_bench_smoke_run_writes_table_and_json(tiny, tmp_path):
    out = tmp_path / "b.json"
    r = _bench("--shape", tiny, "--device", "cpu", "--prefill-lens", "64", "--decode-batches", "1,2",
               "--decode-steps", "3", "--decode-prompt", "16", "--long-context", "130", "--long-chunk", "64",
               "--repeats", "1", "--hf-prefill-lens", "32", "--hf-decode-batches", "1", "--hf-decode-steps", "2",
               "--http-clients", "1,2", "--http-tokens", "6", "--profile", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ninfer bench  shape=" in r.stdout and "prefill 64 tok/s" in r.stdout
    res = json.loads(out.read_text())
    assert res["ceilings"]["copy_bandwidth_GBps"] > 0 and res["ceilings"]["matmul_TFLOPs"] > 0
    assert res["ceilings"]["read_bandwidth_GBps"] > 0 and "ceilings: read " in r.stdout
    assert set(res["prefill"]) == {"64"} and res["prefill"]["64"]["tok_s"] > 0
    assert set(res["decode"]) == {"1", "2"}
    d2 = res["decode"]["2"]
    assert d2["total_tok_s"] == pytest.approx(2 * d2["per_seq_tok_s"])
    assert 0 < d2["vs_floor"] and d2["floor_total_tok_s"] > 0
    # two floors of the same step bytes: their ratio is the ratio of the two bandwidths
    ratio = res["ceilings"]["read_bandwidth_GBps"] / res["ceilings"]["copy_bandwidth_GBps"]
    assert d2["floor_total_tok_s"] / d2["copy_floor_total_tok_s"] == pytest.approx(ratio)
    assert f"of copy floor {d2['copy_floor_total_tok_s']:,.0f}" in r.stdout
    rates = res["linear_rates"]  # --profile: every weight shape's linear, timed at b=1 and 8
    assert rates and all(x["b1_GBps"] > 0 and x["b8_GBps"] > 0 and x["b1_vs_read"] > 0 for x in rates)
    assert "decode GEMVs" in r.stdout
    assert res["decode_long"]["total_tok_s"] > 0
    assert "prefill" in res["transformers"] and "32" in res["transformers"]["prefill"], res["transformers"]
    http = res["http"]
    assert "error" not in http, http
    # random weights sample over the whole vocabulary; the tiny artifact's byte tokenizer gives
    # text for a quarter of it, so the row runs on the bench's covering tokenizer
    assert http["tokenizer"].startswith("bench"), http["tokenizer"]
    assert "HTTP tokenizer: bench" in r.stdout
    for k in ("1", "2"):
        assert http[k]["tokens"] == int(k) * 6 and http[k]["engine_tokens"] == int(k) * 6
        assert http[k]["ratio"] > 0
        # every generated token reaches the streams as a text event of its own (the per-token path)
        assert http[k]["text_events"] == http[k]["tokens"], http[k]
        assert http[k]["engine_text_events"] == http[k]["engine_tokens"], http[k]
    idle = http["idle_after"]
    assert idle["lanes_active"] == 0 and idle["pages_free"] == idle["pages_total"]
    prof = res["profile"]  # on the CPU there are no device kernels: the tables exist and are empty
    assert set(prof) == {"decode_b1", "prefill_64"}, prof
    assert "profile decode_b1: device kernels" in r.stdout


def test_replay_profile_prints_phases_of_every_warm_turn(tmp_path):
    out = tmp_path / "r.json"
    r = _bench("--conversations", "--device", "cpu", "--turns", "2", "--system-tokens", "300", "--reply-tokens", "4",
               "--profile-replay", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["idle"] is True and len(res["replay"]) == 7
    append = next(x for x in res["replay"] if x["scenario"] == "append_only")
    assert append["reused"] > 0 and append["prev_turn_reuse_min"] >= 0.9
    assert r.stdout.count("phases of the last warm turn:") == 7
    block = r.stdout.split("phases of the last warm turn: append_only")[1].split("phases of")[0]
    # a resumed turn: admission, the state copy into the lane, then prefill of only the new tokens
    assert "cache.materialize" in block and "prefill" in block and "start=" in block
    starts = [int(x.split("start=")[1].split()[0]) for x in block.splitlines() if "start=" in x]
    assert starts and min(starts) == append["reused"]


@pytest.mark.parametrize("args,needle", [
    (["--shape", "no-such-shape", "--device", "cpu"], "neither a known shape"),
    (["--shape", "qwen3.5-9b", "--device", "cpu", "--decode-batches", "9"], "1..8"),
    (["--shape", "qwen3.5-9b", "--prefill-lens", "a,b"], "comma-separated integers"),
])
def test_bench_refusals_are_clear(args, needle):
    r = _bench(*args, timeout=120)
    assert r.returncode != 0
    assert needle in r.stderr


def test_bench_help_documents_every_option():
    r = _bench("--help", timeout=60)
    assert r.returncode == 0
    for opt in ("--shape", "--device", "--seed", "--prefill-lens", "--decode-batches", "--decode-prompt",
                "--decode-steps", "--long-context", "--long-chunk", "--repeats", "--no-cuda-graph", "--no-hf",
                "--hf-prefill-lens", "--hf-decode-batches", "--hf-decode-steps", "--http-clients", "--http-tokens",
                "--json", "--plugin"):
        assert opt in r.stdout


def test_step_bytes_counts_weights_state_and_kv():
    class Spec:
        state_bytes = 100
        kv_bytes_per_token = 10

    facts = {"dense_bytes": 1000, "expert_bytes": 0, "experts": 0, "top_k": 0}
    assert step_bytes(facts, Spec, 1, 50) == 1000 + 2 * 100 + 500
    assert step_bytes(facts, Spec, 4, 50) == 1000 + 4 * (200 + 500)
    moe = {"dense_bytes": 1000, "expert_bytes": 2560, "experts": 256, "top_k": 8}
    assert step_bytes(moe, Spec, 1, 0) == 1000 + 2560 * 8 / 256 + 200


def test_render_table_reports_missing_comparisons():
    res = {"shape": "s", "ceilings": {"copy_bandwidth_GBps": 1.0, "matmul_TFLOPs": 1.0},
           "prefill": {64: {"tok_s": 10.0, "ttft_ms": 5.0, "vs_matmul": 0.5}},
           "transformers": {"error": "ImportError: x"}, "http": {"error": "RuntimeError: y"}}
    text = render_table(res)
    assert "transformers: ImportError: x" in text and "HTTP: RuntimeError: y" in text


@pytest.mark.parametrize("vocab", [512, 248320])
def test_covering_tokenizer_gives_every_id_distinct_text(vocab):
    from ninfer_qwen35.chat import QWEN35_TEMPLATE, qwen35_tokenizer_section
    from ninfer_qwen35.testing import minimal_tokenizer_section

    from ninfer_core.bench.text_tokenizer import covering_section, template_controls, text_coverage
    from ninfer_core.tokenizer import Tokenizer
    from ninfer_core.tokenizer.chat_template import ChatTemplate

    msgs = [{"role": "user", "content": "Benchmark prompt number 7: say anything."}]
    tpl = ChatTemplate(QWEN35_TEMPLATE)
    controls = template_controls(qwen35_tokenizer_section(), tpl.render(msgs) + tpl.render(msgs, enable_thinking=False))
    # the end tokens first, then the markup the bench's prompts spell (no vision or tool markers)
    assert controls["tokens"] == ["<|im_end|>", "<|endoftext|>", "<|im_start|>", "<think>", "</think>"]
    tok = Tokenizer.from_section(covering_section(vocab, controls))
    assert tok.vocab_size == vocab
    texts = [tok.decode([i]) for i in range(vocab)]
    specials = [i for i in range(vocab) if tok.is_special(i)]
    n = len(controls["tokens"])
    assert specials == list(range(n))
    plain = [t for i, t in enumerate(texts) if i not in specials]
    assert all(t and t.isprintable() or t in ("\n", "\t") for t in plain)
    assert len(set(plain)) == len(plain)
    assert text_coverage(tok, vocab) == (vocab - n) / vocab
    # the bench's chat prompts encode below the vocabulary and round-trip
    prompt = ChatTemplate(QWEN35_TEMPLATE).render(
        [{"role": "user", "content": "Benchmark prompt number 7: say anything."}])
    ids = tok.encode(prompt)
    assert max(ids) < vocab and tok.decode(ids, skip_special=False) == prompt
    # the byte tokenizer of the random shapes leaves almost all of a 248k vocabulary without text
    assert text_coverage(Tokenizer.from_section(minimal_tokenizer_section()), vocab) < 0.3


def test_replay_profile_names_the_kernels_a_forward_compiled(tmp_path, monkeypatch):
    """--profile-replay on CUDA lists the Triton binaries that appeared in the on-disk cache during a
    forward (a first-use compile inside a request's time to first token)."""
    from types import SimpleNamespace

    from ninfer_core.bench import replay

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(replay, "_device_sync", lambda runner: lambda: None)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "_seen_before.cubin").write_bytes(b"x")

    from ninfer_core.engine.model_api import ForwardBatch, LaneSegment

    class FakeRunner:
        device = SimpleNamespace(type="cuda")

        def forward(self, batch):
            seg = batch.segments[0]
            if seg.kind == "prefill":
                d = tmp_path / f"h{len(seg.tokens)}"
                d.mkdir()
                (d / "_paged_prefill_kernel.cubin").write_bytes(b"x")
                (d / "_paged_prefill_kernel.json").write_text("{}")

    def prefill(runner, start, tokens):
        runner.forward(ForwardBatch([LaneSegment(0, {"": [0]}, start, tokens)]))

    runner = FakeRunner()
    timer = replay.PhaseTimer(runner, None)
    prefill(runner, 5, [1, 2, 3])
    prefill(runner, 8, [1, 2])
    (name, _, detail), (_, _, detail2) = timer.take()
    assert name == "prefill" and detail == "start=5 T=3 [compiled in the call: _paged_prefill_kernel]"
    assert "_seen_before" not in detail and detail2.endswith("[compiled in the call: _paged_prefill_kernel]")
    monkeypatch.setattr(FakeRunner, "device", SimpleNamespace(type="cpu"))
    cpu = FakeRunner()
    timer = replay.PhaseTimer(cpu, None)
    prefill(cpu, 0, [1] * 9)
    assert timer.take()[0][2] == "start=0 T=9"  # no device, no tracking
