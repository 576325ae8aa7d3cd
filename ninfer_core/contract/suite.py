"""The contract tests, collected by the pytest plugin (`ninfer_core.testing`) under every conftest
that declares `ninfer_contract`, once per case there. Not a test file of its own: its tests only run
parametrised by a plugin package's cases."""

from __future__ import annotations

import pytest

from ninfer_core.contract import ContractError, RunnerContract, SpecContract
from ninfer_core.contract.plugin_rules import options_parsed, spec_greedy_unchanged, spec_proposals_in_bounds
from ninfer_core.contract.runner_rules import RUNNER_RULES, Harness

_DIRS = pytest.StashKey[dict]()


def _cases(node) -> dict:
    while node is not None and not hasattr(node, "contract_cases"):
        node = node.parent
    return node.contract_cases if node is not None else {}


def pytest_generate_tests(metafunc):
    if "contract_case" not in metafunc.fixturenames:
        return
    kinds = getattr(metafunc.function, "contract_kinds", ())
    cases = [(cid, c) for cid, c in _cases(metafunc.definition).items() if isinstance(c, kinds)]
    metafunc.parametrize("contract_case", cases, ids=[cid for cid, _ in cases])


def kinds(*types):
    def mark(fn):
        fn.contract_kinds = types
        return fn
    return mark


def run_rule(rule: str, case: str, check) -> None:
    """Run one rule's check; an exception the plugin raised becomes a ContractError naming the rule
    (a skip passes through: it is not an Exception)."""
    try:
        check()
    except ContractError:
        raise
    except Exception as e:
        raise ContractError(rule, case, f"the plugin raised {type(e).__name__}: {e}") from e


def _workdir(request, contract_case):
    """One directory per case and conftest for the whole session (a case builds its artifact there
    once). A plain function, not a fixture: pytest parses one module object's fixtures only once, and
    this module is collected under several conftests."""
    dirs = request.config.stash.setdefault(_DIRS, {})
    key = (request.node.parent.nodeid, contract_case[0])
    if key not in dirs:
        dirs[key] = request.getfixturevalue("tmp_path_factory").mktemp("contract-" + contract_case[0])
    return dirs[key]


def _runner_rule(name):
    @kinds(RunnerContract)
    def test(contract_case, request):
        cid, contract = contract_case
        run_rule(name, cid, lambda: RUNNER_RULES[name](Harness(contract, cid, _workdir(request, contract_case))))

    test.__name__ = test.__qualname__ = "test_contract_" + name.replace("-", "_")
    test.__doc__ = f"Contract rule {name!r} (ninfer_core.contract.RULES)."
    return test


for _name in RUNNER_RULES:
    globals()["test_contract_" + _name.replace("-", "_")] = _runner_rule(_name)


@kinds(RunnerContract, SpecContract)
def test_contract_options_parsed(contract_case):
    run_rule("options-parsed", contract_case[0], lambda: options_parsed(contract_case[1], contract_case[0]))


@kinds(SpecContract)
def test_contract_spec_proposals_in_bounds(contract_case, request):
    run_rule("spec-proposals-in-bounds", contract_case[0], lambda: spec_proposals_in_bounds(
        contract_case[1], contract_case[0], _workdir(request, contract_case)))


@kinds(SpecContract)
def test_contract_spec_greedy_unchanged(contract_case, request):
    run_rule("spec-greedy-unchanged", contract_case[0], lambda: spec_greedy_unchanged(
        contract_case[1], contract_case[0], _workdir(request, contract_case)))
