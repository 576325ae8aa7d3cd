"""The indexed attention's Triton kernels (ninfer_flash_next.gpu.sparse_attention) against their
torch references on small shapes: block scores, the exact top-k with ties to the lowest index, and
the attention over selected blocks plus the tail for sparse and dense rows, split and unsplit; then
the runner with the kernel attention layers (gpu/indexed.py) against the reference runner through
prefill chunks crossing the dense threshold, decode, verify/commit and a batch of 3.

On the CPU the kernels need Triton's interpreter, which must be on before triton is imported:
`test_under_the_triton_interpreter` runs this module again in a child process with
TRITON_INTERPRET=1 (the other tests skip in the parent); on CUDA they run the compiled kernels."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")
from ninfer_flash_next.gpu import sparse_attention as SA

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
kernels = pytest.mark.skipif(DEV == "cpu" and not INTERP, reason="run by test_under_the_triton_interpreter")




def _scores_case(seed=0, t=5, h=3, d=16, lanes=2, nbmax=40):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g).to(DEV)
    kb = torch.randn(lanes, nbmax, d, generator=g).to(DEV)
    lane = torch.tensor([i % lanes for i in range(t)], dtype=torch.int32, device=DEV)
    nb = torch.tensor([nbmax - 3 * i for i in range(t)], dtype=torch.int32, device=DEV)
    return q, kb, lane, nb


@kernels
def test_index_scores_match_the_reference():
    q, kb, lane, nb = _scores_case()
    got = SA.index_scores(q, kb, lane, nb, block_n=16)
    want = SA.ref_index_scores(q, kb, lane, nb)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert (got[4, int(nb[4]):] == -1).all() and (got[0] >= 0).all()


@kernels
def test_topk_matches_the_reference_with_ties():
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(4, 50, generator=g)
    scores[1, ::2] = 0.0  # relu zeros: many exact ties at the threshold
    scores[2] = 0.25  # one value everywhere
    scores[3, 10:20] = scores[3, 5]
    nb = torch.tensor([50, 37, 50, 30], dtype=torch.int32)
    scores[1, 37:] = -1.0
    scores[3, 30:] = -1.0
    scores = scores.to(DEV)
    nb = nb.to(DEV)
    for k in (1, 7, 29):
        got = SA.topk_blocks(scores, nb, k, block_n=16)
        want = SA.ref_topk_blocks(scores, nb, k)
        assert torch.equal(got.cpu(), want.cpu()), k
    assert SA.topk_blocks(scores, nb, 7, block_n=16)[2].tolist() == list(range(7))  # ties: lowest first


@kernels
def test_topk_against_torch_topk_without_ties():
    g = torch.Generator().manual_seed(2)
    scores = torch.rand(3, 300, generator=g).to(DEV)
    nb = torch.tensor([300, 200, 64], dtype=torch.int32, device=DEV)
    got = SA.topk_blocks(scores, nb, 16, block_n=64)
    for t in range(3):
        want = scores[t, : int(nb[t])].topk(16).indices.sort().values
        assert got[t].tolist() == want.tolist()


def _attn_case(seed, d=32, kvh=2, g=4, page=8, ratio=4, topk=3, qpos=(40, 13, 11, 2, 33)):
    gen = torch.Generator().manual_seed(seed)
    pages = 24
    k_cache = torch.randn(pages, page, kvh, d, generator=gen).to(DEV)
    v_cache = torch.randn(pages, page, kvh, d, generator=gen).to(DEV)
    # two lanes with shuffled page tables
    perm = torch.randperm(pages, generator=gen)
    block_table = torch.stack([perm[:12], perm[12:]]).to(torch.int32).to(DEV)
    t = len(qpos)
    q = torch.randn(t, kvh * g, d, generator=gen).to(DEV)
    lane = torch.tensor([i % 2 for i in range(t)], dtype=torch.int32, device=DEV)
    qp = torch.tensor(qpos, dtype=torch.int32, device=DEV)
    nb = (qp + 1) // ratio
    sparse = (nb > topk).to(torch.int32)
    sel = torch.zeros(t, topk, dtype=torch.int32)
    for i in range(t):
        if sparse[i]:
            sel[i] = torch.randperm(int(nb[i]), generator=gen)[:topk].sort().values.to(torch.int32)
    return q, k_cache, v_cache, block_table, lane, qp, sel.to(DEV), sparse, ratio, topk


@kernels
@pytest.mark.parametrize("block_n,max_keys", [(16, None), (16, 64), (32, None)])
def test_sparse_attention_matches_the_reference(block_n, max_keys):
    """fp32; split (few rows) and one split per row (max_keys 64 with block 16: 4 splits), dense
    rows (nb <= k: every block) and sparse ones."""
    q, kc, vc, bt, lane, qp, sel, sparse, ratio, topk = _attn_case(3)
    scale = q.shape[-1] ** -0.5
    want = SA.ref_sparse_attention(q, kc, vc, bt, lane, qp, sel, sparse, ratio, scale)
    got = SA.sparse_attention(q, kc, vc, bt, lane, qp, sel, sparse, ratio, topk, scale, max_keys=max_keys,
                              block_n=block_n)
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4)
    one = SA.sparse_attention(q, kc, vc, bt, lane, qp, sel, sparse, ratio, topk, scale, block_n=block_n, splits=1)
    assert torch.allclose(one, want, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(DEV == "cpu", reason="bf16 tl.dot under this triton's interpreter returns garbage (core's "
                    "paged decode kernel too); the compiled kernel runs it on CUDA")
@kernels
def test_sparse_attention_bf16_one_split():
    q, kc, vc, bt, lane, qp, sel, sparse, ratio, topk = _attn_case(4)
    q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    scale = q.shape[-1] ** -0.5
    want = SA.ref_sparse_attention(q, kc, vc, bt, lane, qp, sel, sparse, ratio, scale).float()
    assert SA.attention_splits(SA.TARGET_PROGRAMS, kc.shape[2], 15, 16) == 1  # prefill-sized: no split
    for splits in (1, 3):
        got = SA.sparse_attention(q, kc, vc, bt, lane, qp, sel, sparse, ratio, topk, scale, block_n=16,
                                  splits=splits).float()
        assert float((got - want).abs().max()) <= 2e-2, splits


@kernels
def test_kept_positions_are_the_indexer_mask():
    """The attention's keys equal the CPU reference's mask (Indexer.select) for a sparse row."""
    from ninfer_flash_next.attention import Indexer  # noqa: F401 - the mask logic this mirrors

    pos = SA.kept_positions(17, torch.tensor([0, 3]), True, 4)
    assert pos.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 16, 17]
    assert SA.kept_positions(6, torch.tensor([0]), False, 4).tolist() == list(range(7))


def _runner_case(r):
    """Prefill chunks 7 + 9 + 12 (the threshold is 11 keys), 3 decodes, a verify of 3 committed at
    2, then a batch of 3 lanes (one still dense) decoding together; every logit row, concatenated."""
    from ninfer_core.engine.model_api import LOGITS_ALL, VERIFY, ForwardBatch, LaneSegment, SeqView

    g = torch.Generator().manual_seed(5)
    toks = torch.randint(0, 500, (60,), generator=g).tolist()
    r.allocate_cache(24, 4)
    seq = SeqView(0, [5, 2, 9, 11], 0)
    rows = []
    for n in (7, 9, 12):
        rows.append(r.prefill(seq, toks[seq.num_cached: seq.num_cached + n], all_logits=True))
        seq.num_cached += n
    for t in toks[28:31]:
        rows.append(r.decode([seq], [t]))
        seq.num_cached += 1
    out = r.forward(ForwardBatch([LaneSegment(0, {"full_attention": seq.pages}, 31, toks[31:34], VERIFY,
                                              LOGITS_ALL)]))
    rows.append(out[0].logits)
    r.commit([(0, 2)])
    seq.num_cached = 33
    others = [SeqView(1, [0, 3], 0), SeqView(2, [7, 1, 4], 0)]
    for s, n in zip(others, (6, 20)):
        rows.append(r.prefill(s, toks[40: 40 + n], all_logits=True))
        s.num_cached = n
    lanes = [seq, *others]
    for step in range(3):
        rows.append(r.decode(lanes, [toks[34 + step], toks[50 + step], toks[10 + step]]))
        for s in lanes:
            s.num_cached += 1
    return torch.cat(rows)


@kernels
def test_kernel_attention_layers_match_the_reference_runner(monkeypatch):
    from ninfer_flash_next.attention import IndexedAttention
    from ninfer_flash_next.family import FlashNextFamily
    from ninfer_flash_next.gpu import indexed
    from ninfer_flash_next.testing import tiny_config

    from ninfer_core.accel import kernels as K

    fam = FlashNextFamily()
    cfg = tiny_config(indexer_n_heads=8)  # 8 heads: no exact score ties at the top-k threshold
    dt = torch.float32
    art = fam.random_artifact(cfg, device=DEV, seed=2, dtype=dt)
    ref = fam.load(art, device=DEV, dtype=dt)
    if DEV == "cuda":  # the loader swaps in the kernel layers on CUDA: the reference is the plain class
        for layer in ref.model.layers:
            if layer.layer_type != "linear_attention":
                layer.self_attn.__class__ = IndexedAttention
    want = _runner_case(ref)
    calls = {"sparse": 0, "topk": 0, "dense": 0}

    def counted(name, fn):
        def wrap(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrap

    monkeypatch.setattr(indexed.SA, "sparse_attention", counted("sparse", SA.sparse_attention))
    monkeypatch.setattr(indexed.SA, "topk_blocks", counted("topk", SA.topk_blocks))
    monkeypatch.setattr(indexed.K, "paged_prefill_attention", counted("dense", K.paged_prefill_attention))
    r = fam.load(art, device=DEV, dtype=dt)
    for layer in r.model.layers:
        if layer.layer_type != "linear_attention":
            layer.self_attn.__class__ = indexed.KernelIndexedAttention
    got = _runner_case(r)
    assert all(calls.values()), calls
    err = float((got - want).abs().max() / want.abs().max())
    print(f"PARITY flash-next kernel indexed attention vs reference runner: rel err {err:.2e}")
    assert err <= 1e-5


def _interpreter_child():
    """Every test above under TRITON_INTERPRET=1, in a child process (the parent on the CPU only)."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-q", "-x", "-s", "-p", "no:cacheprovider", __file__],
                       env=env, capture_output=True, text=True, timeout=900, check=False,
                       cwd=os.path.dirname(__file__))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert " passed" in p.stdout and " failed" not in p.stdout


# not under the module mark: the parent runs the child (skipped on CUDA and inside the child)
test_under_the_triton_interpreter = pytest.mark.skipif(DEV != "cpu" or INTERP, reason="CPU parent only")(
    _interpreter_child)
