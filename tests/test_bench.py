"""The benchmark command prints its figures (checked for shape, never for speed: timings are
figures to read, not assertions)."""

from __future__ import annotations

import json
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
    assert r.returncode == (0 if bench.targets_met(data) else 1), r.stderr
    assert tuple(data) == bench.KEYS
    assert data["backend"] == "emulator"
    assert all(isinstance(data[k], float) and data[k] > 0 for k in bench.KEYS[1:] if k != "numpy_call_mallocs")
    assert data["numpy_call_mallocs"] == 0  # the steady state allocates nothing


def test_bench_json_has_the_raw_launch_floor():
    assert "raw_launch_ns" in bench.KEYS and bench.KEYS.index("raw_launch_ns") < bench.KEYS.index("plan_launch_ns")


def test_report_states_each_target():
    res = dict.fromkeys(bench.KEYS, 1.0)
    res["backend"] = "emulator"
    res["raw_launch_ns"] = 3.0
    res["plan_launch_ns"] = 5.0  # 2 units above the floor: the plan's target (1 unit) is missed
    extra = {"oneshot_uncached_ns": 1, "input_mib": 1, "reference_peak_extra_mib": 1, "kernel_gb_per_s": 1,
             "copy_gb_per_s": 1}
    text = bench.report(res, extra)
    assert "target plan overhead" in text and "plan_launch_ns - raw_launch_ns" in text
    assert "MISSED" in text and "met" in text
    assert not bench.targets_met(res)
    res["plan_launch_ns"] = 3.5
    res["numpy_kernel_ns"] = 0.0
    res["numpy_call_mallocs"] = 0.0
    assert bench.targets_met(res)
    res["numpy_call_mallocs"] = 1.0  # one allocation per NumPy call misses its target
    assert not bench.targets_met(res) and "numpy_call_mallocs == 0: 1  MISSED" in bench.report(res, extra)
