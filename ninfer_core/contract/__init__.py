"""The plugin contract suite: rules every model family and speculative backend must keep, run by a
plugin package on itself through the pytest plugin `ninfer_core.testing`.

A package's tests/conftest.py names what to check in a module-level `ninfer_contract` dict (case id
-> `RunnerContract` or `SpecContract`); the pytest plugin then collects this suite under that
conftest, parametrised by those cases, beside the package's own tests. Each failure is a
`ContractError` whose message starts with the broken rule's name (`RULES`), so a red CI line says
which promise of docs/plugins/model-family.md the plugin broke.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# rule name -> the promise, as a failure message states it
RULES: dict[str, str] = {
    "prefill-equals-chunked-prefill": "one prefill of a prompt gives the logits of the same prompt "
                                      "fed as several chunks",
    "decode-equals-prefill": "token-by-token decode gives the logits a prefill gives at each position",
    "batch-invariance": "a lane's logits do not depend on the other lanes of its forward",
    "capture-restore-equals-recompute": "a lane restored from capture_state + read_pages into another "
                                        "slot and pages continues as the recomputed prefix does",
    "snapshot-equals-prefix": "a prefill's in-chunk snapshot leaves in its slot the state of the first "
                              "`at` tokens: continuing from it (over copies of the pages) equals a prefill "
                              "of those tokens",
    "verify-commit-rollback": "a verify of k+1 tokens gives a prefill's logits, and after commit(n) the "
                              "lane continues as if only the first n had run",
    "uncommitted-verify-refused": "a forward touching a slot whose verify is not committed raises",
    "options-parsed": "every serve option the plugin declares parses in `ninfer serve` and reaches load()",
    "cpu-reference-path": "the runner loads and runs on the CPU, with fp32 logits of the vocabulary width",
    "spec-proposals-in-bounds": "a backend proposes at most max_drafts token ids of the vocabulary per lane",
    "spec-greedy-unchanged": "greedy output through the engine is the same with the backend as without",
}


class ContractError(AssertionError):
    """A broken contract rule; str() starts with `contract rule NAME broken`."""

    def __init__(self, rule: str, case: str, detail: str):
        if rule not in RULES:
            raise ValueError(f"unknown contract rule {rule!r}")
        self.rule, self.case = rule, case
        super().__init__(f"contract rule {rule!r} broken by {case}: {RULES[rule]}; {detail}")


@dataclass
class RunnerContract:
    """A model family's runner under test.

    `load(workdir)` returns a fresh `ModelRunner` on the CPU, cache not yet allocated (build any
    artifact into `workdir` once: it is the same directory for every call of one case). `plugin`
    is the plugin module whose serve options the options rule parses (None: no options rule).
    Tolerances are on the largest logit magnitude: |ours - reference| <= atol + rtol * max|reference|.
    """

    load: Callable[[Path], Any]
    plugin: str | None = None
    option_examples: dict[str, list[str]] = field(default_factory=dict)  # flag -> argv values to parse
    rtol: float = 1e-4
    atol: float = 1e-4
    prompt_tokens: int = 40  # crosses pages of `page_size`
    page_size: int = 16
    token_high: int | None = None  # draw prompt ids below this (None: the vocabulary)


@dataclass
class SpecContract:
    """A speculative backend under test: `load(workdir) -> (runner, backend)`, a fresh target
    runner (cache not allocated) and the backend loaded on it, as the server does."""

    load: Callable[[Path], tuple[Any, Any]]
    plugin: str | None = None
    option_examples: dict[str, list[str]] = field(default_factory=dict)
    prompt_tokens: int = 24
    max_tokens: int = 16
    token_high: int | None = None
