#!/usr/bin/env python3
"""Run llama.cpp's own router and sleep tests against `ninfer serve`.

    python scripts/llamacpp_tests.py [--work DIR] [--json-out FILE] [-k EXPR] [--sdist FILE]

llama.cpp's server tests (tools/server/tests) start `llama-server` through utils.py, which runs
the binary named by LLAMA_SERVER_BIN_PATH. This program fetches the llama-cpp-python sdist that
vendors llama.cpp (pinned version, SHA-256 checked by pip and again here), copies
unit/test_router.py, unit/test_sleep.py and their utils.py, conftest.py and pytest.ini into a
temporary directory, and runs them with pytest against scripts/llama_server_shim.py, which maps
each llama-server flag to a `ninfer serve` option (and each Hugging Face model to ninfer-tiny).

Network: PyPI only (pip download of the sdist); the tests download nothing. The sdist is kept
in ~/.cache/ninfer/llamacpp (or --cache-dir) and reused once its checksum matches.

Prints one line per llama.cpp test (PASSED, FAILED, ERROR, SKIPPED) and, with --json-out, writes
{"tests": {"unit/test_router.py::test_x": "passed", ...}, "pytest_status": N}. The exit status
is 0 when pytest ran (whatever the outcomes: the caller judges them against its expected
failures), 2 when the sdist could not be fetched or failed its checksum, 3 when pytest itself
could not run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIM = REPO / "scripts/llama_server_shim.py"

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
TESTS_IN_SDIST = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/tools/server/tests/"
FILES = ["utils.py", "conftest.py", "pytest.ini", "unit/test_router.py", "unit/test_sleep.py"]

# utils.py imports wget for download_file(), which neither suite calls; a module that refuses
# to download keeps the harness importable without a network or the unmaintained wget package.
WGET_STUB = '''"""Offline stand-in for the wget package: llama.cpp's router and sleep tests download nothing."""


def download(url, out=None):
    raise RuntimeError(f"offline: refusing to download {url}")
'''


class FetchError(Exception):
    pass


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_sdist(cache_dir: Path, given: str | None = None) -> Path:
    """The checked sdist: --sdist, else the cached copy, else pip download (which checks the hash)."""
    if given:
        path = Path(given)
        if not path.is_file():
            raise FetchError(f"--sdist {given}: no such file")
    else:
        cache_dir.mkdir(parents=True, exist_ok=True)
        path = cache_dir / SDIST
        if not path.is_file() or sha256_of(path) != SHA256:
            path.unlink(missing_ok=True)
            with tempfile.TemporaryDirectory() as tmp:
                req = Path(tmp) / "requirements.txt"
                req.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{SHA256}\n")
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                       "--require-hashes", "-r", str(req), "-d", tmp, "--quiet", "--disable-pip-version-check"]
                try:
                    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
                except subprocess.TimeoutExpired:
                    raise FetchError("pip download timed out") from None
                got = Path(tmp) / SDIST
                if r.returncode != 0 or not got.is_file():
                    raise FetchError(f"pip download {PACKAGE}=={VERSION} failed: "
                                     f"{(r.stderr or r.stdout).strip()[-2000:]}")
                shutil.move(str(got), path)
    digest = sha256_of(path)
    if digest != SHA256:
        raise FetchError(f"{path}: sha256 {digest}, expected {SHA256}")
    return path


def unpack_tests(sdist: Path, dest: Path) -> None:
    with tarfile.open(sdist, "r:gz") as tar:
        for rel in FILES:
            member = tar.getmember(TESTS_IN_SDIST + rel)
            data = tar.extractfile(member)
            if data is None:
                raise FetchError(f"{sdist}: {rel} is not a file")
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data.read())
    (dest / "wget.py").write_text(WGET_STUB)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_wrapper(bin_dir: Path) -> Path:
    """utils.py runs LLAMA_SERVER_BIN_PATH as an executable: this one runs the shim with this
    interpreter (and so with this environment's packages)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "llama-server"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{SHIM}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def outcomes(junit: Path) -> dict[str, str]:
    """unit/test_x.py::test_name[param] -> passed | failed | error | skipped, from pytest's JUnit XML."""
    result: dict[str, str] = {}
    for case in ET.parse(junit).iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        name = f"{module}::{case.get('name')}"
        status = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                status = {"failure": "failed"}.get(child.tag, child.tag)
                if child.tag == "error" and result.get(name) == "passed":
                    status = "error"  # a teardown error after a pass
        result[name] = status
    return result


def run(work: Path, sdist: Path, select: str | None, timeout_s: int) -> tuple[int, dict[str, str], str]:
    tests = work / "tests"
    unpack_tests(sdist, tests)
    # utils.py's TMP_DIR (tests/tmp), where the preset tests write their INI files: llama-server
    # creates it as its download cache (LLAMA_CACHE=tmp); nothing downloads here, so make it.
    (tests / "tmp").mkdir(exist_ok=True)
    shim_work = work / "shim"
    shim_work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, LLAMA_SERVER_BIN_PATH=str(server_wrapper(work / "bin")),
               NINFER_SHIM_WORK=str(shim_work), PORT=str(free_port()),
               PYTHONUNBUFFERED="1")
    for name in ("DEBUG_EXTERNAL", "LLAMA_CACHE"):  # the harness's own defaults
        env.pop(name, None)
    junit = work / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rA", f"--junitxml={junit}",
           "unit/test_router.py", "unit/test_sleep.py"]
    if select:
        cmd += ["-k", select]
    try:
        r = subprocess.run(cmd, check=False, cwd=tests, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, {}, out
    output = r.stdout + r.stderr
    if not junit.is_file():
        return r.returncode, {}, output
    return r.returncode, outcomes(junit), output


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", help="directory for the tests and their servers (default: a temporary one, removed)")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache/ninfer/llamacpp"))
    ap.add_argument("--sdist", help=f"a local {SDIST} instead of pip download (checksum still checked)")
    ap.add_argument("--json-out", help="write the outcome of every test as JSON")
    ap.add_argument("-k", dest="select", help="pytest -k expression: run only these tests")
    ap.add_argument("--log", help="write pytest's full output here")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds for the whole pytest run")
    args = ap.parse_args()
    try:
        sdist = fetch_sdist(Path(args.cache_dir), args.sdist)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="llamacpp-tests-"))
    try:
        status, results, output = run(work, sdist, args.select, args.timeout)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    if args.log:
        Path(args.log).write_text(output)
    if not results:
        print(output[-6000:])
        print(f"error: pytest produced no results (status {status})", file=sys.stderr)
        return 3
    for name, outcome in results.items():
        print(f"{outcome.upper():8} {name}")
    counts = {k: sum(1 for v in results.values() if v == k) for k in ("passed", "failed", "error", "skipped")}
    print(" ".join(f"{v} {k}" for k, v in counts.items()) + f" (pytest status {status})")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"tests": results, "pytest_status": status}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
