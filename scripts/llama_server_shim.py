#!/usr/bin/env python3
"""Stand in for `llama-server` under llama.cpp's own server test harness (tools/server/tests/utils.py).

    LLAMA_SERVER_BIN_PATH=scripts/llama_server_shim.py pytest unit/test_router.py ...

utils.py starts the binary with llama-server flags; this program maps each to `ninfer serve`
options and then runs that server in its own process (ninfer_core.cli.main), so the harness's
SIGTERM and its kill reach the server itself and no wrapper process is left behind.

Models: the harness names Hugging Face repositories (`--hf-repo`, a preset's `hf-repo`) that it
downloaded once into its cache, and a router without a model lists that cache. Nothing is
downloaded here: every repository the harness's presets name maps to ninfer-tiny, and a router
lists them under llama.cpp's cache ids (`ggml-org/test-model-stories260K:F32`, ...). A repository
outside that list (a remote preset, a download) is refused with status 1, as an offline
llama-server refuses a model it has not cached.

Files the mapping writes (the router's preset) go to $NINFER_SHIM_WORK (the runner's temporary
directory), else to a fresh temporary directory.
"""

from __future__ import annotations

import configparser
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "plugins/tiny/ninfer_tiny/data/ninfer-tiny.ninfer"

# The repositories utils.py's presets and the router/sleep tests name, under the id llama.cpp's
# router gives a cached repository ("<repo>:<quant tag>"); each serves ninfer-tiny.
CACHE_IDS = {
    "ggml-org/test-model-stories260K": "ggml-org/test-model-stories260K:F32",
    "ggml-org/test-model-stories260K-infill": "ggml-org/test-model-stories260K-infill:F32",
    "ggml-org/tinygemma3-GGUF": "ggml-org/tinygemma3-GGUF:Q8_0",
}
# Single-model presets that name a file in a repository (embedding, rerank, MoE stories models).
KNOWN_FILE_REPOS = {"ggml-org/models", "ggml-org/stories15M_MOE"}

# llama-server flags with the `ninfer serve` option each becomes (None: the same spelling).
VALUE_FLAGS = {
    "--port": None, "--host": None, "--seed": None, "--alias": None, "--tags": None, "--api-key": None,
    "--models-max": None, "--chat-template": None, "--chat-template-file": None, "--cors-origins": None,
    "--temp": "--temperature", "--ctx-size": "--max-context", "-c": "--max-context",
    "--parallel": "--max-concurrency", "-np": "--max-concurrency",
    "--n-predict": "--default-max-tokens", "-n": "--default-max-tokens",
}
BOOL_FLAGS = {"--metrics": None, "--slots": None, "--no-slots": None, "--jinja": None,
              "--no-models-autoload": None, "--models-autoload": None}
# Flags about llama.cpp's own kernels, batching and pooling: no `ninfer serve` counterpart is
# needed to serve ninfer-tiny on the CPU, so they are accepted and dropped.
DROPPED_VALUE = {"--batch-size", "-b", "--ubatch-size", "-ub", "--threads", "-t", "--n-gpu-layers", "-ngl",
                 "-fa", "--flash-attn", "--pooling", "-ctk", "-ctv", "--cache-ram"}
DROPPED_BOOL = {"--offline", "--no-jinja", "--cont-batching", "--embedding", "--reranking", "--kv-unified",
                "--swa-full", "--verbose", "--no-ui", "--no-mmproj"}
# Preset keys of llama.cpp's router that have no NInfer counterpart (speculative drafts from
# Hugging Face); dropped with a note so a test that needs them fails visibly. spec-draft-hf still
# names a cache entry for dedup-cache-models (below).
DROPPED_PRESET_KEYS = {"spec-draft-hf", "hf-file"}


class ShimError(Exception):
    pass


def note(msg: str) -> None:
    print(f"llama_server_shim: {msg}", file=sys.stderr, flush=True)


def map_repo(repo: str) -> str:
    """The cache id of a repository the harness downloads (with or without its :tag)."""
    base = repo.split(":", 1)[0]
    if base in CACHE_IDS:
        return CACHE_IDS[base]
    raise ShimError(f"the repository {repo!r} is not one the harness caches; nothing is downloaded "
                    "(offline: only the repositories of utils.py's presets map to ninfer-tiny)")


def translate_flags(argv: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """llama-server argv -> (ninfer serve options, model-source flags the caller resolves)."""
    out: list[str] = []
    source: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        flag = argv[i]
        has_value = i + 1 < len(argv)
        if flag in VALUE_FLAGS:
            if not has_value:
                raise ShimError(f"{flag} needs a value")
            out += [VALUE_FLAGS[flag] or flag, argv[i + 1]]
            i += 2
        elif flag in BOOL_FLAGS:
            out.append(BOOL_FLAGS[flag] or flag)
            i += 1
        elif flag == "--sleep-idle-seconds":
            # llama-server's sleep frees the model; NInfer's sleep is model suspend, which the
            # option needs turned on.
            out += ["--model-suspend", "--sleep-idle-seconds", argv[i + 1]]
            i += 2
        elif flag in ("--model", "-m", "--hf-repo", "-hf", "--hf-file", "--models-dir", "--models-preset",
                      "--model-url", "--model-draft"):
            if not has_value:
                raise ShimError(f"{flag} needs a value")
            source.setdefault(flag, []).append(argv[i + 1])
            i += 2
        elif flag in DROPPED_VALUE:
            i += 2
        elif flag in DROPPED_BOOL:
            i += 1
        else:
            raise ShimError(f"unsupported llama-server flag {flag!r}")
    return out, source


def preset_value_key(key: str) -> str | None:
    """A llama.cpp preset key as a `ninfer serve` preset key (None: dropped)."""
    flag = "--" + key if len(key) > 2 else "-" + key
    if key in DROPPED_PRESET_KEYS or flag in DROPPED_VALUE or flag in DROPPED_BOOL:
        return None
    if flag in VALUE_FLAGS:
        return (VALUE_FLAGS[flag] or flag).lstrip("-")
    if flag == "--sleep-idle-seconds":
        return key
    return key  # a key `ninfer serve` knows or refuses with its own message


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def router_preset(work: Path, user_preset: str | None) -> Path:
    """The router's catalog: the harness's cache ids, then the sections of its own preset with
    their `hf-repo` resolved to ninfer-tiny.

    The cache ids stand for llama.cpp's Hugging Face cache, which only this shim has (NInfer's
    counterpart, --models-dir, names a model by its file stem, and these ids hold `/` and `:`), so
    dedup-cache-models is applied to them here, by NInfer's rule for --models-dir
    (ninfer_core/router/catalog.py): a cache entry that a section with the key names (its hf-repo,
    or its spec-draft-hf, whose draft NInfer does not load) is no model of its own but an alias of
    that section's model."""
    out = configparser.ConfigParser(interpolation=None, default_section="\x00none")
    out.optionxform = str
    cp = configparser.ConfigParser(interpolation=None, default_section="\x00none", comment_prefixes=(";", "#"))
    cp.optionxform = str
    if user_preset:
        cp.read(user_preset, encoding="utf-8")  # a preset removed meanwhile reads as empty
    common_dedup = cp["*"].get("dedup-cache-models") if cp.has_section("*") else None
    folded: dict[str, list[str]] = {}
    for name in cp.sections():
        if name != "*" and _true(cp[name].get("dedup-cache-models", common_dedup)):
            for key in ("hf-repo", "hf", "spec-draft-hf"):
                if cp[name].get(key):
                    folded.setdefault(name, []).append(map_repo(cp[name][key].strip()))
    hidden = {cache_id for ids in folded.values() for cache_id in ids}
    for cache_id in CACHE_IDS.values():
        if cache_id not in hidden:
            out[cache_id] = {"model": str(TINY)}
    if user_preset:
        for name in cp.sections():
            sec: dict[str, str] = {}
            for key, value in cp[name].items():
                key = key.strip()
                if key in ("hf-repo", "hf"):
                    map_repo(value.strip())
                    sec["model"] = str(TINY)
                elif key in ("model", "m"):
                    sec["model"] = value if value.endswith(".ninfer") else str(TINY)
                elif key == "sleep-idle-seconds":
                    sec["model-suspend"] = "true"
                    sec[key] = value
                elif (mapped := preset_value_key(key)) is not None:
                    sec[mapped] = value
                else:
                    note(f"{user_preset} [{name}]: {key} has no NInfer counterpart; dropped")
            if folded.get(name):
                sec["alias"] = ", ".join([*(a.strip() for a in sec.get("alias", "").split(",") if a.strip()),
                                          *folded[name]])
            out[name] = sec
    path = work / "router-preset.ini"
    with open(path, "w", encoding="utf-8") as f:
        out.write(f)
    return path


def serve_argv(argv: list[str], work: Path) -> tuple[list[str], str | None]:
    """(the `ninfer serve` arguments, the harness's own preset a router's catalog comes from)."""
    options, source = translate_flags(argv)
    # The harness's models do not reason, and its stream checks read every delta's content;
    # ninfer-tiny's template opens a thinking block unless told not to.
    fixed = ["--device", "cpu", "--log-stats-interval-ms", "0", "--no-thinking"]
    single = source.get("--model") or source.get("-m") or source.get("--hf-repo") or source.get("-hf") \
        or source.get("--model-url")
    if source.get("--model-draft"):
        raise ShimError("--model-draft: draft models are not mapped (NInfer drafts with --spec)")
    if single:
        model = single[-1]
        if "--model-url" in source:
            raise ShimError("--model-url: nothing is downloaded")
        if "--hf-repo" in source or "-hf" in source:
            repo = model.split(":", 1)[0]
            if repo not in KNOWN_FILE_REPOS or not (source.get("--hf-file")):
                map_repo(model)
            artifact = str(TINY)
        else:
            artifact = model if model.endswith(".ninfer") else str(TINY)
        return [artifact, *options, *fixed], None
    user_preset = (source.get("--models-preset") or [None])[-1]
    preset = router_preset(work, user_preset)
    routed = ["--models-preset", str(preset)]
    if source.get("--models-dir"):
        routed += ["--models-dir", source["--models-dir"][-1]]
    return [*options, *routed, *fixed], user_preset


def retranslate_on_read(work: Path, user_preset: str | None) -> None:
    """Each time NInfer's router reads its preset (at startup, and again for GET /models?reload=1)
    the shim's translation of the harness's preset is written anew first, so a reload sees the
    harness's edits as llama.cpp's router would. The translation is the one done at startup; only
    its timing moves to the read (this is why the shim runs the server in its own process instead
    of exec'ing it)."""
    from ninfer_core.router import catalog

    generated = (work / "router-preset.ini").resolve()
    original = catalog.read_preset

    def read_preset(path: str):
        if Path(path).resolve() == generated:
            try:
                router_preset(work, user_preset)
            except ShimError as e:
                raise catalog.CatalogError(str(e)) from None
        return original(path)

    catalog.read_preset = read_preset


def main(argv: list[str]) -> int:
    work_root = os.environ.get("NINFER_SHIM_WORK")
    work = Path(tempfile.mkdtemp(prefix="shim-", dir=work_root))
    try:
        args, user_preset = serve_argv(argv, work)
    except ShimError as e:
        note(f"error: {e}")
        return 1
    if os.environ.get("LLAMA_SERVER_DEBUG_FAKE_TIMING"):
        # llama.cpp's router then waits 2 s before each load and inside each routed request, so
        # its queue tests can hold a model busy; NInfer's router does the same under its own name.
        os.environ["NINFER_DEBUG_FAKE_TIMING"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
    for stream in (sys.stdout, sys.stderr):  # the harness reads the server's output as it comes
        stream.reconfigure(line_buffering=True)
    shown = ["***" if i and args[i - 1] == "--api-key" else a for i, a in enumerate(args)]
    note("ninfer serve " + " ".join(shown))  # the key stays out of the log
    os.chdir(REPO)
    sys.path.insert(0, str(REPO))  # this checkout's ninfer_core, as `python -m` from REPO would import
    # The server runs in this process (the harness's SIGTERM and kill reach it, no wrapper is
    # left behind), so the preset can be translated again on each read.
    if "--models-preset" in args:
        retranslate_on_read(work, user_preset)
    from ninfer_core.cli import main as ninfer_main

    return ninfer_main(["serve", *args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
