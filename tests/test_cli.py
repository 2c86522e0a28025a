"""The pyacl-moe command. Most cases run its main() in this process (the same emulator); those
about a process of its own (the module entry point, the environment, no CANN at all) run it
in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import pyacl_moe as pm
from pyacl_moe import cli


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "pyacl_moe.cli", *args], capture_output=True, text=True, env=e,
                          timeout=300)


@pytest.fixture
def main(device, capsys):
    """cli.main in this process: (exit status, stdout, stderr)."""

    def call(*args: str) -> tuple[int, str, str]:
        code = cli.main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    yield call
    pm.emulator.set_mutation(None)


def test_info_json(main):
    code, out, err = main("--emulator", "info", "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["backend"] == "emulator"
    assert set(info["libraries"]) == {"ascendcl", "nnopbase", "opapi"}
    assert info["acl_version"] == "1.13.0" and info["soc"] == "Ascend910B3"
    assert info["device_count"] == 1 and info["devices"][0]["memory_total"] == 32 << 30


def test_info_text(main):
    code, out, err = main("--emulator", "info")
    assert code == 0, err
    assert "backend      emulator" in out and "libopapi.so" in out


@pytest.mark.parametrize("mode", ["dropless", "active", "drop-pad"])
def test_run_passes(main, mode):
    code, out, err = main("--emulator", "run", "--mode", mode, "--dtype", "bfloat16", "--tokens", "32", "--json")
    assert code == 0, err
    out = json.loads(out)
    assert out["passed"] and out["scenario"] == mode and out["mismatches"] == 0


def test_run_fails_on_a_wrong_kernel(main):
    pm.emulator.set_mutation("skip-last-k")
    code, out, _ = main("--emulator", "run", "--top-k", "8")
    assert code == 1
    assert "FAIL" in out


def test_the_module_runs_and_reads_the_environment():
    r = run_cli("--emulator", "run", "--top-k", "8", env={"PYACL_MOE_EMU_MUTATION": "skip-last-k"})
    assert r.returncode == 1, r.stderr
    assert "FAIL" in r.stdout


def test_emulator_path_and_build(main):
    code, out, err = main("emulator", "path")
    assert code == 0, err
    home = out.strip()
    assert os.path.isfile(os.path.join(home, "lib64", "libopapi.so"))
    assert main("emulator", "build")[1].strip() == home


def test_without_cann_the_error_says_what_to_do(tmp_path):
    r = run_cli("info", env={"PYACL_MOE_EMULATOR": "", "ASCEND_HOME_PATH": str(tmp_path), "ASCEND_TOOLKIT_HOME": "",
                             "LD_LIBRARY_PATH": ""})
    assert r.returncode == 2
    assert "set_env.sh" in r.stderr and "--emulator" in r.stderr and "Traceback" not in r.stderr


def test_parser_rejects_unknown_command():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["frobnicate"])
