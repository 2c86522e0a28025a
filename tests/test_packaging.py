"""The wheel carries everything: built, installed in a fresh venv, quickstart runs there."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import cffi
import ml_dtypes
import numpy
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"  # run by the fresh environment's interpreter, as files


@pytest.mark.slow  # builds a wheel and a virtualenv
def test_wheel_installs_and_runs_quickstart(tmp_path):
    wheels = tmp_path / "wheels"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    if r.returncode != 0 and "hatchling" in (r.stdout + r.stderr):
        # No hatchling in this environment: let pip fetch the build backend.
        r = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), str(ROOT)],
            capture_output=True, text=True, timeout=600,
        )
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = wheels.glob("pyacl_moe-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in ("pyacl_moe/headers/acl_rt.h", "pyacl_moe/headers/aclnn_moe_init_routing_v2_grad.h",
                     "pyacl_moe/emulator/src/kernel.c", "pyacl_moe/emulator/src/aclemu.h", "pyacl_moe/py.typed",
                     # every layer's package
                     "pyacl_moe/_cann/__init__.py", "pyacl_moe/_cann/declare.py", "pyacl_moe/_cann/loader.py",
                     "pyacl_moe/op/__init__.py", "pyacl_moe/op/moe_init_routing_v2_grad.py",
                     "pyacl_moe/tools/cases.py", "pyacl_moe/tools/conformance.py", "pyacl_moe/_lifetime.py"):
        assert required in names, f"{required} missing from the wheel"
    assert not any(n.startswith("tests/") for n in names), "the tests were packaged in the wheel"

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)  # (ensurepip would cost more than the rest of the test)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), str(SCRIPTS / "print_purelib.py")], capture_output=True, text=True).stdout.strip()
    assert site.startswith(str(env_dir)), site
    # This environment's pip installs the wheel into the fresh one.
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # The dependencies come from this environment (no network in the test): a .pth line adds
    # its site-packages after the venv's own, so the wheel's copy of the package wins.
    deps = {Path(m.__file__).resolve().parent.parent for m in (numpy, cffi, ml_dtypes)}
    (Path(site) / "zz_outer_deps.pth").write_text("\n".join(str(d) for d in deps) + "\n")
    env = dict(os.environ, PYACL_MOE_EMULATOR="1", PYACL_MOE_CACHE=str(tmp_path / "cache"))
    env.pop("PYTHONPATH", None)
    r = subprocess.run([str(py), str(ROOT / "examples" / "quickstart.py")], capture_output=True, text=True,
                       env=env, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    where = subprocess.run([str(py), str(SCRIPTS / "print_pyacl_moe_location.py")], capture_output=True,
                           text=True, env=env, cwd=str(tmp_path)).stdout.strip()
    assert where.startswith(str(env_dir)), f"imported {where}, not the installed wheel"
