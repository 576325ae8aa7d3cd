"""`ninfer convert SRC OUT --dflash DIR / --dflash2 DIR` of checkpoints written in the published
layout: the tensors land as the `dflash`/`dflash2` components under `<kind>.*` with the config in
`manifest["drafters"]`, the backend loads exactly those weights; bad checkpoints, artifacts without
the component and out-of-range draft counts are refused with errors that name the fix."""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("ninfer_qwen35")

import torch
from ninfer_qwen35.family import Qwen35Family
from ninfer_qwen35.testing import build_tiny_artifact
from ninfer_spec_dflash.backend import DFlash2Backend, DFlashBackend, SpecOptionError
from ninfer_spec_dflash.config import DrafterConfig
from ninfer_spec_dflash.testing import drafter_hf_config, random_tensors, write_drafter_checkpoint

from ninfer_core.artifact import Artifact
from ninfer_core.cli import main as cli


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_artifact(tmp_path_factory.mktemp("conv") / "t.ninfer", seed=2)


def checkpoint(d, kind, prefix="", seed=0, **kw):
    cfg = drafter_hf_config(kind, 64, 512, [1, 3], **kw)
    tensors = random_tensors(DrafterConfig.from_hf(cfg, kind), 512, seed)
    write_drafter_checkpoint(d, cfg, tensors, dtype=torch.bfloat16, prefix=prefix)
    return cfg, tensors


def test_convert_stores_the_drafters_and_the_backend_loads_them(base, tmp_path, capsys):
    cfg1, t1 = checkpoint(tmp_path / "d1", "dflash")
    cfg2, t2 = checkpoint(tmp_path / "d2", "dflash2", prefix="model.", seed=1)  # a wrapper's names
    out = tmp_path / "o.ninfer"
    assert cli(["convert", base, str(out), "--dflash", str(tmp_path / "d1"), "--dflash2", str(tmp_path / "d2"),
                "--no-progress"]) == 0
    assert "dflash 14, dflash2 21" in capsys.readouterr().out
    art = Artifact.open(out)
    assert art.components == ["text", "mtp", "dflash", "dflash2"]
    assert art.manifest["drafters"] == {"dflash": cfg1, "dflash2": cfg2}
    assert sorted(art.tensor_names("dflash")) == sorted(f"dflash.{n}" for n in t1)
    r = Qwen35Family().load(art)
    b1 = DFlashBackend.load(r, art, argparse.Namespace(draft_tokens=15))
    b2 = DFlash2Backend.load(r, art, argparse.Namespace(draft_tokens=None))
    assert (b1.draft_tokens, b2.draft_tokens) == (15, 7)  # the default is 7 (at most block - 1)
    assert b1.target_layers == (1, 3)
    for backend, tensors in ((b1, t1), (b2, t2)):
        sd = backend.drafter.state_dict()
        for n, t in tensors.items():
            assert torch.equal(sd[n], t.to(torch.bfloat16).float()), n


def test_reconverting_replaces_a_stored_drafter(base, tmp_path):
    checkpoint(tmp_path / "a", "dflash", seed=0)
    _, t_b = checkpoint(tmp_path / "b", "dflash", seed=5, layers=2)
    one, two = tmp_path / "1.ninfer", tmp_path / "2.ninfer"
    assert cli(["convert", base, str(one), "--dflash", str(tmp_path / "a"), "--no-progress"]) == 0
    assert cli(["convert", str(one), str(two), "--dflash", str(tmp_path / "b"), "--no-progress"]) == 0
    art = Artifact.open(two)
    assert art.manifest["drafters"]["dflash"]["num_hidden_layers"] == 2
    assert sorted(art.tensor_names("dflash")) == sorted(f"dflash.{n}" for n in t_b)


def test_bad_checkpoints_are_refused(base, tmp_path, capsys):
    out = str(tmp_path / "o.ninfer")

    def err(*args):
        assert cli(["convert", base, out, *args, "--no-progress"]) == 1
        return capsys.readouterr().err

    assert "not a directory" in err("--dflash", str(tmp_path / "missing"))
    cfg, t = checkpoint(tmp_path / "nofc", "dflash")
    t.pop("fc.weight")
    write_drafter_checkpoint(tmp_path / "nofc", cfg, t)
    assert "lacks fc.weight" in err("--dflash", str(tmp_path / "nofc"))
    checkpoint(tmp_path / "plain", "dflash")
    assert "convert it with --dflash" in err("--dflash2", str(tmp_path / "plain"))
    cfg = drafter_hf_config("dflash", 32, 512, [1])
    write_drafter_checkpoint(tmp_path / "narrow", cfg, random_tensors(DrafterConfig.from_hf(cfg, "dflash"), 512))
    assert "hidden_size 32 is not the model's 64" in err("--dflash", str(tmp_path / "narrow"))
    cfg, t = checkpoint(tmp_path / "nomask", "dflash")
    cfg["dflash_config"].pop("mask_token_id")
    (tmp_path / "nomask" / "config.json").write_text(json.dumps(cfg))
    assert "mask_token_id" in err("--dflash", str(tmp_path / "nomask"))


def test_backend_refuses_what_it_cannot_serve(base, tmp_path):
    art = Artifact.open(base)
    r = Qwen35Family().load(art)
    with pytest.raises(SpecOptionError, match=r"ninfer convert SRC OUT --dflash2 DRAFTER_DIR"):
        DFlash2Backend.load(r, art, argparse.Namespace())
    checkpoint(tmp_path / "d", "dflash", block_size=8)
    out = tmp_path / "o.ninfer"
    assert cli(["convert", base, str(out), "--dflash", str(tmp_path / "d"), "--no-progress"]) == 0
    art = Artifact.open(out)
    with pytest.raises(SpecOptionError, match="--draft-tokens 9 exceeds the dflash drafter's block of 8"):
        DFlashBackend.load(Qwen35Family().load(art), art, argparse.Namespace(draft_tokens=9))
    with pytest.raises(SpecOptionError, match="--lm-head-draft needs an artifact that stores a proposal head"):
        DFlashBackend.load(Qwen35Family().load(art), art, argparse.Namespace(lm_head_draft=True))


def test_serve_without_the_component_fails_at_startup(base):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "serve", base, "--spec", "dflash", "--port", "0"], check=False,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    assert "--dflash DRAFTER_DIR" in p.stderr
