"""Logits parity with transformers (fp32, CPU): max|ours - hf| / max|hf| <= 1e-4.

The same prompt through one full prefill, prefill in chunks of 7, token-by-token decode, and a
batched decode of 3 sequences of different lengths (against each alone and against transformers).
Pages are handed out non-contiguously so the page-table indexing is exercised.
"""

import pytest
import torch
from ninfer_qwen35.family import Qwen35Family
from qwen35_hf_reference import hf_logits, rel_err

from ninfer_core.engine.model_api import SeqView

TOL = 1e-4
KINDS = ["dense", "moe"]


def prompt(n, seed=0, vocab=500):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def runner_for(art, num_pages=32, num_slots=4):
    r = Qwen35Family().load(art)
    r.allocate_cache(num_pages, num_slots)
    return r


def report(kind, case, err):
    print(f"PARITY {kind:5s} {case:28s} max rel err {err:.2e}")
    assert err <= TOL, f"{kind} {case}: rel err {err:.3e} > {TOL}"


@pytest.mark.parametrize("kind", KINDS)
def test_full_prefill(loaded, kind):
    art, hf = loaded[kind]
    toks = prompt(150)
    ref = hf_logits(hf, toks)
    r = runner_for(art)
    out = r.prefill(SeqView(slot=1, pages=[7, 3, 12], num_cached=0), toks, all_logits=True)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    report(kind, "full prefill (150)", rel_err(out, ref))
    last = r  # last-token form
    r.reset_slot(1)
    out_last = last.prefill(SeqView(slot=1, pages=[7, 3, 12], num_cached=0), toks)
    assert out_last.shape == (ref.shape[1],)
    report(kind, "full prefill, last logits", rel_err(out_last, ref[-1]))


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill(loaded, kind):
    art, hf = loaded[kind]
    toks = prompt(150, seed=1)
    ref = hf_logits(hf, toks)
    r = runner_for(art)
    seq = SeqView(slot=2, pages=[5, 0, 9], num_cached=0)
    rows = []
    for i in range(0, len(toks), 7):
        chunk = toks[i : i + 7]
        rows.append(r.prefill(seq, chunk, all_logits=True))
        seq.num_cached += len(chunk)
    report(kind, "prefill in chunks of 7", rel_err(torch.cat(rows), ref))


@pytest.mark.parametrize("kind", KINDS)
def test_token_by_token_decode(loaded, kind):
    art, hf = loaded[kind]
    toks = prompt(80, seed=2)
    ref = hf_logits(hf, toks)
    r = runner_for(art)
    seq = SeqView(slot=0, pages=[4, 11], num_cached=0)
    rows = [r.prefill(seq, toks[:3], all_logits=True)]
    seq.num_cached = 3
    for t in toks[3:]:
        rows.append(r.decode([seq], [t]))
        seq.num_cached += 1
    report(kind, "token-by-token decode", rel_err(torch.cat(rows), ref))


@pytest.mark.parametrize("kind", KINDS)
def test_batched_decode_matches_alone_and_hf(loaded, kind):
    art, hf = loaded[kind]
    lens = [5, 70, 131]  # inside one page, across one boundary, across two
    steps = 6
    prompts = [prompt(n + steps, seed=10 + i) for i, n in enumerate(lens)]
    pages = [[2], [6, 1], [9, 3, 14]]
    pages = [p + [20 + 3 * i + j for j in range(2)] for i, p in enumerate(pages)]  # room to grow

    def run(batch_ids):
        r = runner_for(art)
        seqs = {}
        for i in batch_ids:
            seqs[i] = SeqView(slot=i, pages=pages[i], num_cached=0)
            r.prefill(seqs[i], prompts[i][: lens[i]])
            seqs[i].num_cached = lens[i]
        outs = {i: [] for i in batch_ids}
        for s in range(steps):
            logits = r.decode([seqs[i] for i in batch_ids], [prompts[i][lens[i] + s] for i in batch_ids])
            assert logits.shape == (len(batch_ids), art.config["text_config"]["vocab_size"])
            for row, i in zip(logits, batch_ids):
                outs[i].append(row)
                seqs[i].num_cached += 1
        return {i: torch.stack(v) for i, v in outs.items()}

    batched = run([0, 1, 2])
    worst_alone = worst_hf = 0.0
    for i in range(3):
        alone = run([i])[i]
        worst_alone = max(worst_alone, rel_err(batched[i], alone))
        ref = hf_logits(hf, prompts[i])[lens[i] : lens[i] + steps]
        worst_hf = max(worst_hf, rel_err(batched[i], ref))
    report(kind, "batch of 3 vs each alone", worst_alone)
    report(kind, "batch of 3 vs transformers", worst_hf)


@pytest.mark.parametrize("kind", KINDS)
def test_core_parity_helper_on_both_variants(loaded, kind):
    """ninfer_core.contract.parity, the helper a third-party family uses, on this family: it agrees
    here, and it fails naming the path when our logits are off."""
    from ninfer_core.contract.parity import ParityError, transformers_parity

    art, hf = loaded[kind]
    errs = transformers_parity(Qwen35Family().load(art), hf, prompt(70, seed=9), label=kind)
    assert set(errs) == {"one prefill", "prefill in chunks of 7", "token-by-token decode"}
    broken = Qwen35Family().load(art)
    forward = broken.forward

    def off_by_a_little(batch):  # every logit scaled by 1.01: a relative error of ~1e-2
        outs = forward(batch)
        for o in outs:
            if o.logits is not None:
                o.logits = o.logits * 1.01
        return outs

    broken.forward = off_by_a_little
    with pytest.raises(ParityError, match=f"{kind} one prefill"):
        transformers_parity(broken, hf, prompt(20, seed=9), label=kind)
