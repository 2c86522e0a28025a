"""The conformance harness passes on a correct op and catches wrong ones."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

import pyacl_moe as pm
from pyacl_moe import cli
from pyacl_moe.tools import conformance


@pytest.fixture
def clean_emulator():
    yield
    pm.emulator.set_mutation(None)
    pm.emulator.clear_faults()


def test_quick_profile_passes_and_covers_the_catalogue(device):
    report = conformance.run("quick", progress=None)
    assert report.ok, report.table()
    kinds = {c.kind for c in report.cases}
    assert kinds == {"positive", "negative", "determinism"}
    combos = {(c.dtype, c.scenario) for c in report.cases if c.kind == "positive"}
    assert combos >= {(d, s) for d in conformance.DTYPES for s in conformance.SCENARIOS}
    names = {c.name for c in report.cases}
    for expected in ("neg-null-out", "neg-x-4d-huge", "neg-top-k-0", "dropless-bfloat16-strided",
                     "drop-pad-float16-all-dropped", "active-float32-mostly-skipped",
                     "determinism-bfloat16-k128", "dropless-float16-overflow"):
        assert expected in names


@pytest.mark.parametrize("mutation", pm.emulator.MUTATIONS)
def test_each_wrong_kernel_fails_and_is_named(device, clean_emulator, mutation):
    pm.emulator.set_mutation(mutation)
    report = conformance.run("quick", progress=None)
    assert not report.ok
    failed = [c for c in report.cases if not c.passed]
    assert all(c.kind in ("positive", "determinism") for c in failed)
    assert any(c.name.startswith("dropless-float32") for c in failed)
    assert "FAILED dropless-float32" in report.table()


def test_weakened_validation_fails_the_negative_cases(device, clean_emulator):
    pm.emulator.weaken_validation()
    report = conformance.run("quick", name_filter="neg-", progress=None)
    failed = {c.name for c in report.cases if not c.passed}
    # Null pointers are still refused; every dtype, layout and tiling refusal is gone.
    assert "neg-x-float64" in failed and "neg-top-k-0" in failed and "neg-out-rows-differ" in failed
    assert "neg-null-out" not in failed
    bad = next(c for c in report.cases if c.name == "neg-top-k-0")
    assert bad.status == 0 and bad.expected_status == 561002


def test_reports_json_and_junit(device, tmp_path):
    report = conformance.run("quick", name_filter="tiny", progress=None)
    j, x = tmp_path / "r.json", tmp_path / "r.xml"
    report.write_json(str(j))
    report.write_junit(str(x))
    data = json.loads(j.read_text())
    assert {"backend", "cann_version", "soc", "passed", "failed", "cases"} <= set(data)
    assert data["backend"] == "emulator" and data["failed"] == 0 and data["passed"] == len(data["cases"]) == 9
    case = data["cases"][0]
    assert {"name", "kind", "passed", "max_abs_error", "max_rel_error", "mismatches"} <= set(case)
    suite = ET.parse(x).getroot()
    assert suite.tag == "testsuite" and suite.get("tests") == "9" and suite.get("failures") == "0"
    assert len(suite.findall("testcase")) == 9


def test_junit_marks_failures(device, clean_emulator, tmp_path):
    pm.emulator.set_mutation("skip-last-k")
    report = conformance.run("quick", name_filter="h16", progress=None)
    report.write_junit(str(tmp_path / "r.xml"))
    suite = ET.parse(tmp_path / "r.xml").getroot()
    assert int(suite.get("failures")) == report.failed > 0
    assert suite.find("testcase/failure") is not None


def test_cli_exit_status_and_filter(device, clean_emulator, tmp_path, capsys):
    args = ["--emulator", "conformance", "--quick", "--filter", "small", "--report", str(tmp_path / "r.json")]
    assert cli.main(args) == 0, capsys.readouterr()
    assert "passed, 0 failed" in capsys.readouterr().out
    assert all("small" in c["name"] for c in json.loads((tmp_path / "r.json").read_text())["cases"])
    pm.emulator.set_mutation("off-by-one-row")
    assert cli.main(args) == 1
    assert "FAILED" in capsys.readouterr().out


def test_full_profile_adds_large_shapes():
    quick = {c.name for c in conformance.catalogue("quick")}
    full = {c.name for c in conformance.catalogue("full")}
    assert quick < full and any("512mib" in n for n in full - quick)
