"""`ninfer convert --mtp-proposal-head N`: the rows it stores, from an HF directory and by re-writing
a .ninfer artifact, and its errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from qwen_format import byte_tokenizer_section

from ninfer_core.artifact import Artifact, TensorSpec, write_artifact
from ninfer_core.artifact.proposal import TOKEN_IDS, WEIGHT, choose_ids

V, H = 300, 8


def _section():
    s = byte_tokenizer_section()
    return s


def _artifact(path, tied=False):
    g = torch.Generator().manual_seed(0)
    head = torch.randn(V, H, generator=g)
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    specs = [TensorSpec(name, torch.float32, (V, H), lambda: head),
             TensorSpec("model.norm.weight", torch.float32, (H,), lambda: torch.ones(H))]
    write_artifact(path, {"architecture": "toy", "tokenizer": _section()}, specs)
    return head


def _run(*args):
    return subprocess.run([sys.executable, "-m", "ninfer_core.cli", "convert", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("tied", [False, True])
def test_rewrite_adds_the_rows_of_the_most_frequent_tokens(tmp_path, tied):
    src = tmp_path / "src.ninfer"
    head = _artifact(src, tied)
    corpus = tmp_path / "c.txt"
    corpus.write_text("zzzz yy x" * 50)
    out = tmp_path / "out.ninfer"
    r = _run(src, out, "--mtp-proposal-head", 12, "--mtp-proposal-corpus", corpus, "--no-progress")
    assert r.returncode == 0, r.stderr
    art = Artifact.open(out)
    ids = art.get_tensor(TOKEN_IDS).tolist()
    added = sorted(t["id"] for t in _section()["added_tokens"])
    assert ids[: len(added)] == added  # every added token first
    rest = ids[len(added):]
    assert rest[:4] == [ord("z"), ord(" "), ord("y"), ord("x")][: len(rest)]  # by frequency
    assert torch.equal(art.get_tensor(WEIGHT), head[torch.tensor(ids)])
    assert art.tensor_component(WEIGHT) == "mtp" and art.manifest["proposal_head"]["rows"] == 12
    assert sorted(art.tensor_names()) == sorted([WEIGHT, TOKEN_IDS, "model.norm.weight",
                                                  "model.embed_tokens.weight" if tied else "lm_head.weight"])
    shown = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "inspect", str(out)], capture_output=True,
                           text=True, timeout=60).stdout
    assert "proposal head:" in shown and "12 rows" in shown
    # re-writing again replaces the head instead of adding a second
    out2 = tmp_path / "out2.ninfer"
    assert _run(out, out2, "--mtp-proposal-head", 5, "--mtp-proposal-corpus", corpus, "--no-progress").returncode == 0
    assert Artifact.open(out2).get_tensor(TOKEN_IDS).numel() == 5


def test_choose_ids_fills_with_unseen_ids_in_order():
    from collections import Counter

    section = {"added_tokens": [{"id": 7, "content": "<x>"}]}
    assert choose_ids(section, Counter({3: 5, 9: 5, 1: 2}), 6, 20) == [7, 3, 9, 1, 0, 2]
    with pytest.raises(Exception, match="must be in 1..20"):
        choose_ids(section, Counter(), 21, 20)


@pytest.mark.parametrize("args,needle", [
    (("--mtp-proposal-head", "4"), "needs --mtp-proposal-corpus"),
    (("--mtp-proposal-corpus", "x.txt"), "is used with --mtp-proposal-head"),
    (("--mtp-proposal-head", "4", "--mtp-proposal-corpus", "/nonexistent.txt"), "is not a file"),
    (("--mtp-proposal-head", "100000", "--mtp-proposal-corpus", "CORPUS"), "must be in 1..300"),
])
def test_errors(tmp_path, args, needle):
    src = tmp_path / "src.ninfer"
    _artifact(src)
    corpus = tmp_path / "c.txt"
    corpus.write_text("abc")
    args = [str(corpus) if a == "CORPUS" else a for a in args]
    r = _run(src, tmp_path / "o.ninfer", *args, "--no-progress")
    assert r.returncode == 1 and needle in r.stderr and "Traceback" not in r.stderr
