"""`ninfer convert` refuses a checkpoint no model family serves, and stores the family's bundled chat
template when a checkpoint has none, saying so (issue 19)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_convert import make_hf_dir

from ninfer_core.artifact import Artifact
from ninfer_core.cli import main
from ninfer_core.tokenizer.builtin_templates import builtin_template_source, family_chat_template


def _strip_template(hf: str) -> None:
    cfg_path = Path(hf, "tokenizer_config.json")
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    for name in ("chat_template.jinja", "chat_template.json"):
        if os.path.exists(os.path.join(hf, name)):
            os.remove(os.path.join(hf, name))


def test_a_llama_checkpoint_is_refused(tmp_path, capsys):
    hf = make_hf_dir(tmp_path)
    cfg_path = Path(hf, "config.json")
    cfg = json.loads(cfg_path.read_text())
    cfg["model_type"] = "llama"
    cfg_path.write_text(json.dumps(cfg))
    out = tmp_path / "llama.ninfer"
    assert main(["convert", hf, str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot convert: no installed plugin serves the architecture 'llama'"), err
    assert not out.exists() and not os.path.exists(str(out) + ".tmp")


def test_a_checkpoint_without_a_template_gets_the_familys(tmp_path, capsys):
    pytest.importorskip("ninfer_qwen35.family")  # the template is the family's: core has none
    hf = make_hf_dir(tmp_path)
    _strip_template(hf)
    out = tmp_path / "q.ninfer"
    assert main(["convert", hf, str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "note: the checkpoint has no chat template; storing the qwen3_5 model family's template" in err, err
    with Artifact.open(str(out)) as art:
        assert art.chat_template == builtin_template_source("qwen35")


def test_family_templates():
    class Family:
        chat_template = "{{ messages }}"

    assert family_chat_template(Family(), "anything")[0] == "{{ messages }}"
    assert family_chat_template(None, "qwen3_5_moe") is None  # core keeps no architecture table
    assert family_chat_template(None, "llama") is None
