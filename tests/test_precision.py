"""The precision standards (pyacl_moe.tools.precision) against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pyacl_moe.tools import precision


def test_the_metrics_of_a_small_pair_are_the_hand_computed_ones():
    golden = np.array([1.0, -2.0, 0.0, 4.0], np.float32)
    actual = np.array([1.5, -2.0, 1e-7, 3.0], np.float32)
    m = precision.metrics(actual, golden)
    # e = |a - g| / (|g| + 1e-7): 0.5/(1+1e-7), 0, 1e-7/1e-7 = 1, 1/(4+1e-7)
    e = [0.5 / (1 + 1e-7), 0.0, float(np.float32(1e-7)) / 1e-7, 1.0 / (4 + 1e-7)]
    assert m["mere"] == pytest.approx(sum(e) / 4, rel=1e-6)
    assert m["mare"] == pytest.approx(max(e), rel=1e-6)
    assert m["rmse"] == pytest.approx(math.sqrt((0.25 + 0 + float(np.float32(1e-7)) ** 2 + 1.0) / 4), rel=1e-6)
    assert m["max_abs_error"] == pytest.approx(1.0)
    assert m["max_rel_error"] == math.inf  # an error where the golden value is 0
    assert m["nan_inf_match"] is True
    assert m["elements"] == 4


def test_nan_and_infinities_must_sit_where_the_golden_has_them_under_every_standard():
    golden = np.array([np.nan, np.inf, 1.0], np.float32)
    same = np.array([np.nan, np.inf, 1.0], np.float32)
    for standard in precision.STANDARD_NAMES:
        assert precision.judge(standard, same, golden, "float32").passed, standard
    for wrong in ([1.0, np.inf, 1.0], [np.nan, -np.inf, 1.0], [np.nan, np.inf, np.nan]):
        for standard in precision.STANDARD_NAMES:
            j = precision.judge(standard, np.array(wrong, np.float32), golden, "float32")
            assert not j.passed and j.metrics["nan_inf_match"] is False, (standard, wrong)


def test_stat_rel_err_passes_below_its_thresholds_and_fails_at_them():
    t = 2.0 ** -13
    assert precision.thresholds("stat-rel-err", "float32") == {"threshold": t, "mere_limit": t, "mare_limit": 10 * t}
    assert precision.thresholds("stat-rel-err", "float16")["threshold"] == 2.0 ** -10
    assert precision.thresholds("stat-rel-err", "bfloat16")["threshold"] == 2.0 ** -7
    golden = np.ones(1000)
    # one element off by 9 T, the rest exact: mere 9 T / 1000 < T, mare 9 T < 10 T
    actual = golden.copy()
    actual[0] += 9 * t
    j = precision.judge("stat-rel-err", actual, golden, "float32")
    assert j.passed and j.metrics["mismatch_ratio"] == pytest.approx(1 / 1000)
    actual[0] = 1 + 11 * t  # mare 11 T >= 10 T
    j = precision.judge("stat-rel-err", actual, golden, "float32")
    assert not j.passed and "mare" in j.reason and "mere" not in j.reason
    actual = golden + 1.5 * t  # every element at 1.5 T: mere >= T, mare < 10 T
    j = precision.judge("stat-rel-err", actual, golden, "float32")
    assert not j.passed and "mere" in j.reason and "mare" not in j.reason


def test_mixed_allows_one_percent_outside_and_caps_the_largest_error():
    r, a, cap = precision.MIXED["float16"]
    assert (r, a, cap) == (2.0 ** -9, 2.0 ** -9, 0.1)
    golden = np.zeros(100, np.float32)
    actual = golden.copy()
    actual[0] = 0.05  # 1 of 100 outside atol, below the cap: matched ratio 0.99
    j = precision.judge("mixed", actual, golden, "float16")
    assert j.passed and j.metrics["mismatch_ratio"] == pytest.approx(0.01)
    actual[1] = 0.05  # 2 of 100: 0.98 < 0.99
    assert not precision.judge("mixed", actual, golden, "float16").passed
    one = golden.copy()
    one[0] = 0.5  # one element, but past the cap and past 32 ulp of 0
    j = precision.judge("mixed", one, golden, "float16")
    assert not j.passed and "max_abs_error" in j.reason
    big = np.full(100, 1000.0, np.float32)  # 32 ulp of 1000 in float16 is 32 * 0.5 = 16
    off = big.copy()
    off[0] += 8.0  # 8 > cap 0.1 but within 32 ulp; 1 of 100 outside rtol
    assert precision.judge("mixed", off, big, "float16").passed


def test_close_counts_the_elements_outside_rtol_against_ptol():
    assert precision.thresholds("close", "float16") == {"rtol": 1e-3, "ptol": 1e-3, "atol": 1e-8}
    assert precision.thresholds("close", "float32", rtol=0.01, ptol=0.5, atol=0.0) == {
        "rtol": 0.01, "ptol": 0.5, "atol": 0.0}
    golden = np.ones(1000)
    actual = golden.copy()
    actual[0] = 1.01  # 1 of 1000 outside rtol 1e-3: 0.001 <= ptol 0.001
    assert precision.judge("close", actual, golden, "float16").passed
    actual[1] = 1.01
    j = precision.judge("close", actual, golden, "float16")
    assert not j.passed and j.metrics["mismatch_ratio"] == pytest.approx(0.002)
    assert precision.judge("close", actual, golden, "float16", rtol=0.02).passed


def test_exact_compares_bits_and_pyacl_the_binding_tolerances():
    golden = np.array([1.0, 2.0], np.float32)
    near = np.nextafter(golden, np.float32(3))
    assert not precision.judge("exact", near, golden, "float32").passed
    assert precision.judge("exact", golden.copy(), golden, "float32").passed
    assert precision.judge("pyacl", near, golden, "float32").passed
    with pytest.raises(ValueError, match="standard must be one of"):
        precision.judge("nearly", near, golden, "float32")


def test_a_result_of_another_size_fails_every_standard_with_its_shapes():
    for standard in precision.STANDARD_NAMES:
        j = precision.judge(standard, np.ones(3, np.float32), np.ones(4, np.float32), "float32")
        assert not j.passed and j.reason == "shape (3,) against (4,)" and j.metrics["mismatch_ratio"] == 1.0
