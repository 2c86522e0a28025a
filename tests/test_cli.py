"""The pyacl-moe command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pyacl_moe import cli


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "pyacl_moe.cli", *args], capture_output=True, text=True, env=e,
                          timeout=300)


def test_info_json():
    r = run_cli("--emulator", "info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["backend"] == "emulator"
    assert set(info["libraries"]) == {"ascendcl", "nnopbase", "opapi"}
    assert info["acl_version"] == "1.13.0" and info["soc"] == "Ascend910B3"
    assert info["device_count"] == 1 and info["devices"][0]["memory_total"] == 32 << 30


def test_info_text():
    r = run_cli("--emulator", "info")
    assert r.returncode == 0, r.stderr
    assert "backend      emulator" in r.stdout and "libopapi.so" in r.stdout


@pytest.mark.parametrize("mode", ["dropless", "active", "drop-pad"])
def test_run_passes(mode):
    r = run_cli("--emulator", "run", "--mode", mode, "--dtype", "bfloat16", "--tokens", "32", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["passed"] and out["scenario"] == mode and out["mismatches"] == 0


def test_run_fails_on_a_wrong_kernel():
    r = run_cli("--emulator", "run", "--top-k", "8", env={"PYACL_MOE_EMU_MUTATION": "skip-last-k"})
    assert r.returncode == 1
    assert "FAIL" in r.stdout


def test_emulator_path_and_build():
    r = run_cli("emulator", "path")
    assert r.returncode == 0, r.stderr
    home = r.stdout.strip()
    assert os.path.isfile(os.path.join(home, "lib64", "libopapi.so"))
    assert run_cli("emulator", "build").stdout.strip() == home


def test_without_cann_the_error_says_what_to_do(tmp_path):
    r = run_cli("info", env={"PYACL_MOE_EMULATOR": "", "ASCEND_HOME_PATH": str(tmp_path), "ASCEND_TOOLKIT_HOME": "",
                             "LD_LIBRARY_PATH": ""})
    assert r.returncode == 2
    assert "set_env.sh" in r.stderr and "--emulator" in r.stderr and "Traceback" not in r.stderr


def test_parser_rejects_unknown_command():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["frobnicate"])
