"""The conformance harness passes on a correct op and catches wrong ones."""

from __future__ import annotations

import io
import json
import socket
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe import cli
from pyacl_moe.tools import conformance, precision


def test_quick_profile_passes_and_covers_the_catalogue(device):
    report = conformance.run("quick", progress=None)
    assert report.ok, report.table()
    kinds = {(c.op, c.kind) for c in report.cases}
    assert kinds == {(op, kind) for op in ("backward", "forward") for kind in ("positive", "negative", "determinism")} \
        | {("pair", "adjoint"), ("pair", "round-trip")}
    combos = {(c.dtype, c.scenario) for c in report.cases if c.kind == "positive"}
    assert combos >= {(d, s) for d in conformance.DTYPES for s in conformance.SCENARIOS}
    names = {c.name for c in report.cases}
    for expected in ("neg-null-out", "neg-x-4d-huge", "neg-top-k-0", "dropless-bfloat16-strided",
                     "drop-pad-float16-all-dropped", "active-float32-mostly-skipped",
                     "determinism-bfloat16-k128", "dropless-float16-overflow"):
        assert expected in names


def _one_by_default(mutations, default):
    """Every mutation: ``default`` in the default run, the others in the slow step (each runs
    the quick catalogue)."""
    return [m if m == default else pytest.param(m, marks=pytest.mark.slow) for m in mutations]


@pytest.mark.parametrize("mutation", _one_by_default(pm.emulator.MUTATIONS, "skip-last-k"))
def test_each_wrong_kernel_fails_and_is_named(device, clean_emulator, mutation):
    pm.emulator.set_mutation(mutation)
    report = conformance.run("quick", progress=None)
    assert not report.ok
    failed = [c for c in report.cases if not c.passed]
    assert all(c.kind in ("positive", "determinism", "adjoint", "round-trip") for c in failed)
    assert not any(c.op == "forward" for c in failed)
    assert any(c.name.startswith("dropless-float32") for c in failed)
    assert "FAILED dropless-float32" in report.table()
    # The pair's identities, with no reference, catch it too: both kinds, every scenario.
    for kind in ("adjoint", "round-trip"):
        assert {c.scenario for c in failed if c.kind == kind} == set(conformance.SCENARIOS), kind
    # Every adjoint case fails where K >= 3 (two terms are rounded once in any precision).
    missed = [c.name for c in report.cases if c.kind == "adjoint" and c.passed]
    assert all(name.endswith(("-n3k2", "-wide")) for name in missed), missed


# All in the slow step: the backward's wrong kernel (below) keeps the default run's check that
# a mutation is caught, and test_reference_exact catches one against the model.
@pytest.mark.slow
@pytest.mark.parametrize("mutation", pm.emulator.FORWARD_MUTATIONS)
def test_each_wrong_forward_fails_its_cases_and_the_pair_catches_a_wrong_row(device, clean_emulator, mutation):
    pm.emulator.set_mutation(mutation)
    report = conformance.run("quick", progress=None)
    failed = [c for c in report.cases if not c.passed]
    assert not report.ok
    assert not any(c.op == "backward" for c in failed)
    assert any(c.op == "forward" and c.kind == "positive" and c.scenario == s for c in failed
               for s in ("dropless", "active", "drop-pad"))
    pair = {c.kind for c in failed if c.op == "pair"}
    if mutation == "fwd-wrong-row":
        assert pair == {"adjoint", "round-trip"}
        assert all(not c.passed for c in report.cases if c.op == "pair")
    else:
        # Equal ids in another order move rows and indices together: both identities hold
        # (docs/conformance.md); the reference sees it.
        assert pair == set()


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


# ---------------------------------------------------------------------------- sources and outcomes

def _fake(name: str, source: str, verdict: str) -> conformance.Case:
    """A case whose body passes, fails or crashes, as told."""

    def body(ctx):
        if verdict == "crash":
            raise RuntimeError("harness broke")
        return conformance.CaseResult(name, "negative", "float32", "-", "", verdict == "pass", detail="why")

    return conformance.Case(name, "negative", "float32", "-", "", body, source=source)


def test_a_miss_on_an_inferred_rule_differs_and_fails_only_under_strict(device):
    cases = [_fake("a", "op", "pass"), _fake("b", "nnopbase", "fail")]
    report = conformance.run(cases=cases, progress=None)
    assert [c.outcome for c in report.cases] == ["pass", "differs"]
    assert [c.source for c in report.cases] == ["op", "nnopbase"]
    assert report.ok and report.failed == 0
    assert "DIFFERS b: CANN differs from the inferred rule (nnopbase)" in report.table()
    strict = conformance.run(cases=cases, progress=None, strict=True)
    assert not strict.ok and strict.failed == 1


@pytest.mark.parametrize("source", ["op", "binding"])
def test_a_miss_on_a_documented_rule_fails(device, source):
    report = conformance.run(cases=[_fake("a", source, "fail")], progress=None)
    assert report.cases[0].outcome == "fail" and not report.ok
    assert "FAILED a: why" in report.table()


def test_a_crash_of_the_harness_is_an_error_not_a_failure(device):
    report = conformance.run(cases=[_fake("a", "op", "pass"), _fake("boom", "op", "crash")], progress=None)
    boom = report.cases[1]
    assert boom.outcome == "error" and "RuntimeError: harness broke" in boom.detail
    assert not report.ok and report.as_dict()["errors"] == 1 and report.as_dict()["failed"] == 0


def test_positive_and_determinism_cases_come_from_the_op():
    cases = conformance.catalogue("quick")
    # Except where a strided out's values land, which is the generic layer's (inferred up to 9.0).
    assert {c.source for c in cases if c.kind != "negative" and "strided-out" not in c.name} == {"op"}
    assert {c.source for c in cases if "strided-out" in c.name} == {"nnopbase"}
    assert all(c.source in conformance.SOURCES for c in cases)


# ---------------------------------------------------------------------------- exact mode

@pytest.mark.slow  # the default run checks the quick catalogue bit for bit in test_reference_exact
def test_quick_profile_passes_bit_for_bit_and_strict(device):
    # The reference models the kernel's summation order, so every result matches its bits.
    report = conformance.run("quick", progress=None, exact=True, strict=True)
    assert report.ok, report.table()
    # (A case whose indices make the kernel fault on this chip is judged by that status.)
    assert all(c.mismatches == 0 for c in report.cases if c.kind == "positive" and c.expected_status is None)


def test_exact_mode_passes_where_any_summation_order_gives_the_same_bits(device):
    # top_k <= 2: a sum of at most two terms has one rounding whatever the order.
    report = conformance.run(cases=[c for c in conformance.catalogue("quick")
                                    if c.kind == "positive" and ("-tiny" in c.name or "-small" in c.name
                                                                 or "-h510" in c.name or "overflow" in c.name)],
                             progress=None, exact=True)
    assert report.ok and report.exact and len(report.cases) == 30, report.table()
    assert all(c.mismatches == 0 for c in report.cases)


def test_exact_mode_fails_a_result_inside_the_tolerances(device, clean_emulator):
    # A float16 accumulator over K=8 terms stays within float16's tolerances on this case,
    # but does not keep every bit.
    pm.emulator.set_mutation("fp16-accumulate")
    name = "active-float16-h16"
    loose = conformance.run("quick", name_filter=name, progress=None, standard="pyacl")
    assert loose.ok and loose.cases[0].max_abs_error > 0, loose.table()
    exact = conformance.run("quick", name_filter=name, progress=None, exact=True)
    assert not exact.ok and "differ in their bits" in exact.cases[0].detail


def test_compare_exact_nan_payloads_match_and_the_sign_of_zero_counts():
    from pyacl_moe.tools.cases import compare_exact

    quiet = np.array([np.nan], np.float32)
    other = np.array([0x7FC00123], np.uint32).view(np.float32)  # another payload
    negative = np.array([0xFFC00000], np.uint32).view(np.float32)  # another sign
    assert compare_exact(other, quiet).passed and compare_exact(negative, quiet).passed
    assert not compare_exact(np.array([-0.0], np.float32), np.array([0.0], np.float32)).passed
    assert not compare_exact(np.array([np.nan], np.float32), np.array([np.inf], np.float32)).passed
    one_ulp = np.array([0x3C01], np.uint16).view(np.float16)
    res = compare_exact(one_ulp, np.array([1.0], np.float16))
    assert not res.passed and res.mismatches == 1 and res.exact


# ---------------------------------------------------------------------------- tolerances and memory

def test_tolerance_overrides_apply_to_their_dtype_only(device, clean_emulator):
    pm.emulator.set_mutation("fp16-accumulate")
    base = conformance.run("quick", name_filter="dropless-float32-k64", progress=None, standard="pyacl")
    assert base.cases[0].outcome == "fail"
    looser = conformance.run("quick", name_filter="-k64", progress=None, rtol={"float32": 0.1}, atol={"float32": 0.1},
                             standard="pyacl")
    outcome = {c.name: c.outcome for c in looser.cases}
    assert outcome["dropless-float32-k64"] == "pass" and outcome["dropless-bfloat16-k64"] == "fail"
    assert looser.standards["float32"]["rtol"] == 0.1 and looser.standards["float16"]["rtol"] == 1e-3


def test_max_memory_skips_the_large_cases(device):
    budget = 64 << 10
    report = conformance.run("quick", name_filter="dropless-bfloat16", progress=None, max_memory=budget)
    skipped = [c for c in report.cases if c.outcome == "skipped"]
    ran = [c for c in report.cases if c.outcome == "pass"]
    assert skipped and ran and report.ok
    assert all(c.nbytes > budget for c in skipped) and all(c.nbytes <= budget for c in ran)
    assert "over --max-memory" in skipped[0].detail and f"{len(skipped)} skipped" in report.summary()


def test_case_sizes_are_what_the_case_allocates():
    medium = next(c for c in conformance.catalogue("quick") if c.name == "dropless-float32-medium")
    # x [512, 4096] float32, 512 int32 indices, out [64, 4096] float32.
    assert medium.nbytes == 512 * 4096 * 4 + 512 * 4 + 64 * 4096 * 4
    large = next(c for c in conformance.catalogue("full") if c.name == "dropless-float32-large-512mib")
    assert large.nbytes > 1 << 30


# ---------------------------------------------------------------------------- reports

def test_json_report_describes_the_run(device, tmp_path):
    report = conformance.run("quick", name_filter="small", progress=None, seed=5)
    report.write_json(str(tmp_path / "r.json"))
    data = json.loads((tmp_path / "r.json").read_text())
    for key in ("cann_version", "toolkit_version", "ops_version", "op_library", "runtime_version", "acl_version",
                "expectations", "libraries", "soc", "devices", "pyacl_moe", "host", "timestamp",
                "seed", "profile", "exact", "strict", "standards", "errors", "differs", "skipped", "ok"):
        assert key in data, key
    # The emulator's default release, 9.0.0: the ops package apart from the toolkit, the op in
    # ops-transformer's library; its op behaves as 8.5.0's first did.
    assert data["cann_version"] == data["toolkit_version"] == data["ops_version"] == data["runtime_version"] == "9.0.0"
    assert data["acl_version"] == "1.17.0" and data["op_library"].endswith("/libopapi_transformer.so")
    assert data["expectations"]["since"] == "8.0.0" and data["expectations"]["note"] == ""
    assert data["seed"] == 5 and data["devices"] == [0]
    assert set(data["libraries"]) == {"ascendcl", "nnopbase", "opapi_transformer"}
    assert data["pyacl_moe"] == pm.__version__
    assert data["timestamp"].endswith("+00:00") and data["host"] == socket.gethostname()
    for case in data["cases"]:
        assert case["source"] in conformance.SOURCES and case["seconds"] > 0 and case["device"] == 0
        if case["kind"] != "negative":
            assert case["digest"].startswith("sha256:") and len(case["digest"]) == 71


def test_progress_draws_on_a_terminal_and_is_silent_otherwise(device):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, log = Tty(), io.StringIO()
    conformance.run("quick", name_filter="tiny", progress=tty)
    conformance.run("quick", name_filter="tiny", progress=log)
    assert "9/9" in tty.getvalue() and "drop-pad-bfloat16-tiny" in tty.getvalue()
    assert log.getvalue() == ""


JUNIT_XSD = Path(__file__).resolve().parent / "data" / "junit.xsd"


def test_junit_validates_and_tells_errors_from_failures(device, clean_emulator, tmp_path):
    import xmlschema  # a test dependency: the schema's types and order checked by a validator

    cases = [c for c in conformance.catalogue("quick") if c.name == "dropless-float32-tiny"]
    cases += [_fake("wrong", "op", "fail"), _fake("boom", "op", "crash"), _fake("inferred", "nnopbase", "fail")]
    big = next(c for c in conformance.catalogue("quick") if c.name == "dropless-float32-medium")
    report = conformance.run(cases=[*cases, big], progress=None, max_memory=1 << 20)
    path = tmp_path / "r.xml"
    report.write_junit(str(path))
    xmlschema.XMLSchema(str(JUNIT_XSD)).validate(str(path))
    suite = ET.parse(path).getroot()
    counts = [suite.get(k) for k in ("tests", "failures", "errors", "skipped")]
    assert counts == ["5", "1", "1", "1"]
    assert suite.get("hostname") and suite.get("timestamp") == report.timestamp[:19]
    by_name = {tc.get("name"): tc for tc in suite.findall("testcase")}
    assert by_name["wrong"].find("failure") is not None and by_name["wrong"].find("error") is None
    assert by_name["boom"].find("error") is not None and by_name["boom"].find("failure") is None
    assert by_name["dropless-float32-medium"].find("skipped") is not None
    passing = by_name["dropless-float32-tiny"]
    assert float(passing.get("time")) > 0 and '"max_abs_error"' in passing.find("system-out").text
    assert "differs from the inferred rule" in by_name["inferred"].find("system-out").text
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["acl_version"] == "1.17.0" and props["toolkit_version"] == "9.0.0" and props["soc"] == "Ascend910B3"
    # Under --strict the inferred miss is a failure.
    report.strict = True
    report.write_junit(str(path))
    xmlschema.XMLSchema(str(JUNIT_XSD)).validate(str(path))
    assert ET.parse(path).getroot().get("failures") == "2"


# ---------------------------------------------------------------------------- baseline

def test_baseline_of_the_same_build_changes_nothing_and_a_wrong_kernel_is_named(device, clean_emulator, tmp_path):
    first = conformance.run("quick", name_filter="dropless-float32", progress=None, standard="pyacl")
    first.write_json(str(tmp_path / "old.json"))
    old = conformance.load_baseline(str(tmp_path / "old.json"))
    again = conformance.run("quick", name_filter="dropless-float32", progress=None, baseline=old, standard="pyacl")
    assert again.baseline["changed"] == [] and again.baseline["regressed"] == []
    assert again.baseline["compared"] == len(again.cases)
    with_negatives = conformance.run("quick", name_filter="null", progress=None, baseline=old)
    assert with_negatives.baseline["compared"] == 0 and with_negatives.baseline["new"]
    pm.emulator.set_mutation("fp16-accumulate")
    wrong = conformance.run("quick", name_filter="dropless-float32", progress=None, baseline=old, standard="pyacl")
    changed = set(wrong.baseline["changed"])
    # Sums that overflow stay infinite whatever the accumulator; the K=1 case passes but its
    # bits went through float16.
    assert {"dropless-float32-medium", "dropless-float32-tiny"} <= changed
    assert "dropless-float32-overflow" not in changed and "dropless-float32-tiny" not in wrong.baseline["regressed"]
    assert set(wrong.baseline["regressed"]) == {c.name for c in wrong.cases if c.outcome == "fail"} != set()
    assert "CHANGED dropless-float32-medium" in wrong.table()


def test_a_baseline_without_digests_is_refused(tmp_path):
    (tmp_path / "old.json").write_text(json.dumps({"cases": [{"name": "a", "passed": True}]}))
    with pytest.raises(ValueError, match="no output digest"):
        conformance.load_baseline(str(tmp_path / "old.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not a JSON report"):
        conformance.load_baseline(str(tmp_path / "bad.json"))


def test_pair_cases_need_no_reference_and_say_so(device, monkeypatch, tmp_path):
    def no_reference(*args, **kwargs):
        raise AssertionError("the golden reference was called")

    monkeypatch.setattr(pm.reference, "moe_init_routing_v2", no_reference)
    monkeypatch.setattr(pm.reference, "moe_init_routing_v2_grad", no_reference)
    report = conformance.run("quick", name_filter="pair-", progress=None)
    assert report.ok and len(report.cases) == 90, report.table()
    assert all(c.judged_by == "identity" and c.op == "pair" for c in report.cases)
    assert "90 of them judged by identities between the forward and the backward alone, with no golden " \
           "reference" in report.summary()
    report.write_json(str(tmp_path / "r.json"))
    case = json.loads((tmp_path / "r.json").read_text())["cases"][0]
    assert case["op"] == "pair" and case["judged_by"] == "identity"


def test_adjoint_bound_holds_for_float32_sums_and_not_for_a_float16_accumulation():
    """The bound of the adjoint check: any order of float32 accumulation passes; a result
    accumulated in float16 does not."""
    from pyacl_moe.tools import pair

    rng = np.random.default_rng(5)
    n, k, h = 32, 8, 64
    x = rng.standard_normal((n, h)).astype(np.float32)
    ri = rng.permutation(n * k).astype(np.int32)
    ex = x[np.argsort(ri) // k]
    kept = np.ones(n * k, bool)
    g = pair._cancelling_gradient(rng, n * k, h, "float32", ri, kept, k)
    terms = g[ri.reshape(n, k)]  # [n, k, h]
    for order in (range(k), reversed(range(k))):
        dx = np.zeros((n, h), np.float32)
        for t in order:
            dx += terms[:, t]
        diff, bound, _, _ = pair.adjoint_check(x, ex, ri, g, dx, k, kept, "float32")
        assert (diff <= bound).all()
    dx16 = np.zeros((n, h), np.float16)
    for t in range(k):
        dx16 = (dx16.astype(np.float32) + terms[:, t]).astype(np.float16)
    diff, bound, _, _ = pair.adjoint_check(x, ex, ri, g, dx16.astype(np.float32), k, kept, "float32")
    assert (diff > bound).mean() > 0.9


# ---------------------------------------------------------------------------- the vendor's unit tests

def _vendor_cases(kind: str | None = None) -> list[conformance.Case]:
    names = {n for n in conformance.VENDOR_UT.values() if n is not None}
    return [c for c in conformance.catalogue("quick") if c.name in names and kind in (None, c.kind)]


def test_every_vendor_unit_test_has_a_case_and_the_emulator_passes_it_bit_for_bit(device):
    quick = conformance.catalogue("quick")
    mapped = {n for n in conformance.VENDOR_UT.values() if n is not None}
    assert mapped <= {c.name for c in quick}
    assert {c.name for c in quick if c.op == "backward" and "vendor-" in c.name} <= mapped
    # Seventeen tiling tests, twelve infershape tests, the op_api test, four kernel cases.
    files = Counter(test.split("_")[0] for test in conformance.VENDOR_UT)
    assert files == {"tiling": 17, "infershape": 12, "api": 1, "kernel": 4}
    report = conformance.run(cases=_vendor_cases(), progress=None, exact=True, strict=True)
    assert report.ok and len(report.cases) == len(mapped), report.table()
    assert all(c.source == "op" for c in report.cases)
    assert all(c.status == 561002 for c in report.cases if c.kind == "negative")
    # The tiling tests tile each dtype in each scenario (tiling keys 1000 to 1102).
    tiled = {(c.dtype, c.scenario) for c in report.cases if c.name.startswith("vendor-tiling-")}
    assert tiled == {(d, s) for d in conformance.DTYPES for s in conformance.SCENARIOS}


def test_vendor_cases_fail_when_the_emulator_breaks_their_rules(device, clean_emulator):
    # The first phase's checks skipped: every refusal is accepted, and the executors of the
    # accepted calls are never launched.
    pm.emulator.weaken_validation()
    report = conformance.run(cases=_vendor_cases(), progress=None)
    assert [c.name for c in report.cases if c.outcome != "fail"] == []
    assert all(c.status == 0 for c in report.cases if c.kind == "negative")
    pm.emulator.clear_faults()
    # A kernel that reads the row after the indexed one: every case with a second row to read.
    pm.emulator.set_mutation("off-by-one-row")
    report = conformance.run(cases=_vendor_cases("positive"), progress=None)
    assert [c.name for c in report.cases if c.passed] == ["vendor-api-float32-dropless"]
    # A kernel that sums in float16: every float32 case (the 16-bit ones of K <= 2 round once).
    pm.emulator.set_mutation("fp16-accumulate")
    report = conformance.run(cases=_vendor_cases("positive"), progress=None)
    assert not any(c.passed for c in report.cases if c.dtype == "float32")


METRIC_KEYS = {"mere", "mare", "rmse", "max_abs_error", "max_rel_error", "mismatch_ratio", "nan_inf_match"}


# The default run: the default standard.
@pytest.mark.parametrize("standard", ["stat-rel-err", pytest.param("mixed", marks=pytest.mark.slow),
                                      pytest.param("close", marks=pytest.mark.slow)])
def test_every_standard_passes_the_emulator_and_each_numeric_case_carries_its_metrics(device, standard, tmp_path):
    # The dropless cases: every dtype and shape, the forward's too (the whole quick profile
    # passes under the default standard in test_quick_profile_passes_and_covers_the_catalogue).
    report = conformance.run("quick", name_filter="dropless-", progress=None, standard=standard)
    assert report.ok, report.table()
    report.write_json(str(tmp_path / "r.json"))
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["standard"] == standard
    numeric = [c for c in data["cases"] if c["kind"] == "positive" and c["outcome"] != "skipped"]
    assert numeric and all(METRIC_KEYS <= set(c["metrics"]) for c in numeric)
    backward = [c for c in numeric if c["op"] == "backward"]
    assert backward and {c["standard"] for c in backward} == {standard}
    assert all(c["thresholds"] == precision.thresholds(standard, c["dtype"]) for c in backward)
    # the forward only moves data: bit for bit under every standard
    assert {c["standard"] for c in numeric if c["op"] == "forward"} == {"exact"}


def test_stat_rel_err_fails_a_float16_accumulator_on_float32_cases(device, clean_emulator):
    pm.emulator.set_mutation("fp16-accumulate")
    report = conformance.run("quick", name_filter="-float32-", progress=None)
    failed = [c for c in report.cases if c.outcome == "fail"]
    assert not report.ok and failed and all(c.dtype == "float32" for c in failed)
    # the golden-judged ones by the standard (identity cases have bounds of their own)
    assert all(c.detail.startswith("stat-rel-err: ") for c in failed if c.judged_by == "reference")
    assert "FAILED dropless-float32-medium: stat-rel-err: mere" in report.table()


def test_an_unknown_standard_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="standard must be one of"):
        conformance.run("quick", progress=None, standard="roughly")
