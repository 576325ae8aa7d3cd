"""The continuation state and the residency options, in process.

- capture / restore: a StateImage (GDN conv + recurrent state, PLE n-gram context and conv columns)
  plus copied KV pages (K, V and the indexer's raw keys) continue a lane exactly;
- expert residency host / disk through the LRU device cache: logits equal to device residency,
  hits / misses / admissions counted, eviction when the cache is smaller than the working set,
  a recorded profile filling the cache of the next load;
- n-gram rows: disk (with and without a row cache), ram, ram-hot, mmap and direct reads give the
  same logits; --ngram-table from another artifact; --no-ngram-table changes the output.
"""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from ninfer_flash_next.family import DEFAULTS, FlashNextFamily
from ninfer_flash_next.testing import EOS_ID

from ninfer_core.artifact import Artifact, TensorSpec, write_artifact
from ninfer_core.engine.model_api import SeqView

TOKS = [11, 300, 12, 45, 499, 3, EOS_ID, 250, 128, 64, 77, 11, 190, 401, 2, 9, 33, 7, 7, 81, 300, 12, 45]


def opts(**kw):
    return SimpleNamespace(**{**{k: None for k in DEFAULTS}, **kw})


def logits(art, options=None, toks=TOKS):
    r = FlashNextFamily().load(art, options=options)
    r.allocate_cache(8, 2)
    return r.prefill(SeqView(0, [3, 1], 0), toks, all_logits=True), r


@pytest.fixture(scope="module")
def art(artifact_path):
    return Artifact.open(artifact_path)


@pytest.fixture(scope="module")
def reference(art):
    return logits(art)[0]


def test_capture_restore_continues_a_lane_exactly(art, reference):
    r = FlashNextFamily().load(art)
    r.allocate_cache(8, 3)
    a = SeqView(0, [3, 1], 0)
    r.prefill(a, TOKS[:13])
    image = r.capture_state(0)
    names = set(image.tensors)
    assert {"ple_ctx.1", "ple_conv.1", "conv.0", "ssm.0"} <= names and image.nbytes == r.cache_spec().state_bytes
    pages = r.read_pages([3])
    assert "index.3" in pages and pages["index.3"].abs().sum() > 0  # the indexer's raw keys travel with the page
    r.reset_slot(0)
    r.prefill(a, [5, 6, 7])  # the first slot and page are overwritten by another lane's work
    r.restore_state(image, 2)
    r.write_pages([4], pages)
    r.copy_page(1, 5)
    b = SeqView(2, [4, 5], 13)
    out = r.prefill(b, TOKS[13:], all_logits=True)
    assert float((out - reference[13:]).abs().max()) <= 1e-4 * float(reference.abs().max())
    # a fresh slot reads EOS as the n-gram context, as a sequence start must
    r.reset_slot(1)
    assert r.cache.ple_ctx[1][1].tolist() == [EOS_ID, EOS_ID]
    with pytest.raises(ValueError, match="does not fit"):
        r.write_pages([4], {k: v for k, v in pages.items() if not k.startswith("index.")})


@pytest.mark.parametrize("kw", [
    {"expert_residency": "host", "expert_cache_mib": 0},
    {"expert_residency": "host", "expert_cache_mib": 1},
    {"expert_residency": "host", "expert_cache_mib": 1, "expert_misses": "mapped"},
    {"expert_residency": "disk", "expert_cache_mib": 1},
], ids=["host-no-cache", "host-staged", "host-mapped", "disk"])
def test_expert_residency_gives_the_device_logits(art, reference, kw):
    out, r = logits(art, opts(**kw))
    assert torch.equal(out, reference)
    ex = r.counters()["experts"]
    assert ex["routes"] == len(TOKS) * 4 * 4  # tokens x top-4 x 4 layers
    assert ex["routes"] == ex["hits"] + ex["misses"]
    if kw["expert_cache_mib"] == 0:
        assert ex["cpu_routes"] == ex["routes"] and ex["admitted"] == 0
    else:
        assert ex["slots"] == (1 << 20) // (3 * 32 * 64 * 4)  # 1 MiB of fp32 experts (3 x I x H)
        assert ex["admitted"] > 0 and ex["transferred_bytes"] == ex["admitted"] * 3 * 32 * 64 * 4


def test_a_small_cache_evicts_and_still_matches(art, reference):
    r = FlashNextFamily().load(art, options=opts(expert_residency="disk", expert_cache_mib=1))
    cache = r.extras["expert_cache"]
    # shrink it to 5 slots: fewer than one layer's experts in use, so the LRU must evict
    cache.where.clear()
    cache.free = list(range(5))[::-1]
    r.allocate_cache(8, 2)
    assert torch.equal(r.prefill(SeqView(0, [3, 1], 0), TOKS, all_logits=True), reference)
    assert len(cache.where) == 5 and r.counters()["experts"]["admitted"] > 5


def test_expert_profile_round_trip(art, reference, tmp_path):
    path = tmp_path / "experts.json"
    logits(art, opts(expert_residency="host", expert_cache_mib=1, expert_profile_out=str(path)))
    doc = json.loads(path.read_text())
    assert doc["format"] == "ninfer-expert-profile" and sum(map(sum, doc["counts"].values())) == len(TOKS) * 16
    out, r2 = logits(art, opts(expert_residency="host", expert_cache_mib=1, expert_profile=str(path)))
    assert torch.equal(out, reference)
    ex = r2.counters()["experts"]
    assert ex["hits"] > 0  # the profile's experts were in the cache before the first token
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(doc, artifact="another-model")))
    with pytest.raises(ValueError, match="another artifact"):
        FlashNextFamily().load(art, options=opts(expert_residency="host", expert_cache_mib=1, expert_profile=str(other)))
    with pytest.raises(ValueError, match="need --expert-residency host or disk"):
        FlashNextFamily().load(art, options=opts(expert_profile_out=str(path)))


def _direct_io_works(path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    os.close(fd)
    return hasattr(os, "O_DIRECT")


@pytest.mark.parametrize("kw", [
    {"ngram_residency": "disk", "ngram_io_depth": 1},
    {"ngram_residency": "disk", "ngram_ram_mib": 1},
    {"ngram_residency": "ram"},
    {"ngram_residency": "disk", "ngram_io": "mmap"},
    {"ngram_residency": "disk", "ngram_io": "direct"},
], ids=["disk", "disk-row-cache", "ram", "mmap", "direct"])
def test_ngram_rows_give_the_same_logits(art, reference, kw):
    if kw.get("ngram_io") == "direct" and not _direct_io_works(art.path):
        with pytest.raises(ValueError, match="O_DIRECT"):
            FlashNextFamily().load(art, options=opts(**kw))
        return
    out, r = logits(art, opts(**kw))
    assert torch.equal(out, reference)
    ng = r.counters()["ngram_table"]
    assert ng["rows"] == len(TOKS) * 8 and ng["batches"] == 1
    # a first pass finds nothing in RAM unless the whole table is there
    assert ng["resident_rows"] == (ng["rows"] if kw["ngram_residency"] == "ram" else 0)
    if kw.get("ngram_ram_mib"):  # the second pass over the same tokens reads from the row cache
        r.reset_slot(0)
        r.prefill(SeqView(0, [3, 1], 0), TOKS)
        assert r.counters()["ngram_table"]["resident_rows"] >= len(TOKS) * 8


def test_ram_hot_needs_a_profile_and_serves_its_rows(art, reference, tmp_path):
    with pytest.raises(ValueError, match="hot-row profile"):
        FlashNextFamily().load(art, options=opts(ngram_residency="ram-hot"))
    prof = tmp_path / "hot.txt"
    prof.write_text("\n".join(str(i) for i in range(0, 928, 2)))
    out, r = logits(art, opts(ngram_residency="ram-hot", ngram_hot_profile=str(prof)))
    assert torch.equal(out, reference)
    ng = r.counters()["ngram_table"]
    assert 0 < ng["resident_rows"] < ng["rows"]


def test_separate_table_artifact_and_no_table(art, reference, tmp_path):
    tables = [n for n in art.tensor_names() if ".ngram_embedding." in n]
    table_path = str(tmp_path / "table.ninfer")
    write_artifact(table_path, {"name": "table", "architecture": art.architecture, "config": art.config,
                                "tokenizer": art.tokenizer_section},
                   [TensorSpec(n, art.tensor_dtype(n), art.tensor_shape(n), lambda n=n: art.get_tensor(n))
                    for n in tables])
    out, _ = logits(art, opts(ngram_table=table_path))
    assert torch.equal(out, reference)
    bare, r = logits(art, opts(no_ngram_table=True))
    assert not torch.allclose(bare, reference, atol=1e-3) and "ngram_table" not in r.counters()
