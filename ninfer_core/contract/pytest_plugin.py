"""Collection of the contract suite (ninfer_core.contract.suite) under a plugin package's conftest.

A conftest.py with a module-level `ninfer_contract` dict gets the suite collected as if it were a
test module at that conftest's path: node ids read `.../tests/conftest.py::test_contract_RULE[case]`,
the conftest's fixtures apply, and `pytest path/to/tests` runs the contract beside the package's
own tests. Only cases whose type a test checks are collected (runner rules for `RunnerContract`,
backend rules for `SpecContract`)."""

from __future__ import annotations

import pytest

from ninfer_core.contract import RunnerContract, SpecContract


class ContractModule(pytest.Module):
    contract_cases: dict  # set by collect_file

    def _getobj(self):
        from ninfer_core.contract import suite

        return suite

    def collect(self):
        present = {type(c) for c in self.contract_cases.values()}
        for item in super().collect():
            kinds = getattr(getattr(item, "obj", None), "contract_kinds", None)
            if kinds is None or present.intersection(kinds):
                yield item


def collect_file(file_path, parent):
    """`pytest_collect_file`: a declaring conftest inside a collected directory."""
    if file_path.name != "conftest.py" or parent.session.isinitpath(file_path):
        return None  # a conftest named on the command line comes through make_module instead
    return _contract_module(file_path, parent)


def make_module(module_path, parent):
    """`pytest_pycollect_makemodule`: a declaring conftest named on the command line (pytest would
    otherwise import it a second time as a test module)."""
    if module_path.name != "conftest.py":
        return None
    return _contract_module(module_path, parent)


def _contract_module(file_path, parent):
    conftest = parent.config.pluginmanager.get_plugin(str(file_path))
    cases = getattr(conftest, "ninfer_contract", None)
    if not cases:
        return None
    bad = {k: type(v).__name__ for k, v in cases.items() if not isinstance(v, (RunnerContract, SpecContract))}
    if bad:
        raise pytest.UsageError(f"{file_path}: ninfer_contract values must be RunnerContract or SpecContract, got {bad}")
    module = ContractModule.from_parent(parent, path=file_path)
    module.contract_cases = dict(cases)
    return module
