"""End-to-end: every marked command of docs/clients.md, run as written against the real server.

The page marks each tested block with an HTML comment before it:
  <!-- test: server -->              the `ninfer serve ...` line this module starts its server with
  <!-- test: file PATH -->           a configuration file, written to PATH under a scratch HOME
  <!-- test -->                      a python or bash block, run as it is
  <!-- test: needs PROGRAM -->       a bash block that needs PROGRAM (skipped when it is not installed)
Only the address changes: 127.0.0.1:8080 becomes the test server's. Blocks that ask "What is
38 + 47?" of the SDKs must print ninfer-tiny's answer, 85; the agent clients must exit 0.
Claude Code and Codex are found on PATH or under $NINFER_CLIENTS_DIR/node_modules/.bin (.ci/run
installs them there with npm).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(3600)
DOC = Path(__file__).resolve().parents[2] / "docs" / "clients.md"
ADDRESS = "127.0.0.1:8080"
_BLOCK = re.compile(r"<!-- test(?::\s*(?P<what>[^>]*?))?\s*-->\s*\n```(?P<lang>\w*)\n(?P<body>.*?)\n```", re.S)
PYTHON_PACKAGES = {"openai": "openai", "anthropic": "anthropic", "litellm": "litellm",
                   "langchain_openai": "langchain_openai"}


@dataclass
class Block:
    kind: str  # server | file | run
    lang: str
    body: str
    arg: str = ""  # the file's path, or the program a run needs
    line: int = 0

    @property
    def id(self) -> str:
        first = self.body.strip().splitlines()[0][:40]
        return f"line{self.line}-{self.kind}-{self.arg or self.lang}-{first}"


def blocks() -> list[Block]:
    text = DOC.read_text()
    out = []
    for m in _BLOCK.finditer(text):
        what = (m.group("what") or "").strip()
        line = text.count("\n", 0, m.start()) + 1
        if what == "server":
            out.append(Block("server", m.group("lang"), m.group("body"), line=line))
        elif what.startswith("file "):
            out.append(Block("file", m.group("lang"), m.group("body"), what[5:].strip(), line))
        elif what.startswith("needs "):
            out.append(Block("run", m.group("lang"), m.group("body"), what[6:].strip(), line))
        else:
            out.append(Block("run", m.group("lang"), m.group("body"), line=line))
    return out


BLOCKS = blocks()
RUNS = [b for b in BLOCKS if b.kind == "run"]


def test_the_page_marks_its_commands():
    kinds = [b.kind for b in BLOCKS]
    assert kinds.count("server") == 1
    assert {b.arg for b in RUNS if b.arg} >= {"claude", "codex", "llm"}
    assert sum(b.lang == "python" for b in RUNS) >= 4  # OpenAI, Anthropic, LiteLLM, LangChain


def _clients_path() -> str:
    extra = []
    d = os.environ.get("NINFER_CLIENTS_DIR")
    if d:
        extra.append(str(Path(d) / "node_modules" / ".bin"))
    extra.append(str(Path(sys.executable).parent))  # llm's console script beside this python
    return os.pathsep.join(extra + [os.environ.get("PATH", "")])


@pytest.fixture(scope="module")
def home(tmp_path_factory, server):
    h = tmp_path_factory.mktemp("home")
    (h / "project").mkdir()
    for b in BLOCKS:
        if b.kind == "file":
            path = h / b.arg.removeprefix("~/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(b.body.replace(ADDRESS, server.address) + "\n")
    return h


@pytest.fixture(scope="module")
def server(launch, tmp_path_factory):
    pytest.importorskip("ninfer_tiny", reason="docs/clients.md serves the default model ninfer-tiny (plugins/tiny)")
    (cmd,) = [b.body.strip() for b in BLOCKS if b.kind == "server"]
    assert cmd.startswith("ninfer serve"), cmd
    s = launch(None, *cmd.split()[2:], log_dir=tmp_path_factory.mktemp("clients-doc"), timeout=600)
    s.address = f"127.0.0.1:{s.port}"
    yield s
    s.stop()


def _wait_idle(server, timeout: float = 1200.0) -> None:
    """Each block starts on an idle server: an agent client may leave a background request running
    after its command exits (on a loaded machine a 30k-token prefill takes minutes), and the next
    block's request would wait behind it on the one lane. A request that never ends fails here."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        req = httpx.get(f"http://{server.address}/v1/load", timeout=30).json()["requests"]
        if req["admitted"] == 0 and req["running"] == 0 and req["waiting"] == 0:
            return
        assert time.monotonic() < deadline, f"the server is not idle after {timeout:.0f} s: {req}"
        time.sleep(0.5)


@pytest.mark.parametrize("block", RUNS, ids=[b.id for b in RUNS])
def test_doc_block(block: Block, server, home):
    path = _clients_path()
    if block.arg and shutil.which(block.arg, path=path) is None:
        pytest.skip(f"{block.arg} is not installed (npm install it, or set NINFER_CLIENTS_DIR)")
    if block.lang == "python":
        for module, package in PYTHON_PACKAGES.items():
            if re.search(rf"^\s*(import|from) {module}\b", block.body, re.M):
                pytest.importorskip(package, reason=f"{package} is not installed (pip install -e '.[clients]')")
    _wait_idle(server)
    code = block.body.replace(ADDRESS, server.address)
    env = dict(os.environ, HOME=str(home), PATH=path)
    argv = [sys.executable, "-c", code] if block.lang == "python" else ["bash", "-e", "-c", code]
    out = subprocess.run(argv, cwd=home / "project", env=env, capture_output=True, text=True, timeout=3000,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, f"exit {out.returncode}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"
    if "38 + 47" in block.body and block.arg not in ("claude", "codex"):
        assert "85" in out.stdout, out.stdout
    elif block.arg in ("claude", "codex"):
        assert out.stdout.strip() or out.stderr.strip()
