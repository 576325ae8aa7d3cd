"""The plugin contract suite (ninfer_core.contract) on core's own double: ToyRunner keeps every
rule, and a runner or backend broken in one way fails exactly the rule about it, by name."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from ninfer_core.contract import RULES, ContractError, RunnerContract, SpecContract
from ninfer_core.contract.plugin_rules import options_parsed, spec_greedy_unchanged, spec_proposals_in_bounds
from ninfer_core.contract.runner_rules import RUNNER_RULES, Harness
from ninfer_core.contract.suite import run_rule
from ninfer_core.engine.model_api import DECODE, PREFILL, VERIFY
from ninfer_core.engine.spec import Proposal
from ninfer_core.testing import OracleDrafter, ToyRunner


def check(rule, runner_cls=ToyRunner, tmp_path=None):
    contract = RunnerContract(lambda d: runner_cls(vocab_size=300), page_size=8)
    run_rule(rule, "toy", lambda: RUNNER_RULES[rule](Harness(contract, "toy", tmp_path)))


@pytest.mark.parametrize("rule", list(RUNNER_RULES))
def test_the_toy_runner_keeps_every_runner_rule(rule, tmp_path):
    check(rule, tmp_path=tmp_path)


def _noisy(when):
    class Noisy(ToyRunner):
        def forward(self, batch):
            outs = super().forward(batch)
            for seg, o in zip(batch.segments, outs):
                if o.logits is not None and when(seg, batch):
                    o.logits = o.logits + 0.5
            return outs
    return Noisy


class KeepsEverything(ToyRunner):
    def commit(self, kept):  # ignores n: the whole verify stays
        super().commit([(slot, len(self._uncommitted[slot])) for slot, _ in kept])


class ForgetsVerifies(ToyRunner):
    def forward(self, batch):
        outs = super().forward(batch)
        self._uncommitted.clear()
        return outs


class DropsRestore(ToyRunner):
    def restore_state(self, image, slot):
        super().restore_state(image, slot)
        self.state[slot, 1] += 1  # a wrong hash: the prefix read back disagrees


class SnapshotsTheEnd(ToyRunner):
    def forward(self, batch):
        for seg in batch.segments:  # the snapshot taken after the whole chunk instead of after `at`
            if seg.snapshot is not None:
                seg.snapshot = (len(seg.tokens) - 1, seg.snapshot[1])
        return super().forward(batch)


class Float64(ToyRunner):
    def forward(self, batch):
        outs = super().forward(batch)
        for o in outs:
            o.logits = None if o.logits is None else o.logits.double()
        return outs


BROKEN = {
    "prefill-equals-chunked-prefill": _noisy(lambda s, b: s.kind == PREFILL and s.start > 0),
    "decode-equals-prefill": _noisy(lambda s, b: s.kind == DECODE),
    "batch-invariance": _noisy(lambda s, b: len(b.segments) > 1),
    "verify-commit-rollback": KeepsEverything,
    "uncommitted-verify-refused": ForgetsVerifies,
    "capture-restore-equals-recompute": DropsRestore,
    "snapshot-equals-prefix": SnapshotsTheEnd,
    "cpu-reference-path": Float64,
}


@pytest.mark.parametrize("rule", list(BROKEN))
def test_a_runner_broken_one_way_fails_that_rule_by_name(rule, tmp_path):
    with pytest.raises(ContractError) as ei:
        check(rule, BROKEN[rule], tmp_path)
    assert ei.value.rule == rule and str(ei.value).startswith(f"contract rule {rule!r} broken by toy")
    assert RULES[rule] in str(ei.value)


def test_every_rule_has_a_broken_runner_or_backend_test():
    assert set(RUNNER_RULES) == set(BROKEN)
    assert set(RULES) == set(RUNNER_RULES) | {"options-parsed", "spec-proposals-in-bounds", "spec-greedy-unchanged"}


OPTIONS_SRC = """
from ninfer_core import hookimpl

@hookimpl
def ninfer_add_serve_options(add):
    add("--toy-width", type=int, default=4, help="width")
    add("--toy-fast", action="store_true", help="fast")
    add("--toy-mode", choices=["a", "b"], default="a", help="mode")
    {extra}
"""


@pytest.fixture
def options_plugin(monkeypatch):
    import types

    def make(extra=""):
        mod = types.ModuleType("toy_options.plugin")
        exec(textwrap.dedent(OPTIONS_SRC.format(extra=extra)), mod.__dict__)  # noqa: S102 - a plugin module made in the test
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        return RunnerContract(lambda d: None, plugin=mod.__name__)

    return make


def test_declared_options_parse(options_plugin):
    options_parsed(options_plugin(), "toy")


@pytest.mark.parametrize("extra, says", [
    ('add("--toy-name", default=None, help="a name")', "--toy-name has no default, choices or example"),
    ('add("--toy-quiet", action="store_true")', "--toy-quiet has no help text"),
    ('add("--toy-level", type=int, default="high", help="level")', "--toy-level default 'high' does not parse"),
])
def test_an_option_that_cannot_parse_fails_the_options_rule(options_plugin, extra, says):
    with pytest.raises(ContractError, match="'options-parsed'") as ei:
        run_rule("options-parsed", "toy", lambda: options_parsed(options_plugin(extra), "toy"))
    assert says in str(ei.value)


def test_an_example_value_makes_an_option_without_default_parse(options_plugin):
    contract = options_plugin('add("--toy-name", default=None, help="a name")')
    contract.option_examples = {"--toy-name": ["x"]}
    options_parsed(contract, "toy")


def _oracle(k=3, runner_cls=ToyRunner, propose=None):
    def load(workdir):
        target = runner_cls()
        backend = OracleDrafter(ToyRunner().greedy_continuation, draft_tokens=k, corrupt=0.3, seed=1)
        if propose is not None:
            backend.propose = propose
        return target, backend
    return SpecContract(load, max_tokens=12)


def test_an_oracle_drafter_keeps_the_backend_rules(tmp_path):
    spec_proposals_in_bounds(_oracle(), "oracle", tmp_path)
    spec_greedy_unchanged(_oracle(), "oracle", tmp_path)


def test_a_backend_proposing_past_max_drafts_fails_by_name(tmp_path):
    def greedy(lanes):
        return [Proposal([1] * (lane.max_drafts + 1)) for lane in lanes]

    with pytest.raises(ContractError, match="'spec-proposals-in-bounds'.*drafts for a lane allowed"):
        spec_proposals_in_bounds(_oracle(propose=greedy), "oracle", tmp_path)


def test_a_target_whose_verify_differs_fails_greedy_unchanged(tmp_path):
    # verify rows reversed over the vocabulary: the round accepts and emits other tokens than decoding
    class Scrambled(ToyRunner):
        def forward(self, batch):
            outs = super().forward(batch)
            for seg, o in zip(batch.segments, outs):
                if seg.kind == VERIFY and o.logits is not None:
                    o.logits = torch.flip(o.logits, dims=[-1])
            return outs

    with pytest.raises(ContractError, match="'spec-greedy-unchanged'.*differs from plain greedy"):
        spec_greedy_unchanged(_oracle(runner_cls=Scrambled), "oracle", tmp_path)


def test_the_pytest_plugin_collects_the_suite_under_a_declaring_conftest(tmp_path):
    """`-p ninfer_core.testing` and a conftest with `ninfer_contract`: the suite runs there, node ids
    under the conftest, one per rule and case, and a broken case fails naming its rule."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        from ninfer_core.contract import RunnerContract
        from ninfer_core.testing import ToyRunner

        class Chunky(ToyRunner):
            def forward(self, batch):
                outs = super().forward(batch)
                for seg, o in zip(batch.segments, outs):
                    if seg.kind == "prefill" and seg.start > 0 and o.logits is not None:
                        o.logits = o.logits + 1
                return outs

        ninfer_contract = {"good": RunnerContract(lambda d: ToyRunner(), page_size=8),
                           "chunky": RunnerContract(lambda d: Chunky(), page_size=8)}
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "ninfer_core.testing", "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path)], capture_output=True, text=True, timeout=300, check=False,
                          cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "FAILED conftest.py::test_contract_prefill_equals_chunked_prefill[chunky]" in out, out
    assert "contract rule 'prefill-equals-chunked-prefill' broken by chunky" in out
    assert "1 failed, 15 passed, 2 skipped" in out, out


def test_declaring_conftests_named_on_the_command_line_are_each_collected_once(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "conftest.py").write_text(textwrap.dedent("""
            from ninfer_core.contract import RunnerContract
            from ninfer_core.testing import ToyRunner

            ninfer_contract = {"toy": RunnerContract(lambda d: ToyRunner(), page_size=8)}
        """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "ninfer_core.testing", "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "a/conftest.py", "b/conftest.py"], capture_output=True,
                          text=True, timeout=300, check=False, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "16 passed, 2 skipped" in out, out
