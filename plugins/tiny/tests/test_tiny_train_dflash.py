"""ninfer_tiny.train_dflash on the micro recipe: both drafters written in the published layout and
merged into a copy of the packaged artifact (outside the run folder with --merged-dir), the
acceptance table with every output equal to plain decoding, and a --budget whose acceptance share
is already spent listing every backend as skipped instead of running it."""

import json

import pytest

pytest.importorskip("ninfer_spec_dflash")
pytest.importorskip("ninfer_spec_mtp")

from ninfer_tiny.train import package_artifact_path
from ninfer_tiny.train_dflash import acceptance_table, main

from ninfer_core.artifact import Artifact


def test_micro_run_writes_the_drafters_and_the_acceptance_table(tmp_path, capsys):
    if not package_artifact_path().exists():
        pytest.skip("no packaged ninfer-tiny artifact")
    out, merged = tmp_path / "run", tmp_path / "merged"
    assert main(["--recipe", "micro", "--out", str(out), "--merged-dir", str(merged), "--eval-prompts", "1",
                 "--device", "cpu"]) == 0
    for kind in ("dflash", "dflash2"):
        assert (out / kind / "config.json").is_file() and (out / kind / "model.safetensors").is_file()
    assert not (out / "ninfer-tiny.ninfer").exists()
    art = Artifact.open(merged / "ninfer-tiny.ninfer")
    assert {"dflash", "dflash2", "mtp"} <= set(art.components)
    summary = json.loads((out / "summary.json").read_text())
    table = summary["acceptance"]["7"]
    assert table["skipped"] == []
    for name in ("mtp", "dflash", "dflash2"):
        row = table[name]
        assert row["same_as_plain"] == row["requests"] == 1 and row["rounds"] > 0
        assert row["acceptance_length"] == pytest.approx(1 + row["accepted"] / row["rounds"])
    printed = capsys.readouterr().out
    assert "tokens committed per round" in printed and "dflash2    7" in printed


def test_a_spent_budget_skips_the_table_runs(tmp_path):
    if not package_artifact_path().exists():
        pytest.skip("no packaged ninfer-tiny artifact")
    out = tmp_path / "run"
    # 1 s: the table's runs may start only until 40 s before the end, so none does
    assert main(["--recipe", "micro", "--out", str(out), "--eval-prompts", "1", "--device", "cpu",
                 "--budget", "1"]) == 0
    table = json.loads((out / "summary.json").read_text())["acceptance"]["7"]
    assert table["skipped"] == ["mtp", "dflash", "dflash2"]
    assert set(table) == {"plain", "skipped"}
    assert "K=7 skipped: mtp, dflash, dflash2" in acceptance_table({7: table})
