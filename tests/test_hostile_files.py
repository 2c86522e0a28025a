"""Case files and names from elsewhere: every cell that is not a small literal of its kind is a
one-line CaseFileError naming file, row and column, before anything is computed from it; the
reports stay well-formed (JUnit XML), inert in a spreadsheet (CSV) and on a terminal (the
table) whatever a case is called; the emulator's fault injection refuses bad arguments by name.
The sweeps at the end mutate thousands of rows and names at random (seeded)."""

from __future__ import annotations

import csv
import os
import random
import re
import threading
import xml.etree.ElementTree as ET

import pytest

import pyacl_moe as pm
from pyacl_moe.tools import conformance, kitcases

from .test_conformance_kit import BACKWARD_ROWS, FORWARD_ROWS, HEADER, _write

CELL = re.compile(r"row (\d+), column ([a-z_]+): ")


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and "\r" not in text and len(text) < 1200, text[:2000]
    return text


@pytest.mark.parametrize("cell, why", [
    ("100000000000000000000000", "out of range"),  # 10**23 written out: an OverflowError traceback before
    ("10**23", "unexpected '**23'"),
    ("-" * 30000 + "1", "longer than 4096 characters"),  # the compiler ran out of memory on it
    ("-" * 4000 + "1", "unexpected"),
    ("(" * 200 + ")" * 200, "nested deeper than 4"),
    ("((3000000000, 4), (8,), (4, 4))", "too large"),
    ("((65536, 65536, 65536), (8,), (4, 4))", "too large"),
    ("[" + "1," * 5000 + "]", "longer than 4096"),
    ("(" + "1," * 1100 + ")", "more than 1024 values"),
    ("__import__('os')", "unexpected"),
])
def test_a_hostile_shape_cell_is_one_line_naming_file_row_and_column(tmp_path, cell, why):
    row = BACKWARD_ROWS[3].replace('"((8, 4), (8,), (8, 4),)"', '"' + cell + '"', 1)
    path = _write(tmp_path / "x.csv", [row])
    with pytest.raises(kitcases.CaseFileError) as info:
        kitcases.load([path])
    text = _one_line(info.value)
    assert f"{path}: row 2, column tensor_view_shapes: " in text and why in text, text


def test_a_hostile_attribute_is_refused_before_it_reaches_the_op(tmp_path):
    row = BACKWARD_ROWS[3].replace("{'topK': 1}", "{'topK': 99999999999999999999}", 1)
    with pytest.raises(kitcases.CaseFileError, match="row 2, column attributes: .*out of range"):
        kitcases.load([_write(tmp_path / "x.csv", [row])])


def _result(name: str, outcome: str = "fail", detail: str = "") -> conformance.CaseResult:
    r = conformance.CaseResult(name, "positive", "float32", "dropless", "((8, 4), (8,))", outcome == "pass",
                               detail=detail or f"why {name}", attributes=name)
    r.outcome = outcome
    return r


HOSTILE_NAMES = ["case\x1b[31mred", "nul\x00byte", "bell\x07", "=HYPERLINK(\"http://x\",\"y\")", "+1+2", "-2-1",
                 "@SUM(A1)", "\tTab", "\rCR", "surrogate\ud800", "\ufffe", "line\nbreak", "c1\x9bcontrol", "ok"]


def _report(names: list[str]) -> conformance.Report:
    outcomes = ("fail", "error", "pass", "skipped", "differs")
    return conformance.Report("emulator", "9.0.0", "Ascend910B3", "quick", 0,
                              [_result(n, outcomes[i % len(outcomes)], detail=n) for i, n in enumerate(names)])


def _check_reports(report: conformance.Report, folder, names: list[str]) -> None:
    xml, table = folder / "r.xml", folder / "r.csv"
    report.write_junit(str(xml))
    root = ET.parse(xml).getroot()  # well-formed, whatever the names
    assert len(root.findall("testcase")) == len(names)
    report.write_csv(str(table))
    with open(table, newline="") as f:
        rows = list(csv.reader(f))
    for row in rows[1:]:
        for cell in row:
            assert cell[:1] not in ("=", "+", "-", "@", "\t", "\r"), row
    shown = report.table()
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f]", shown), repr(shown)


def test_the_junit_report_is_well_formed_for_any_case_name(tmp_path):
    _report(HOSTILE_NAMES).write_junit(str(tmp_path / "r.xml"))
    names = [tc.get("name") for tc in ET.parse(tmp_path / "r.xml").getroot().findall("testcase")]
    assert names[0] == "case\\x1b[31mred" and names[1] == "nul\\x00byte" and names[-1] == "ok", names


def test_the_csv_report_neutralises_what_a_spreadsheet_would_run(tmp_path):
    _report(HOSTILE_NAMES).write_csv(str(tmp_path / "r.csv"))
    with open(tmp_path / "r.csv", newline="") as f:
        names = [row[0] for row in list(csv.reader(f))[1:]]
    assert names[3:8] == ["'=HYPERLINK(\"http://x\",\"y\")", "'+1+2", "'-2-1", "'@SUM(A1)", "'\tTab"], names


def test_the_terminal_table_shows_control_characters_escaped(tmp_path):
    shown = _report(HOSTILE_NAMES).table()
    assert "case\\x1b[31mred" in shown and "\x1b" not in shown and "\x07" not in shown


def test_every_report_holds_every_hostile_name(tmp_path):
    _check_reports(_report(HOSTILE_NAMES), tmp_path, HOSTILE_NAMES)


@pytest.mark.parametrize("kwargs, parameter", [
    ({"api": None}, "api"), ({"api": ""}, "api"), ({"api": 5}, "api"), ({"api": "aclrtMalloc\0x"}, "api"),
    ({"api": "aclrtMalloc", "status": 2**40}, "status"), ({"api": "aclrtMalloc", "status": True}, "status"),
    ({"api": "aclrtMalloc", "status": -1}, "status"), ({"api": "aclrtMalloc", "nth": 2**40}, "nth"),
    ({"api": "aclrtMalloc", "nth": 1.5}, "nth"),
])
def test_inject_fault_refuses_bad_arguments_by_name(emu, kwargs, parameter):
    with pytest.raises(pm.InvalidArgument) as info:
        pm.emulator.inject_fault(**kwargs)
    assert info.value.parameter == parameter
    pm.emulator.clear_faults()


# ---------------------------------------------------------------------------- sweeps

_PIECES = ["(", ")", "[", "]", "{", "}", ",", ":", "-", "+", "'", '"', "inf", "1e999", "9" * 30, "0", "-1",
           "True", "None", "\x00", "\x1b", "\n", "\r", "é", "\ud800", "**", "__import__", " ", "=", "@",
           "'topK'", "2", "(8, 4)", "((8, 4), (8,), (8, 4))", "lambda", "1_0", "0x1", ".5", "1.", "nan"]


def _mutated(rng: random.Random, text: str) -> str:
    """One random edit: insert, delete, replace or repeat a piece."""
    i = rng.randrange(len(text) + 1)
    kind = rng.randrange(5)
    if kind == 0:
        return text[:i] + rng.choice(_PIECES) + text[i:]
    if kind == 1:
        j = min(len(text), i + rng.randrange(1, 8))
        return text[:i] + text[j:]
    if kind == 2:
        j = min(len(text), i + rng.randrange(1, 8))
        return text[:i] + rng.choice(_PIECES) + text[j:]
    if kind == 3:
        return text[:i] + rng.choice(_PIECES) * rng.choice((2, 50, 800, 5000)) + text[i:]
    return text[:i] + str(rng.choice((2**31, 2**63, 10**23, -(2**63), 2**40))) + text[i:]


def test_a_sweep_of_mutated_rows_gives_a_case_or_one_line(tmp_path):
    """4,000 rows, each one to four random edits of a valid row: every file either loads or
    is refused with one line naming its file and row (and the column, for a cell)."""
    rng = random.Random(29)
    valid = BACKWARD_ROWS + FORWARD_ROWS
    loaded = refused = 0
    for _ in range(4000):
        row = rng.choice(valid)
        for _ in range(rng.randrange(1, 5)):
            row = _mutated(rng, row)
        path = tmp_path / "m.csv"
        try:
            path.write_text(HEADER + "\n" + row + "\n", errors="surrogatepass")
        except UnicodeEncodeError:
            continue
        try:
            kitcases.load([str(path)])
            loaded += 1
        except kitcases.CaseFileError as exc:
            text = _one_line(exc)
            assert text.startswith(f"{path}: "), text
            refused += 1
    assert loaded + refused > 3800 and refused > 2000 and loaded > 50, (loaded, refused)


def test_a_sweep_of_random_names_keeps_every_report_well_formed(tmp_path):
    """2,000 random names (control characters, formulas, surrogates, escapes) in one report."""
    rng = random.Random(290)
    alphabet = [chr(c) for c in (*range(0, 32), 127, *range(128, 160), 0xd800, 0xdfff, 0xfffe, 0xffff)] + \
        list("=+-@\t\r\"'<>&abc ")
    names = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 24))) + str(i) for i in range(2000)]
    _check_reports(_report(names), tmp_path, names)


def _fifo(path) -> str:
    os.mkfifo(path)
    return str(path)


def _in_time(fn, *args):
    """fn(*args), or a failure when it has not returned in 20 s (a read that blocks for good)."""
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(_raised(fn, *args)), daemon=True)
    t.start()
    t.join(20)
    assert got, f"{fn.__name__} blocked"
    return got[0]


def _raised(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # (returned, to be judged by the test)
        return exc


@pytest.mark.parametrize("name", ["cases.csv", "cases.json"])
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
def test_a_case_file_that_is_not_a_regular_file_is_one_line_never_a_hang(tmp_path, name, kind):
    """A FIFO blocked the read for good (its open waits for a writer); a link to /dev/zero read
    until memory ran out. Only a regular file is read."""
    path = tmp_path / name
    if kind == "fifo":
        _fifo(path)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)
    else:
        path.mkdir()
    exc = _in_time(kitcases.load, [str(path)])
    assert isinstance(exc, kitcases.CaseFileError), exc
    text = _one_line(exc)
    assert text.startswith(f"{path}: cannot read it (") and ("not a regular file" in text or "directory" in text), text


@pytest.mark.parametrize("name", ["cases.csv", "cases.json"])
def test_a_case_file_past_the_size_limit_is_refused_before_it_is_parsed(tmp_path, name):
    """A CSV was read whole into lists of cells, about 72 times its size in memory, and a JSON
    file of small objects under the old 64 MiB limit held 1.7 GiB while parsed: past
    MAX_CASE_FILE either is one line, before any parse."""
    path = tmp_path / name
    with open(path, "w") as f:
        f.write(HEADER + "\n" if name.endswith(".csv") else "[")
        f.write(("\n" if name.endswith(".csv") else "{},") * (kitcases.MAX_CASE_FILE + 1))
    text = _one_line(_in_time(kitcases.load, [str(path)]))
    assert text == f"{path}: larger than {kitcases.MAX_CASE_FILE} bytes", text


def test_a_csv_is_checked_row_by_row_and_the_first_bad_row_ends_the_read(tmp_path):
    rows = [BACKWARD_ROWS[0]] + ["x,y"] * 100_000
    exc = _in_time(kitcases.load, [_write(tmp_path / "x.csv", rows)])
    assert isinstance(exc, kitcases.CaseFileError) and "row 3: 2 cells for" in _one_line(exc), exc


@pytest.mark.parametrize("what", ["fifo", "deep", "dev-zero"])
def test_a_baseline_or_a_report_that_is_hostile_is_one_line(tmp_path, what):
    """--baseline and merge's reports: a FIFO blocked for good; a deeply nested document raised
    RecursionError out of load_baseline (a traceback); a link to /dev/zero read until memory ran out."""
    from pyacl_moe.tools import cluster
    path = tmp_path / "report.json"
    if what == "fifo":
        _fifo(path)
    elif what == "deep":
        path.write_text("[" * 200_000 + "]" * 200_000)
    else:
        os.symlink("/dev/zero", path)
    exc = _in_time(conformance.load_baseline, str(path))
    assert isinstance(exc, ValueError) and _one_line(exc).startswith(f"{path}: "), exc
    exc = _in_time(cluster.read_report, str(path))
    assert isinstance(exc, cluster.ClusterError) and _one_line(exc).startswith(f"{path}: "), exc
