"""The benchmark command prints its figures (checked for shape, never for speed: timings are
figures to read, not assertions)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from pyacl_moe.tools import bench


@pytest.mark.slow  # a whole bench run
def test_bench_quick_json_has_exactly_the_keys():
    r = subprocess.run([sys.executable, "-m", "pyacl_moe.cli", "--emulator", "bench", "--quick", "--json"],
                       capture_output=True, text=True, timeout=600)
    data = json.loads(r.stdout)
    # Timings on a shared machine may miss a target: the exit status says which it was.
    assert r.returncode == (0 if bench.targets_met(data, quick=True) else 1), r.stderr
    assert tuple(data) == bench.KEYS
    assert data["backend"] == "emulator"
    zero = set(bench.ZERO.values())
    assert all(isinstance(data[k], float) and data[k] > 0 for k in bench.KEYS[1:] if k not in zero)
    assert all(data[k] == 0 for k in zero)  # the steady state allocates nothing


FORWARD = ("fwd_raw_launch_ns", "fwd_plan_launch_ns", "fwd_oneshot_launch_ns", "fwd_two_phase_ns", "fwd_numpy_call_ns",
           "fwd_numpy_copy_ns", "fwd_numpy_kernel_ns", "fwd_kernel_s", "fwd_kernel_copy_s",
           "fwd_droppad_kernel_s", "fwd_droppad_copy_s")


def test_bench_measures_the_forward_beside_the_backward():
    # The smallest sizes: every measurement once, in well under a second.
    res, extra = bench.run(sizes=bench.SMOKE)
    assert tuple(res) == bench.KEYS and set(FORWARD) <= set(bench.KEYS)
    assert "fwd_numpy_call_mallocs" in bench.ZERO.values()
    for k in FORWARD:
        assert isinstance(res[k], float) and res[k] > 0, k
    # Launch paths in units of the bare call, kernels against their copies: finite ratios.
    for num, den in (("fwd_raw_launch_ns", "ffi_call_ns"), ("fwd_plan_launch_ns", "ffi_call_ns"),
                     ("fwd_oneshot_launch_ns", "ffi_call_ns"), ("fwd_two_phase_ns", "ffi_call_ns"),
                     ("fwd_numpy_call_ns", "fwd_numpy_copy_ns"),
                     ("fwd_kernel_s", "fwd_kernel_copy_s"), ("fwd_droppad_kernel_s", "fwd_droppad_copy_s")):
        assert math.isfinite(res[num] / res[den]) and res[num] / res[den] > 0, num
    assert res["fwd_numpy_call_mallocs"] == 0
    assert extra["fwd_out_mib"] > 0 and math.isfinite(extra["fwd_kernel_gb_per_s"])
    text = bench.report(res, extra)
    for line in ("forward raw launch", "plan relaunch", "one call", "two phases by hand", "forward NumPy call",
                 "forward kernel", "drop/pad", "target forward kernel", "target forward allocations"):
        assert line in text, line


def test_bench_json_has_the_raw_launch_floor():
    assert "raw_launch_ns" in bench.KEYS and bench.KEYS.index("raw_launch_ns") < bench.KEYS.index("plan_launch_ns")


def test_report_states_each_target():
    res = dict.fromkeys(bench.KEYS, 1.0)
    res["backend"] = "emulator"
    res["raw_launch_ns"] = 3.0
    res["plan_launch_ns"] = 5.0  # 2 units above the floor: the plan's target (1 unit) is missed
    extra = {"oneshot_uncached_ns": 1, "input_mib": 1, "reference_peak_extra_mib": 1, "kernel_gb_per_s": 1,
             "copy_gb_per_s": 1, "fwd_out_mib": 1, "fwd_kernel_gb_per_s": 1}
    text = bench.report(res, extra)
    assert "target plan overhead" in text and "plan_launch_ns - raw_launch_ns" in text
    assert "MISSED" in text and "met" in text
    assert not bench.targets_met(res)
    res["plan_launch_ns"] = 3.5
    res["numpy_kernel_ns"] = 0.0
    res["numpy_call_mallocs"] = 0.0
    res["fwd_numpy_kernel_ns"] = 0.0
    res["fwd_numpy_call_mallocs"] = 0.0
    assert bench.targets_met(res)
    res["numpy_call_mallocs"] = 1.0  # one allocation per NumPy call misses its target
    assert not bench.targets_met(res) and "numpy_call_mallocs == 0: 1  MISSED" in bench.report(res, extra)
    res["numpy_call_mallocs"] = 0.0
    res["fwd_numpy_call_mallocs"] = 1.0  # so does one per call of the forward
    assert not bench.targets_met(res) and "fwd_numpy_call_mallocs == 0: 1  MISSED" in bench.report(res, extra)
    res["fwd_numpy_call_mallocs"] = 0.0
    res["fwd_kernel_s"] = 5.0  # five copies' time: the forward kernel's bound is four
    text = bench.report(res, extra)
    assert not bench.targets_met(res)
    assert "target forward kernel" in text and "fwd_kernel_s <= 4 x fwd_kernel_copy_s: 5.00 x  MISSED" in text
    res["fwd_kernel_s"] = 1.0
    res["fwd_numpy_call_ns"] = 2.0  # twice its copies above its kernel: over 1.3
    assert not bench.targets_met(res)
    res["fwd_numpy_call_ns"] = 1.0
    assert bench.targets_met(res)


EXTRA = {"oneshot_uncached_ns": 1, "input_mib": 1, "reference_peak_extra_mib": 1, "kernel_gb_per_s": 1,
         "copy_gb_per_s": 1, "fwd_out_mib": 1, "fwd_kernel_gb_per_s": 1}


def figures_meeting_every_target() -> dict:
    res = dict.fromkeys(bench.KEYS, 1.0)
    res.update(backend="emulator", raw_launch_ns=3.0, plan_launch_ns=3.5, numpy_kernel_ns=0.0,
               numpy_call_mallocs=0.0, fwd_numpy_kernel_ns=0.0, fwd_numpy_call_mallocs=0.0)
    assert bench.targets_met(res)
    return res


def test_quick_judges_only_what_its_sizes_can_show():
    """Issue 23: --quick exited 1 on every run on the reference's target, whose 144 MiB copy
    baseline swings from run to run (4.3 to 5.7 times the copy there, 1.3 to 1.6 at 512 MiB)."""
    every = [*bench.TARGETS, *bench.ZERO]
    assert bench.judged() == every  # the full run judges every target
    assert set(bench.QUICK_UNJUDGED) == {"reference"}
    assert bench.judged(quick=True) == [name for name in every if name != "reference"]
    res = figures_meeting_every_target()
    res["reference_s"] = 5.0  # five times its copy, as in the issue's --quick runs
    assert not bench.targets_met(res)  # the full run fails on it...
    assert bench.targets_met(res, quick=True)  # ...--quick does not judge it
    text = bench.report(res, EXTRA, quick=True)
    assert "reference_s <= 2 x reference_copy_s: 5.00 x  not judged at --quick (beyond the target)" in text
    assert "MISSED" not in text
    assert "--quick judges 9 of 10 targets" in text and bench.QUICK_UNJUDGED["reference"] in text
    full = bench.report(res, EXTRA)
    assert "reference_s <= 2 x reference_copy_s: 5.00 x  MISSED" in full and "not judged" not in full
    res["reference_s"] = 1.0
    assert "1.00 x  not judged at --quick (within the target)" in bench.report(res, EXTRA, quick=True)
    # Every other target is still judged at --quick: one missed fails it.
    res["plan_launch_ns"] = 8.0
    assert not bench.targets_met(res, quick=True)
    assert "plan_launch_ns - raw_launch_ns <= 4.5 x ffi_call_ns: 5.00 x  MISSED" in bench.report(res, EXTRA, quick=True)


@pytest.mark.parametrize("json_out", [False, True])
def test_bench_quick_exits_0_when_its_judged_targets_hold(monkeypatch, capsys, json_out):
    from pyacl_moe import cli

    res = figures_meeting_every_target()
    res["reference_s"] = 5.0
    monkeypatch.setattr(bench, "run", lambda quick=False, log=None: (dict(res), EXTRA))
    flags = ["--json"] if json_out else []
    assert cli.main(["bench", "--quick", *flags]) == 0
    assert cli.main(["bench", *flags]) == 1  # the full run judges the reference
    res["reference_s"] = 1.0
    res["fwd_numpy_call_mallocs"] = 1.0  # a target --quick does judge
    assert cli.main(["bench", "--quick", *flags]) == 1
    capsys.readouterr()
