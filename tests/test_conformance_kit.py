"""Conformance as the vendor's operator test kit judges: its case files (--cases), poisoned and
guarded memory, timing per case (--perf), its result table (--report-csv). The case files here
are written by the tests, in the kit's format."""

from __future__ import annotations

import csv
import json
import warnings

import pytest

import pyacl_moe as pm
from pyacl_moe.tools import conformance, kitcases, precision

HEADER = ("testcase_name,api_name,tensor_view_shapes,tensor_dtypes,attributes,precision_tolerances,"
          "absolute_precision,input_data_ranges,output_tensor_indexes")
BACKWARD_ROWS = [
    # dropless, repeated indices (drawn from the rows, as the vendor's golden draws them)
    '''kit_grad_dropless_bf16,aclnnMoeInitRoutingV2Grad,"((96, 33), (96,), (48, 33),)",'''
    '''"('bfloat16', 'int32', 'bfloat16',)","{'topK': 2, 'dropPadMode': 0, 'activeNum': 0}",'''
    '''"((0.001, 0.001),)",0.0001,"((-10, 10), (-100, 100))","(2,)"''',
    # active: rows past activeNum do not count
    '''kit_grad_active_fp16,aclnnMoeInitRoutingV2Grad,"((7, 64), (40,), (10, 64),)",'''
    '''"('float16', 'int32', 'float16',)","{'topK': 4, 'dropPadMode': 0, 'activeNum': 7}",'''
    '''"((0.001, 0.001),)",0.0001,"((2, 10), (-100, 100))","(2,)"''',
    # drop/pad: -1 from activeNum on
    '''kit_grad_droppad_fp32,aclnnMoeInitRoutingV2Grad,"((4, 5, 16), (24,), (8, 16),)",'''
    '''"('float32', 'int32', 'float32',)","{'topK': 3, 'dropPadMode': 1, 'activeNum': 15}",'''
    '''"((0.0001, 0.0001),)",0.0001,"((-1, 1), (-100, 100))","(2,)"''',
    # a constant input (low == high), the optional columns empty
    '''kit_grad_constant_fp32,aclnnMoeInitRoutingV2Grad,"((8, 4), (8,), (8, 4),)",'''
    '''"('float32','int32','float32')","{'topK': 1}",,,"((2, 2),)","(2,)"''',
]
FORWARD_ROWS = [
    '''kit_fwd_dropless_fp16,aclnnMoeInitRoutingV2,"((4,36), (4, 2),(8, 36),(8,),(5,),(5,))",'''
    '''"('float16', 'int32', 'float16', 'int32', 'int32', 'int32')",'''
    '''"{'activeNumOptional': 0, 'expertCapacityOptional': 0, 'expertNumOptional': 5, 'dropPadModeOptional': 0, '''
    '''\'expertTokensCountOrCumsumFlagOptional': 1, 'expertTokensBeforeCapacityFlagOptional': False}",'''
    '''"((0.001, 0.001),)",0.0001,,"(2,3,4,5)"''',
    '''kit_fwd_droppad_bf16,aclnnMoeInitRoutingV2,"((16,8), (16, 2), (4, 6, 8),(32,),(4,),(4,))",'''
    '''"('bfloat16', 'int32', 'bfloat16', 'int32', 'int32', 'int32')",'''
    '''"{'activeNumOptional': 0, 'expertCapacityOptional': 6, 'expertNumOptional': 4, 'dropPadModeOptional': 1, '''
    '''\'expertTokensCountOrCumsumFlagOptional': 0, 'expertTokensBeforeCapacityFlagOptional': True}",'''
    '''"((0.001, 0.001),)",0.0001,,"(2,3,4,5)"''',
]


def _write(path, rows, header=HEADER):
    path.write_text("\n".join([header, *rows]) + "\n")
    return str(path)


@pytest.fixture
def kit_files(tmp_path):
    return [_write(tmp_path / "grad.csv", BACKWARD_ROWS), _write(tmp_path / "fwd.csv", FORWARD_ROWS)]


def test_a_case_file_is_read_by_its_header_and_every_row_becomes_a_case(kit_files):
    cases = kitcases.load(kit_files)
    assert [c.name for c in cases] == [r.split(",")[0] for r in BACKWARD_ROWS + FORWARD_ROWS]
    assert [c.op for c in cases] == ["backward"] * 4 + ["forward"] * 2
    assert {c.scenario for c in cases if c.op == "backward"} == {"dropless", "active", "drop-pad"}
    assert {c.dtype for c in cases} == {"float32", "float16", "bfloat16"}


@pytest.mark.parametrize("standard", ["stat-rel-err", "mixed", "close"])
def test_the_rows_of_both_ops_pass_and_say_they_ran_outside_the_contract(device, kit_files, standard):
    report = conformance.run(cases=kitcases.load(kit_files), progress=None, standard=standard)
    assert report.ok, report.table()
    grad = [c for c in report.cases if c.op == "backward"]
    assert all(c.standard == standard and set(c.metrics) >= {"mere", "mare", "rmse"} for c in grad)
    assert all("host checks off" in c.detail and "row" in c.detail for c in grad)
    if standard == "close":  # the row's own (rtol, ptol) and atol
        assert grad[2].thresholds == {"rtol": 0.0001, "ptol": 0.0001, "atol": 0.0001}
        assert grad[3].thresholds == precision.thresholds("close", "float32")


def test_a_wrong_kernel_fails_the_rows(device, clean_emulator, kit_files):
    pm.emulator.set_mutation("off-by-one-row")
    report = conformance.run(cases=kitcases.load(kit_files[:1]), progress=None)
    outcome = {c.name: c.outcome for c in report.cases}
    assert outcome.pop("kit_grad_constant_fp32") == "pass"  # every row of a constant input is the same
    assert not report.ok and set(outcome.values()) == {"fail"}


@pytest.mark.parametrize("column, cell, says", [
    ("api_name", "aclnnSomethingElse", "column api_name: must be aclnnMoeInitRoutingV2Grad"),
    ("tensor_view_shapes", '"((96, 33), (96,))"', "column tensor_view_shapes: must give 3 shapes"),
    ("tensor_dtypes", '"(\'float8\',)"', "column tensor_dtypes: must give 1 or 3 of"),
    ("attributes", '"{\'top_k\': 2}"', "column attributes: must be a dict of topK"),
    ("attributes", '"{\'topK\': 2"', "column attributes: not a Python literal"),
    ("precision_tolerances", '"((0.001,),)"', "column precision_tolerances: must be (rtol, ptol) pairs"),
    ("absolute_precision", "-1", "column absolute_precision: must be a number >= 0"),
    ("input_data_ranges", '"((10, -10),)"', "column input_data_ranges: the first input's range"),
    # a width past the largest float: an OverflowError traceback of the uniform draw, once running
    ("input_data_ranges", '"((-1e308, 1e308),)"', "column input_data_ranges: the first input's range"),
])
def test_a_malformed_row_exits_2_naming_the_file_row_and_column_before_anything_runs(main, tmp_path, column, cell,
                                                                                      says):
    names = HEADER.split(",")
    good = next(csv.reader([BACKWARD_ROWS[0]]))
    bad = list(good)
    bad[names.index(column)] = next(csv.reader([cell]))[0]
    buf = tmp_path / "bad.csv"
    with open(buf, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(names)
        w.writerow(good)
        w.writerow(bad)
    code, out, err = main("--emulator", "conformance", "--cases", str(buf))
    assert code == 2, out + err
    assert f"{buf}: row 3, {says}" in err and "Traceback" not in err, err
    assert out == ""  # nothing ran


def test_a_malformed_number_is_one_error_without_the_compilers_warning(tmp_path):
    # "0.0001and" made the compiler print "<unknown>:1: SyntaxWarning: invalid decimal
    # literal" on stderr ahead of the file's one-line error.
    path = _write(tmp_path / "x.csv", [BACKWARD_ROWS[0].replace(",0.0001,", ",0.0001and,", 1)])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(kitcases.CaseFileError, match="row 2, column absolute_precision: not a Python literal"):
            kitcases.load([path])
    assert not [w for w in seen if issubclass(w.category, SyntaxWarning)], [str(w.message) for w in seen]


def test_a_file_without_the_required_columns_is_refused(tmp_path):
    path = _write(tmp_path / "x.csv", ["a,b"], header="testcase_name,api_name")
    with pytest.raises(kitcases.CaseFileError, match=r"x.csv: row 1, the header lacks the column\(s\) "
                                                     "tensor_view_shapes, tensor_dtypes, attributes"):
        kitcases.load([path])


@pytest.mark.parametrize("mutation", pm.emulator.MEMORY_MUTATIONS)
@pytest.mark.parametrize("standard", precision.STANDARD_NAMES)
def test_poisoned_memory_catches_an_unwritten_row_and_an_overrun_under_every_standard(
        device, clean_emulator, mutation, standard):
    pm.emulator.set_mutation(mutation)
    report = conformance.run("quick", name_filter="dropless-float32-small", progress=None, standard=standard)
    (case,) = report.cases
    assert case.outcome == "fail", report.table()
    if mutation == "overrun":
        assert case.memory_status == "oob" and "out was written outside its" in case.detail
    else:
        assert case.memory_status == "ok" and "left unwritten (they still hold the poison)" in case.detail


def test_the_emulator_passes_with_its_memory_checked(device):
    report = conformance.run("quick", name_filter="dropless-", progress=None)
    checked = [c.memory_status for c in report.cases if c.memory_status is not None]
    assert report.ok and len(checked) > 20 and set(checked) == {"ok"}


def test_perf_times_every_passing_case_and_the_csv_report_is_the_table(main, tmp_path):
    code, out, err = main("--emulator", "conformance", "--filter=-tiny", "--perf", "3", "--report",
                          str(tmp_path / "r.json"), "--report-csv", str(tmp_path / "r.csv"))
    assert code == 0, err
    data = json.loads((tmp_path / "r.json").read_text())
    passing = [c for c in data["cases"] if c["outcome"] == "pass"]
    assert passing and all(c["api_us"] > 0 and c["device_us"] >= 0 for c in passing)
    assert data["perf"] == 3 and "emulator" in data["timing_note"] and "emulator's" in out
    with open(tmp_path / "r.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(conformance.CSV_COLUMNS)
    assert [row["testcase_name"] for row in rows] == [c["name"] for c in data["cases"]]
    numeric = [row for row in rows if row["standard"]]
    assert numeric and all(row["precision_status"] == "PASS" and row["mere"] and row["api_us"] for row in numeric)


def test_a_baseline_lists_the_cases_whose_device_time_grew(device, tmp_path):
    old = conformance.run("quick", name_filter="dropless-float32-small", progress=None, perf=3)
    old.write_json(str(tmp_path / "old.json"))
    data = json.loads((tmp_path / "old.json").read_text())
    assert old.cases[0].device_us > 0
    # As if it had been a million times faster: a ratio no scheduling jitter of a loaded CI
    # machine reaches (a tenth was not enough there: the first run's median can be 10x the next's).
    data["cases"][0]["device_us"] = old.cases[0].device_us / 1e6
    (tmp_path / "old.json").write_text(json.dumps(data))
    new = conformance.run("quick", name_filter="dropless-float32-small", progress=None, perf=3,
                          baseline=conformance.load_baseline(str(tmp_path / "old.json")), perf_threshold=1.2)
    (slow,) = new.baseline["slower"]
    assert slow["name"] == "dropless-float32-small" and slow["ratio"] > 1.2
    assert slow["baseline_device_us"] == data["cases"][0]["device_us"]
    assert new.ok and "SLOWER dropless-float32-small" in new.table()  # listed; the exit status stays


@pytest.mark.parametrize("flags, named, says", [
    (["--full"], "--full", "picks a profile of the catalogue; --cases runs the case files' rows instead"),
    (["--quick"], "--quick", "picks a profile of the catalogue"),
    (["--perf-threshold", "2"], "--perf-threshold", "give it with --baseline OLD.json and --perf N"),
])
def test_a_flag_that_would_change_nothing_is_refused_not_ignored(main, monkeypatch, tmp_path, flags, named, says):
    """conformance --cases f.csv --full took --full and ignored it (issue: papercuts, 13)."""
    def refuse(*a, **k):
        raise AssertionError("a case ran")

    monkeypatch.setattr(conformance, "run", refuse)
    path = _write(tmp_path / "k.csv", BACKWARD_ROWS[:1])
    code, out, err = main("--emulator", "conformance", "--cases", path, *flags)
    assert code == 2 and out == "", out + err
    assert err.startswith(f"pyacl-moe conformance: error: argument {named}: ") and err.count("\n") == 1, err
    assert says in err


FORWARD_ACTIVE_ROW = (
    '''kit_fwd_active_fp32,aclnnMoeInitRoutingV2,"((53,16), (53, 7),(61, 16),(371,),(9,),(9,))",'''
    '''"('float32', 'int32', 'float32', 'int32', 'int32', 'int32')",'''
    '''"{'activeNumOptional': 61, 'expertCapacityOptional': 0, 'expertNumOptional': 9, 'dropPadModeOptional': 0, '''
    '''\'expertTokensCountOrCumsumFlagOptional': 2, 'expertTokensBeforeCapacityFlagOptional': False}",'''
    '''"((0.001, 0.001),)",0.0001,,"(2,3,4,5)"''')


def test_a_forward_row_that_keeps_active_num_rows_is_active_as_the_backward_names_it(device, tmp_path):
    """A forward row with activeNum 61 of 371 rows was labelled dropless (issue: papercuts, 6)."""
    path = _write(tmp_path / "fwd.csv", [FORWARD_ACTIVE_ROW, FORWARD_ROWS[0]])
    cases = kitcases.load([path])
    assert [c.scenario for c in cases] == ["active", "dropless"]
    report = conformance.run(cases=cases, progress=None)
    assert report.ok, report.table()
    assert [c.scenario for c in report.cases] == ["active", "dropless"]
    assert "active  " in report.table().splitlines()[2]


def test_the_table_and_summary_say_which_rows_ran_with_the_host_checks_off_and_what_judged_each(device, kit_files):
    """The host checks were off only in the JSON; the summary said stat-rel-err where the column said
    reference and the forward's rows were judged exact (issue: papercuts, 5)."""
    report = conformance.run(cases=kitcases.load(kit_files), progress=None)
    table = report.table()
    rows = {line.split()[0]: line for line in table.splitlines()[2:8]}
    assert all(" stat-rel-err * " in rows[r.split(",")[0]] for r in BACKWARD_ROWS), table
    assert all(" exact " in rows[r.split(",")[0]] and "*" not in rows[r.split(",")[0]] for r in FORWARD_ROWS), table
    assert "* run with the binding's host checks off" in table
    summary = report.summary()
    assert "judged by stat-rel-err (4 cases), exact (2 cases)" in summary, summary
    assert "4 with the binding's host checks off (*)" in summary, summary
    assert [c.host_checks for c in report.cases] == [False] * 4 + [True] * 2
    assert all(c.as_dict()["host_checks"] is False for c in report.cases[:4])
