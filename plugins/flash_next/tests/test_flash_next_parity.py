"""Logits parity with transformers' qwen4_exp (fp32, CPU): max|ours - hf| / max|hf| <= 1e-4.

The tiny model's indexer keeps 2 blocks of 4 keys (dense up to 11 keys), so every case below runs
both dense and sparse queries; prompts hold an EOS inside them (the n-gram hash restarts there).
Pages are handed out non-contiguously so page-table indexing is exercised.
"""

import pytest
import torch
from ninfer_flash_next.family import FlashNextFamily
from ninfer_flash_next.testing import EOS_ID

from ninfer_core.engine.model_api import (
    DECODE,
    LOGITS_ALL,
    VERIFY,
    ForwardBatch,
    LaneSegment,
    SeqView,
)

TOL = 1e-4


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 500, (n,), generator=g).tolist()
    toks[n // 3] = EOS_ID
    return toks


def rel_err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@torch.no_grad()
def hf_logits(hf, toks):
    return hf(torch.tensor([toks])).logits[0].float()


def runner(art, pages=24, slots=6):
    r = FlashNextFamily().load(art)
    r.allocate_cache(pages, slots)
    return r


def check(case, err):
    print(f"PARITY flash-next {case:32s} max rel err {err:.2e}")
    assert err <= TOL, f"{case}: rel err {err:.3e} > {TOL}"


def test_full_prefill(loaded):
    art, hf = loaded
    toks = prompt(70)
    ref = hf_logits(hf, toks)
    r = runner(art)
    out = r.prefill(SeqView(1, [7, 3], 0), toks, all_logits=True)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    check("full prefill (70)", rel_err(out, ref))


@pytest.mark.parametrize("chunk", [5, 9])
def test_chunked_prefill_crossing_the_sparse_threshold(loaded, chunk):
    art, hf = loaded
    toks = prompt(40, seed=1)
    ref = hf_logits(hf, toks)
    r = runner(art)
    seq = SeqView(2, [5, 0], 0)
    rows = []
    for i in range(0, len(toks), chunk):
        part = toks[i: i + chunk]
        rows.append(r.prefill(seq, part, all_logits=True))
        seq.num_cached += len(part)
    check(f"prefill in chunks of {chunk}", rel_err(torch.cat(rows), ref))


def test_token_by_token_decode(loaded):
    art, hf = loaded
    toks = prompt(30, seed=2)
    ref = hf_logits(hf, toks)
    r = runner(art)
    seq = SeqView(0, [4, 11], 0)
    rows = [r.prefill(seq, toks[:3], all_logits=True)]
    seq.num_cached = 3
    for t in toks[3:]:
        rows.append(r.decode([seq], [t]))
        seq.num_cached += 1
    check("token-by-token decode", rel_err(torch.cat(rows), ref))


def test_batch_of_three(loaded):
    """Three lanes of different lengths decode together (and one prefills beside them)."""
    art, hf = loaded
    prompts = [prompt(n, seed=10 + n) for n in (9, 23, 16)]
    refs = [hf_logits(hf, p) for p in prompts]
    r = runner(art)
    seqs = [SeqView(1, [0, 1], 0), SeqView(3, [2, 3], 0), SeqView(5, [8, 9], 0)]
    heads = [6, 14, 3]
    for s, p, h in zip(seqs, prompts, heads):
        r.prefill(s, p[:h])
        s.num_cached = h
    got = [[] for _ in prompts]
    for step in range(max(len(p) - h for p, h in zip(prompts, heads))):
        live = [i for i, (p, s) in enumerate(zip(prompts, seqs)) if s.num_cached < len(p)]
        out = r.decode([seqs[i] for i in live], [prompts[i][seqs[i].num_cached] for i in live])
        for row, i in zip(out, live):
            got[i].append(row)
            seqs[i].num_cached += 1
    for i, (p, h) in enumerate(zip(prompts, heads)):
        check(f"batch of 3, lane {i} ({len(p)} tokens)", rel_err(torch.stack(got[i]), refs[i][h:]))


def test_verify_and_commit_keep_the_accepted_prefix(loaded):
    """A verify of 4 committed at 2 leaves GDN, PLE and KV state exactly as if 2 tokens ran."""
    art, hf = loaded
    toks = prompt(26, seed=5)
    ref = hf_logits(hf, toks)
    r = runner(art)
    seq = SeqView(2, [1, 6], 0)
    r.prefill(seq, toks[:12])
    wrong = [toks[12], toks[13], (toks[14] + 1) % 500, 7]
    out = r.forward(ForwardBatch([LaneSegment(2, {"full_attention": [1, 6]}, 12, wrong, VERIFY, LOGITS_ALL)]))[0]
    check("verify rows before the miss", rel_err(out.logits[:2], ref[12:14]))
    r.commit([(2, 2)])
    rows = []
    for p in range(14, len(toks)):
        rows.append(r.forward(ForwardBatch([LaneSegment(2, {"full_attention": [1, 6]}, p, [toks[p]], DECODE,
                                                        LOGITS_ALL)]))[0].logits)
    check("decode after commit(2 of 4)", rel_err(torch.cat(rows), ref[14:]))
