"""Chips (pyacl_moe.chip): the emulator's Ascend 950 beside the 910B and 910_93, the binding's
host checks by chip, the reference's model of each kernel, and conformance on each. Each chip
runs in a fresh interpreter (the emulator reads PYACL_MOE_EMU_SOC once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe import chip as chips
from pyacl_moe import reference, release

A950 = {"PYACL_MOE_EMU_SOC": "Ascend950PR_9599", "PYACL_MOE_EMU_RELEASE": "9.1.0"}


def test_families_by_soc_name_and_rules_by_release():
    assert chips.family_of("Ascend910B4") == "Ascend910B" and chips.family_of("Ascend910_9391") == "Ascend910_93"
    assert chips.family_of("Ascend950DT") == chips.family_of("Ascend910_9599") == "Ascend950"
    assert chips.family_of("Ascend310P3") is None and chips.chip_named("Ascend310P3").family == "Ascend910B"
    a950 = chips.chip_named("Ascend950PR_9599")
    assert (a950.vector_cores, a950.ub_bytes, a950.summation, a950.forward_relaxed) == (64, 253952, "quads", True)
    assert release.chip_for("Ascend950PR_9599", "8.5.0").summation == "sequential"
    assert release.chip_for("Ascend950PR_9599", "9.0.0").invalid_index == "fault"
    assert release.chip_for("Ascend950PR_9599", "9.1.0").invalid_index == "zero"
    assert release.chip_for("Ascend910B3", "9.1.0").summation == "tree"


@pytest.mark.parametrize("k, h, ts, want", [
    (4, 8192, 2, 4),  # split-H: N = 1 below 64 cores and below 8192 / 512 / 2
    (8, 4096, 2, 8),  # full load: 17 rows of 4096 fit
    (8, 8192, 4, 8),  # full load with H split: K <= 10
    (16, 4096, 2, 14), (16, 4096, 4, 6), (16, 16384, 2, 2), (16, 16384, 4, 1),  # the general template
])
def test_the_950s_chunk_of_terms_follows_its_tiling(k, h, ts, want):
    n = 1 if want == k and k == 4 else 100
    assert reference.arch35_chunk(chips.chip_named("Ascend950"), n, k, h, ts) == want


def child_reference_equals_kernel(cases: int) -> None:
    """Random cases over K 1 to 200, H across the 950's templates (its general template's
    chunks of 1 to 60 terms), every dtype and scenario, some with invalid indices: the emulated
    950 kernel and reference's model of it, bit for bit."""
    pm.use_emulator()
    chip = pm.device.chip()
    assert chip.family == "Ascend950" and chip.invalid_index == "zero", chip
    rng = np.random.default_rng(30)
    dtypes = (np.float32, np.float16, pm.bfloat16)
    bad, chunks = [], set()
    for i in range(cases):
        k = int(rng.choice([1, 2, 3, 4, 5, 7, 11, 16, 33, 64, 100, 200]))
        h = int(rng.choice([1, 33, 512, 1024, 4096, 8200, 16384]))
        n = int(rng.integers(1, max(2, min(40, 60_000 // (k * h) + 1))))
        dt, scen = dtypes[i % 3], ("dropless", "active", "drop-pad")[(i // 3) % 3]
        if scen == "drop-pad":
            e, c = 4, max(1, n * k // 4)
            x = rng.standard_normal((e, c, h)).astype(dt)
            idx = np.full(n * k, -1, np.int32)
            slots = rng.permutation(n * k)[:min(n * k, e * c)]
            idx[slots] = rng.permutation(e * c)[:slots.size]
            args = (1, 0)
        else:
            active = int(rng.integers(1, n * k + 1)) if scen == "active" else 0
            x = rng.standard_normal((active or n * k, h)).astype(dt)
            idx = rng.permutation(n * k).astype(np.int32)
            args = (0, active)
        if i % 4 == 3:  # invalid indices: zero rows on this chip
            idx[rng.permutation(idx.size)[:max(1, idx.size // 5)]] = -7
        chunks.add(reference.arch35_chunk(chip, n, k, h, np.dtype(dt).itemsize))
        got = pm.moe_init_routing_v2_grad(x, idx, k, *args, validate=False)
        want = reference.moe_init_routing_v2_grad(x, idx, k, *args, validate=False, chip=chip)
        if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
            bad.append((k, h, str(np.dtype(dt)), scen))
    print(json.dumps({"bad": bad, "chunks": sorted(chunks)}))


def test_the_950_model_equals_the_emulated_950_kernel_bit_for_bit(isolated):
    r = isolated(child_reference_equals_kernel, 120, env=A950)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["bad"] == [], out["bad"][:5]
    assert {1, 2, 200} <= set(out["chunks"]) and len(out["chunks"]) >= 6, out["chunks"]


def child_what_the_chip_takes() -> None:
    pm.use_emulator()
    chip = pm.device.chip()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    out = {}
    calls = {
        "int64-ids": lambda: pm.moe_init_routing_v2(x, rng.integers(0, 3, (6, 2)).astype(np.int64), 0, 0, 3, 0, 1),
        "1-D ids": lambda: pm.moe_init_routing_v2(x, rng.integers(0, 3, 6).astype(np.int32), 0, 0, 3, 0, 2),
        "negative active": lambda: pm.moe_init_routing_v2(x, rng.integers(0, 3, (6, 2)).astype(np.int32), -5),
    }
    for name, call in calls.items():
        try:
            got = call()
            out[name] = "taken"
        except pm.InvalidArgument as exc:
            out[name] = str(exc)
    # The same calls, on device arrays, against the reference.
    ids = rng.integers(0, 3, 6).astype(np.int64)
    if chip.forward_relaxed:
        got = pm.moe_init_routing_v2(pm.to_device(x), pm.to_device(ids), -2, 0, 3, 0, 1)
        want = reference.moe_init_routing_v2(x, ids, -2, 0, 3, 0, 1, chip=chip)
        out["device equals reference"] = all(np.array_equal(g.to_host(), w) for g, w in zip(got, want) if w is not None)
    gx = rng.standard_normal((16, 8)).astype(np.float32)
    idx = rng.permutation(16).astype(np.int32)
    idx[[2, 9]] = [-4, 99]
    try:
        got = pm.moe_init_routing_v2_grad(gx, idx, 2)
        want = reference.moe_init_routing_v2_grad(gx, idx, 2, chip=chip)
        out["zero rows"] = bool(np.array_equal(got, want)) and not np.array_equal(got[1], np.zeros(8))
    except pm.InvalidArgument as exc:
        out["zero rows"] = str(exc)
    print(json.dumps(out))


@pytest.mark.parametrize("soc", ["Ascend950PR_9599", "Ascend910B3"])
def test_what_a_950_takes_goes_through_there_and_is_refused_on_a_910b_naming_both(isolated, soc):
    r = isolated(child_what_the_chip_takes, env={"PYACL_MOE_EMU_SOC": soc, "PYACL_MOE_EMU_RELEASE": "9.1.0"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    if soc.startswith("Ascend950"):
        assert out == {"int64-ids": "taken", "1-D ids": "taken", "negative active": "taken",
                       "device equals reference": True, "zero rows": True}, out
    else:
        for name in ("int64-ids", "1-D ids", "negative active", "zero rows"):
            assert "on Ascend910B3 (Ascend910B)" in out[name] and "Ascend950" in out[name], (name, out[name])


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("PYACL_MOE_EMU")}
    return subprocess.run([sys.executable, "-m", "pyacl_moe.cli", "--emulator", *args], capture_output=True,
                          text=True, env={**full, **env}, timeout=300)


@pytest.mark.parametrize("soc", ["Ascend950PR_9599", "Ascend910_9391", "Ascend910B3"])
def test_conformance_passes_exactly_on_each_chip_and_a_wrong_kernel_fails_each(soc):
    env = {"PYACL_MOE_EMU_SOC": soc, "PYACL_MOE_EMU_RELEASE": "9.1.0"}
    r = _cli("conformance", "--quick", "--exact", env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert f"{soc} ({chips.family_of(soc)})" in r.stdout
    r = _cli("conformance", "--quick", "--filter", "medium", env={**env, "PYACL_MOE_EMU_MUTATION": "fp16-accumulate"})
    assert r.returncode == 1 and "FAILED" in r.stdout, r.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("standard", ["stat-rel-err", "close", "exact"])
@pytest.mark.parametrize("soc", ["Ascend950PR_9599", "Ascend950DT", "Ascend910_9391", "Ascend910B3"])
@pytest.mark.parametrize("rel", ["9.0.0", "9.1.0"])
def test_the_full_catalogue_passes_on_each_chip_and_release_under_each_standard(soc, standard, rel):
    r = _cli("conformance", "--full", "--standard", standard,
             env={"PYACL_MOE_EMU_SOC": soc, "PYACL_MOE_EMU_RELEASE": rel})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


@pytest.mark.parametrize("soc, rel, why", [
    ("Ascend310P3", "9.0.0", "a family the op is built for"),
    ("Ascend950PR_9599", "8.1.RC1", "from release 9.0"),
])
def test_a_chip_the_emulator_cannot_be_is_refused_by_name(soc, rel, why):
    r = _cli("info", env={"PYACL_MOE_EMU_SOC": soc, "PYACL_MOE_EMU_RELEASE": rel})
    assert r.returncode == 2 and "PYACL_MOE_EMU_SOC" in r.stderr and why in r.stderr, r.stderr


def test_info_names_the_chip():
    r = _cli("info", "--json", env=A950)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["soc"] == "Ascend950PR_9599" and info["chip"]["family"] == "Ascend950"
    assert info["chip"]["vector_cores"] == 64 and info["chip"]["invalid_index"] == "zero"
