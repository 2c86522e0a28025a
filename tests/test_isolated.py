"""The fresh interpreters tests run code in (conftest.run_isolated, tests/child.py): a child
function of a tests module, given its arguments through JSON, in this checkout."""

from __future__ import annotations

import json
import os
import sys

import pytest

from .conftest import ROOT, child_command, run_isolated


def child_report_where(number: int, words: list[str], flags: dict[str, bool]) -> None:
    import pyacl_moe
    import tests

    print(json.dumps({"args": [number, words, flags], "pyacl_moe": pyacl_moe.__file__, "tests": tests.__file__,
                      "path0": sys.path[0], "cwd": os.getcwd(), "env": os.environ.get("PYACL_MOE_TEST_CHILD")}))


def child_fail(message: str) -> None:
    raise SystemExit(message)


def test_a_child_runs_this_checkouts_code_with_its_arguments():
    r = run_isolated(child_report_where, 3, ("a", "b"), {"yes": True}, env={"PYACL_MOE_TEST_CHILD": "set"})
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["args"] == [3, ["a", "b"], {"yes": True}]  # (a tuple arrives as a list)
    assert got["pyacl_moe"] == str(ROOT / "pyacl_moe" / "__init__.py")
    assert got["tests"] == str(ROOT / "tests" / "__init__.py")
    assert got["path0"] == got["cwd"] == str(ROOT)
    assert got["env"] == "set"


def test_a_failing_child_exits_non_zero_with_its_message():
    r = run_isolated(child_fail, "no good", env={"PYACL_MOE_TEST_CHILD": None})
    assert r.returncode == 1 and r.stderr.strip() == "no good"


def test_only_module_level_functions_of_tests_modules_are_children():
    def nested() -> None:
        pass

    with pytest.raises(ValueError, match="module-level"):
        child_command(nested)
    with pytest.raises(ValueError, match="module-level"):
        child_command(json.dumps)
