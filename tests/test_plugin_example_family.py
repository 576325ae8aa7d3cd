"""The tutorial's example family (tests/plugins/example_family, docs/plugins/tutorial.md) as a third
party ships it: built and installed out of tree (pip, into a target directory of its own), found
through its entry point, served by `ninfer serve --plugin example` and chatted with through the
openai client; and the contract suite failing, by rule name, on a copy whose chunked prefill is wrong."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent / "plugins" / "example_family"
REPO = Path(__file__).resolve().parents[1]


def _env(*front: str, **extra: str) -> dict:
    path = [*front, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), **extra)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site directory holding the installed ninfer-example, an artifact built by its module)."""
    root = tmp_path_factory.mktemp("example-install")
    src = root / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("__pycache__", "tests"))  # pip writes build/ there
    site = root / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), str(src)], check=True, timeout=300)
    artifact = root / "example.ninfer"
    subprocess.run([sys.executable, "-m", "ninfer_example.build", str(artifact), "--seed", "3"], check=True,
                   env=_env(str(site)), cwd=str(root), timeout=300)
    return site, artifact


def test_the_installed_package_registers_its_entry_point(installed):
    site, _ = installed
    out = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "plugins", "--plugin", "example"], check=True,
                         capture_output=True, text=True, env=_env(str(site), NINFER_PLUGINS=""), cwd=str(site.parent),
                         timeout=120).stdout
    assert "ninfer-example" in out and "model family: example" in out, out


def test_serving_a_chat_through_the_openai_client(installed, launch, tmp_path):
    from openai import BadRequestError, OpenAI

    site, artifact = installed
    server = launch(str(artifact), "--plugin", "example", "--example-decay", "0.8", log_dir=tmp_path,
                    env=_env(str(site), NINFER_PLUGINS="", NINFER_DISABLE_PLUGIN_AUTOLOAD="1"))
    try:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        ask = {"model": model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8,
               "temperature": 0}
        first = client.chat.completions.create(**ask)
        again = client.chat.completions.create(**ask)
        assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 8
        assert first.choices[0].message.content == again.choices[0].message.content  # greedy
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask, stream=True)
                           if c.choices)
        assert streamed == first.choices[0].message.content
        # the prompt the artifact's template renders, in the artifact's tokenizer (markers are one token)
        rendered = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
        from ninfer_core.artifact import Artifact
        from ninfer_core.tokenizer import Tokenizer

        tok = Tokenizer.from_section(Artifact.open(str(artifact)).tokenizer_section)
        assert first.usage.prompt_tokens == len(tok.encode(rendered)) == len(rendered.encode()) - 2 * 11 - 9
        with pytest.raises(BadRequestError) as ei:  # a bad input: the protocol's error, then it serves on
            client.chat.completions.create(**{**ask, "messages": []})
        assert ei.value.status_code == 400
        assert client.chat.completions.create(**ask).choices[0].message.content == first.choices[0].message.content
    finally:
        server.stop()


def test_without_the_plugin_the_architecture_is_named(installed):
    site, artifact = installed
    proc = subprocess.run([sys.executable, "-m", "ninfer_core.cli", "serve", str(artifact), "--port", "0"],
                          check=False, capture_output=True, text=True, timeout=120, cwd=str(site.parent),
                          env=_env(str(site), NINFER_PLUGINS="", NINFER_DISABLE_PLUGIN_AUTOLOAD="1"))
    assert proc.returncode == 1
    assert "no installed plugin serves the architecture 'example_lm'" in proc.stderr + proc.stdout


def test_a_runner_whose_chunked_prefill_differs_fails_the_suite_naming_the_rule(tmp_path):
    """The example with one realistic bug (each prefill chunk starts from a zero running sum, as if
    the chunk were the whole prompt): the contract suite fails that rule alone, by name."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(EXAMPLE)!r})

        from ninfer_core.contract import RunnerContract
        from ninfer_example.runner import ExampleRunner


        class ChunkyRunner(ExampleRunner):
            def _segment(self, seg):
                if seg.kind == "prefill":
                    self.state[seg.slot] = 0  # the bug
                return super()._segment(seg)


        def load(workdir):
            from ninfer_example.build import build_artifact
            from ninfer_example.family import ExampleFamily
            from ninfer_core.artifact import Artifact

            runner = ExampleFamily().load(Artifact.open(build_artifact(workdir / "e.ninfer", seed=1)))
            runner.__class__ = ChunkyRunner
            return runner


        ninfer_contract = {{"chunky-example": RunnerContract(load)}}
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "ninfer_core.testing", "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=_env(str(REPO)), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "FAILED conftest.py::test_contract_prefill_equals_chunked_prefill[chunky-example]" in out, out
    assert "contract rule 'prefill-equals-chunked-prefill' broken by chunky-example" in out, out
    assert "1 failed, 7 passed, 1 skipped" in out, out  # every other rule still holds
