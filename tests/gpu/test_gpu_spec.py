"""Speculative decoding on CUDA: the verify kernels at real shapes, verify + commit against plain
decode at the Qwen3.5-9B shape (eager and graphed, both commit modes), and greedy output with the
MTP backend equal to plain decoding on the trained ninfer-tiny (bf16)."""

import argparse
import asyncio

import pytest
import torch

from ninfer_core.engine.model_api import ForwardBatch, LaneSegment, SeqView

TOL = 2e-2


def rel_err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def test_verify_kernels_at_the_9b_shape():
    import gpu_kernel_cases as c

    c.verify_kernels(device="cuda", hk=16, hv=32, dk=128, dv=128, lanes=8, t=8, tol=1e-3)
    c.decode_attention_key_start(device="cuda", heads=16, kvh=4, d=256, lens=(2, 700, 4000, 65))


@pytest.fixture(scope="module")
def model9b():
    from ninfer_core.bench.shapes import SHAPES
    from ninfer_qwen35.family import Qwen35Family

    fam = Qwen35Family()
    art = fam.random_artifact(SHAPES["qwen3.5-9b"], device="cuda", seed=9)
    runner = fam.load(art, device="cuda")
    yield runner
    del runner
    torch.cuda.empty_cache()


def _prompt(n, seed):
    return torch.randint(0, 200000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("mode", ["recompute", "positions"])
@pytest.mark.parametrize("graphs", [False, True])
def test_verify_then_commit_equals_decoding_the_kept_tokens(model9b, mode, graphs):
    """4 lanes: prefill, then a verify of 4 tokens committed at 1, 2, 4, 3 tokens; the verify's logits
    equal token-by-token decode's, and the next decode after the commit equals the next decode after
    decoding only the kept tokens."""
    runner = model9b
    runner.verify_mode = mode
    runner.configure(cuda_graph=graphs)
    runner.allocate_cache(64, 8)
    kept = [1, 2, 4, 3]
    lanes = [SeqView(i, list(range(16 * i, 16 * i + 14)), 0) for i in range(4)]
    prompts = [_prompt(300 + 97 * i, i) for i in range(4)]
    extra = [_prompt(5, 50 + i) for i in range(4)]
    dec_logits, dec_next = [], None
    for phase in ("decode", "verify"):
        for v, p in zip(lanes, prompts):
            runner.reset_slot(v.slot)
            v.num_cached = 0
            runner.prefill(v, p)
            v.num_cached = len(p)
        if phase == "decode":
            rows = []
            for j in range(4):
                rows.append(runner.decode(lanes, [e[j] for e in extra]))
                for v in lanes:
                    v.num_cached += 1
            dec_logits = torch.stack(rows, 1)  # [4 lanes, 4 tokens, vocab]
            # what the kept tokens alone leave: redo with each lane stopping at its kept count
            for v, p in zip(lanes, prompts):
                runner.reset_slot(v.slot)
                runner.prefill(SeqView(v.slot, v.pages, 0), p)
                v.num_cached = len(p)
            for v, e, k in zip(lanes, extra, kept):
                for j in range(k):
                    runner.decode([v], [e[j]])
                    v.num_cached += 1
            dec_next = runner.decode(lanes, [e[4] for e in extra])
        else:
            segs = [LaneSegment(v.slot, {g: v.pages for g in runner.cache_spec().group_names}, v.num_cached,
                                e[:4], "verify", "all") for v, e in zip(lanes, extra)]
            outs = runner.forward(ForwardBatch(segs))
            ver = torch.stack([o.logits for o in outs])
            runner.commit([(v.slot, k) for v, k in zip(lanes, kept)])
            for v, k in zip(lanes, kept):
                v.num_cached += k
            ver_next = runner.decode(lanes, [e[4] for e in extra])
    e1, e2 = rel_err(ver, dec_logits), rel_err(ver_next, dec_next)
    agree = (ver.argmax(-1) == dec_logits.argmax(-1)).float().mean().item()
    print(f"9B verify vs decode ({mode}, graphs={graphs}): logits {e1:.2e}, after commit {e2:.2e}, "
          f"argmax agreement {agree:.3f}")
    assert e1 <= TOL and e2 <= TOL


def test_mtp_greedy_output_equals_plain_on_ninfer_tiny():
    tiny = pytest.importorskip("ninfer_tiny.plugin")
    pytest.importorskip("ninfer_spec_mtp")
    from ninfer_qwen35.family import Qwen35Family
    from ninfer_spec_mtp.backend import MtpBackend

    from ninfer_core.artifact import Artifact
    from ninfer_core.config import EngineOptions
    from ninfer_core.engine.api import GenerationRequest, SamplingParams
    from ninfer_core.engine.engine import Engine
    from ninfer_core.testing import collect
    from ninfer_core.tokenizer import Tokenizer
    from ninfer_core.tokenizer.chat_template import ChatTemplate

    art = Artifact.open(tiny.packaged_artifact())
    tok = Tokenizer.from_section(art.tokenizer_section)
    tpl = ChatTemplate(art.chat_template)
    qs = ["What is 38 + 47?", "Hello", "What is your name?", "Count from 3 to 9.", "What is 61 + 29?",
          "What is 17 + 25?", "Count from 1 to 12.", "What is 90 + 9?"]
    prompts = [tok.encode(tpl.render([{"role": "user", "content": q}])) for q in qs]

    def serve(spec):
        runner = Qwen35Family().load(art, device="cuda")
        backend = MtpBackend.load(runner, art, argparse.Namespace(draft_tokens=3)) if spec else None

        async def go():
            eng = Engine(runner, tok, EngineOptions(max_context=1024, max_concurrency=4, device="cuda"), spec=backend)
            eng.start()
            try:
                hs = [eng.submit(GenerationRequest(prompt_ids=p, sampling=SamplingParams(temperature=0.0),
                                                   max_tokens=96)) for p in prompts]
                outs = [await collect(h) for h in hs]
                return outs, eng.snapshot()["counters"]
            finally:
                eng.shutdown(timeout=60)

        return asyncio.run(go())

    plain, _ = serve(False)
    spec, c = serve(True)
    same = sum(a.token_ids == b.token_ids for a, b in zip(plain, spec))
    rate = c["draft_accepted_tokens"] / max(1, c["draft_tokens"])
    print(f"ninfer-tiny bf16 on CUDA, --spec mtp K=3: {same}/{len(prompts)} outputs identical, "
          f"acceptance {rate:.3f} ({c['draft_accepted_tokens']}/{c['draft_tokens']})")
    assert same == len(prompts) and rate > 0.5
