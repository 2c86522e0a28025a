"""The emulator under an address-space limit (`ulimit -v`, RLIMIT_AS), common on clusters.

Each emulated device reserves an address range for its memory, and that range counts against
the limit like any mapping. It used to be 16 GiB to 1 TiB whatever the capacity, so under
`ulimit -v 6000000` every command failed at aclrtSetDevice with 207001, PYACL_MOE_EMU_MEMORY
included. Now the range is sized from the capacity, and the default capacity shrinks to fit
the limit (docs/emulator.md, *Memory*).

AddressSanitizer reserves terabytes of shadow memory and cannot run under such a limit: the
tests are skipped in the sanitized runs.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from .conftest import BACKEND

LIMIT = 6_000_000 * 1024  # `ulimit -v 6000000`: the figure is in KiB

pytestmark = [
    pytest.mark.skipif(BACKEND != "emulator", reason="emulator-only test"),
    pytest.mark.skipif(bool(os.environ.get("PYACL_MOE_EMU_SANITIZE"))
                       or "asan" in os.environ.get("LD_PRELOAD", ""),
                       reason="AddressSanitizer's shadow memory does not fit under an address-space limit"),
]

# The child: the op through the binding, its result against the reference, and what device 0
# reports as its memory.
CHILD = """
import json, numpy as np, pyacl_moe as pm
pm.use_emulator()
out = {}
try:
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    idx = np.array([3, 0, 5, 1, 2, 4], np.int32)
    got = pm.moe_init_routing_v2_grad(x, idx, 2)
    out["same"] = bool(np.array_equal(got, pm.reference.moe_init_routing_v2_grad(x, idx, 2)))
    out["free"], out["total"] = pm.Device(0).mem_info()
except pm.PyaclMoeError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


def run_limited(env: dict[str, str]) -> dict:
    def limit() -> None:  # in the child, before exec: the whole interpreter runs under it
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))

    full = {k: v for k, v in os.environ.items() if not k.startswith("PYACL_MOE_EMU_")}
    full.update(env)
    r = subprocess.run([sys.executable, "-c", CHILD], env=full, preexec_fn=limit,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_default_capacity_fits_under_ulimit_v():
    r = run_limited({})
    assert "error" not in r, r["error"]
    assert r["same"]
    # An eighth of the limit, in whole MiB: the reservation (about twice it) and the host memory
    # behind it leave the rest for the interpreter.
    assert r["total"] == (LIMIT // 8) & ~((1 << 20) - 1)


def test_emu_memory_sets_the_capacity_under_ulimit_v():
    r = run_limited({"PYACL_MOE_EMU_MEMORY": "64M"})
    assert "error" not in r, r["error"]
    assert r["same"] and r["total"] == 64 << 20


def test_a_capacity_too_large_for_the_limit_names_the_variable():
    r = run_limited({"PYACL_MOE_EMU_MEMORY": "8G"})
    assert "207001" in r["error"] and "lower PYACL_MOE_EMU_MEMORY" in r["error"], r
    assert "ulimit -v: 6144000000 bytes" in r["error"], r
