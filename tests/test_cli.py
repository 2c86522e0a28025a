"""The pyacl-moe command. Most cases run its main() in this process (the same emulator); those
about a process of its own (the module entry point, the environment, no CANN at all) run it
in a fresh interpreter."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe import cli

from .conftest import default_capacity


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "pyacl_moe.cli", *args], capture_output=True, text=True, env=e,
                          timeout=300)


def test_info_json(main):
    code, out, err = main("--emulator", "info", "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["backend"] == "emulator"
    # The default profile is 9.0.0: the op in ops-transformer's library, which needs ops-math's.
    assert set(info["libraries"]) == {"ascendcl", "nnopbase", "opapi_transformer"}
    assert info["toolkit_version"] == info["ops_version"] == info["runtime_version"] == "9.0.0"
    assert info["op_library"].endswith("/cann-9.0.0/x86_64-linux/lib64/libopapi_transformer.so".replace(
        "x86_64", os.uname().machine))
    assert [os.path.basename(d) for d in info["dependencies"]] == ["libopapi_math.so"]
    assert info["acl_version"] == "1.17.0" and info["soc"] == "Ascend910B3"
    assert info["device_count"] == 1 and info["devices"][0]["memory_total"] == default_capacity()


def test_a_bad_environment_value_of_the_binding_is_one_line_not_an_import_traceback():
    # PYACL_MOE_CACHE_ALLOCATIONS=2 raised at import: every program importing the package died
    # with a traceback, and the CLI before it could say anything in its own words.
    env = {"PYACL_MOE_CACHE_ALLOCATIONS": "2"}
    r = run_cli("--emulator", "run", "--tokens", "4", env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == "pyacl-moe: error: PYACL_MOE_CACHE_ALLOCATIONS: must be 0 or 1, got '2'", r.stderr
    r = subprocess.run([sys.executable, "-c", "import pyacl_moe"], env={**os.environ, **env}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_info_text(main):
    code, out, err = main("--emulator", "info")
    assert code == 0, err
    assert "backend      emulator" in out and "libopapi_transformer.so" in out and "toolkit      9.0.0" in out
    # Each library's name and its path stay apart, however long the name (it ran into the path).
    libs = [line for line in out.splitlines() if line.startswith("lib") and ".so" in line]
    assert len(libs) == 3 and all(line.split()[1].startswith("/") for line in libs), libs


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
    assert os.path.isfile(os.path.join(home, "lib64", "libopapi_transformer.so"))
    assert os.path.isfile(os.path.join(home, "set_env.sh"))
    assert main("emulator", "build")[1].strip() == home


def test_without_cann_the_error_says_what_to_do(tmp_path):
    r = run_cli("info", env={"PYACL_MOE_EMULATOR": "", "ASCEND_HOME_PATH": str(tmp_path), "ASCEND_TOOLKIT_HOME": "",
                             "LD_LIBRARY_PATH": ""})
    assert r.returncode == 2
    assert "set_env.sh" in r.stderr and "--emulator" in r.stderr and "Traceback" not in r.stderr


def test_parser_rejects_unknown_command():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["frobnicate"])


def test_run_states_the_criterion_beside_its_verdict(main):
    code, out, err = main("--emulator", "run", "--dtype", "bfloat16", "--tokens", "32")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.strip().startswith("result"))
    assert "PASS: 0 of 8192 elements (0.000%) outside rtol=0.004 atol=0.004, at most 0.400% allowed" in line
    assert "worst element at 0x its tolerance, at most 10x allowed" in line
    pm.emulator.set_mutation("skip-last-k")
    code, out, _ = main("--emulator", "run", "--top-k", "8")
    line = next(x for x in out.splitlines() if x.strip().startswith("result"))
    assert code == 1 and line.split()[1] == "FAIL:" and "outside rtol=0.0001" in line


def test_a_passing_verdict_explains_a_large_relative_error():
    from pyacl_moe.tools.cases import compare

    # Near zero the absolute tolerance governs: 5e-5 off an expected 1e-5 is a relative error
    # of 5 yet within atol=1e-4, half a tolerance.
    cmp = compare(np.array([6e-5], np.float32), np.array([1e-5], np.float32))
    assert cmp.passed and cmp.max_rel_error > 4
    assert cmp.verdict().startswith("0 of 1 elements (0.000%) outside rtol=0.0001 atol=0.0001")
    assert "worst element at 0.5x its tolerance" in cmp.verdict()
    bad = compare(np.array([1.0, 2.0], np.float32), np.array([1.0, 3.0], np.float32))
    assert not bad.passed and "1 of 2 elements (50.000%) outside" in bad.verdict()


# ---------------------------------------------------------------------------- conformance


@pytest.fixture
def no_case_may_run(monkeypatch):
    from pyacl_moe.tools import conformance

    def refuse(*a, **k):
        raise AssertionError("a case ran")

    monkeypatch.setattr(conformance, "run", refuse)


def refused(main, *args: str) -> tuple[int, str, str]:
    """main's (exit status, stdout, stderr), whether argparse refused the command line (it exits)
    or the command did (it returns)."""
    try:
        return main(*args)
    except SystemExit as exc:
        return (int(exc.code or 0), *main.readouterr())


@pytest.mark.parametrize("args, says", [
    (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["--report", "{tmp}/missing/r.json"], "argument --report: {tmp}/missing/r.json: the folder {tmp}/missing does "
                                           "not exist"),
    (["--junit", "{tmp}"], "argument --junit: {tmp}: not writable"),
    (["--filter", "nomatch"], "argument --filter: 'nomatch' matches no case"),
    (["--device", "5"], "argument --device: device 5 does not exist: CANN sees 1 device(s)"),
    (["--device=-1"], "argument --device: must be >= 0, got -1"),
    (["--devices", "0,1"], "argument --devices: device 1 does not exist"),
    (["--devices", "0,0"], "argument --devices: 0,0: give distinct non-negative device ids"),
    (["--rtol", "float8=0.1"], "argument --rtol: float8=0.1: the dtype must be one of float32, float16, bfloat16"),
    (["--atol", "bfloat16=-1"], "argument --atol: bfloat16=-1: the value must be a finite number >= 0"),
    (["--max-memory", "lots"], "argument --max-memory: lots: give a size"),
    (["--exact", "--rtol", "0.1"], "argument --rtol/--atol: override the pyacl standard"),
    (["--rtol", "0.1"], "give --standard pyacl"),
    (["--exact", "--standard", "mixed"], "argument --exact: is --standard exact"),
    (["--max-memory", "1", "--filter", "dropless-float32"], "argument --max-memory: 1 B leaves no case to run"),
    (["--baseline", "{tmp}/none.json"], "argument --baseline: {tmp}/none.json: cannot read it"),
    (["--ascend-home", "{tmp}/none"], "argument --ascend-home: --ascend-home and --emulator choose different CANNs"),
])
def test_usage_errors_exit_2_with_one_line_before_any_case(main, no_case_may_run, tmp_path, args, says):
    args = [a.format(tmp=tmp_path) for a in args]
    code, out, err = refused(main, "--emulator", "conformance", *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("pyacl-moe conformance: error: ") and says.format(tmp=tmp_path) in err
    assert not (tmp_path / "r.json").exists()


def test_a_bad_flag_value_is_one_line_too(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["conformance", "--seed", "abc"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "argument --seed: must be an integer, got 'abc'" in err


def test_a_baseline_of_another_seed_is_refused(main, no_case_may_run, tmp_path):
    (tmp_path / "old.json").write_text(json.dumps({"seed": 3, "cases": [{"name": "a", "digest": "sha256:0"}]}))
    code, _, err = main("--emulator", "conformance", "--baseline", str(tmp_path / "old.json"))
    assert code == 2 and "made with --seed 3, this run uses 0" in err


def test_list_needs_no_cann(tmp_path):
    r = run_cli("conformance", "--list", "--filter=-tiny",
                env={"PYACL_MOE_EMULATOR": "", "ASCEND_HOME_PATH": str(tmp_path), "ASCEND_TOOLKIT_HOME": "",
                     "LD_LIBRARY_PATH": ""})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["case", "kind", "dtype", "scenario", "shape", "source", "memory"]
    assert lines[-1] == "9 cases"
    assert lines[1].split() == ["dropless-float32-tiny", "positive", "float32", "dropless", "N=1", "K=1", "H=1", "op",
                                "12", "B"]


def test_no_cann_is_one_line_before_any_case(tmp_path):
    r = run_cli("conformance", "--report", str(tmp_path / "r.json"),
                env={"PYACL_MOE_EMULATOR": "", "ASCEND_HOME_PATH": str(tmp_path), "ASCEND_TOOLKIT_HOME": "",
                     "LD_LIBRARY_PATH": ""})
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"pyacl-moe: error: no CANN found (looked at $ASCEND_HOME_PATH = {tmp_path};")
    assert "--ascend-home PATH, or use --emulator" in r.stderr and not (tmp_path / "r.json").exists()


def test_device_picks_the_device(tmp_path):
    r = run_cli("--emulator", "conformance", "--device", "1", "--filter=-tiny", "--report", str(tmp_path / "r.json"),
                env={"PYACL_MOE_EMU_DEVICES": "2"})
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["devices"] == [1] and {c["device"] for c in data["cases"]} == {1} and "device 1, " in r.stdout


def test_devices_spread_the_cases_and_merge_one_report(tmp_path):
    r = run_cli("--emulator", "conformance", "--devices", "0,1", "--filter=-small", "--report",
                str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml"), env={"PYACL_MOE_EMU_DEVICES": "2"})
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    from pyacl_moe.tools import conformance

    assert [c["name"] for c in data["cases"]] == [c.name for c in conformance.select("quick", "-small")]
    assert {c["device"] for c in data["cases"]} == {0, 1} and data["devices"] == [0, 1]
    assert data["ok"] and "device 0,1" in r.stdout


def test_ascend_home_loads_cann_from_there(tmp_path):
    home = pm.emulator.path()
    r = run_cli("conformance", "--ascend-home", home, "--filter=-tiny", "--report", str(tmp_path / "r.json"),
                env={"PYACL_MOE_EMULATOR": ""})
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["backend"] == "cann" and data["ascend_home"] == home
    assert data["libraries"]["opapi_transformer"] == os.path.join(home, "lib64", "libopapi_transformer.so")
    assert data["op_library"] == os.path.realpath(data["libraries"]["opapi_transformer"])
    assert data["toolkit_version"] == data["ops_version"] == "9.0.0"


@pytest.mark.slow  # the logic: test_conformance's baseline tests; here the flags end to end
def test_baseline_names_what_changed_under_another_kernel(main, tmp_path):
    old, same = str(tmp_path / "old.json"), str(tmp_path / "same.json")
    r = run_cli("--emulator", "conformance", "--filter", "dropless-float32", "--report", old,
                env={"PYACL_MOE_EMU_MUTATION": "fp16-accumulate"})
    assert r.returncode == 1, r.stderr
    code, out, err = main("--emulator", "conformance", "--filter", "dropless-float32", "--report", same,
                          "--baseline", old)
    assert code == 0, err  # changed bits alone do not fail a run whose cases pass
    assert "CHANGED dropless-float32-medium" in out and "CHANGED dropless-float32-overflow" not in out
    assert json.loads(open(same).read())["baseline"]["changed"]
    code, out, err = main("--emulator", "conformance", "--filter", "dropless-float32", "--baseline", same)
    assert code == 0 and "0 of 17 outputs changed bits, 0 went from pass to fail" in out


def test_strict_and_exact_pass_on_the_emulator(main):
    code, out, err = main("--emulator", "conformance", "--strict", "--filter", "neg-")
    assert code == 0, out + err
    code, out, err = main("--emulator", "conformance", "--exact", "--filter=-tiny")
    assert code == 0 and "judged by exact)" in out, out + err


def test_full_help_gives_the_real_input_size():
    from pyacl_moe.tools import conformance

    conf = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["conformance"]._actions
                if "--full" in a.option_strings)
    largest = max(c.nbytes for c in conformance.catalogue("full"))
    assert "inputs up to 1 GiB" in conf.help and 1 << 30 < largest < 3 << 29


# Every numeric flag of every command, with values it must refuse. Whichever check finds one
# (argparse's type, a check against another flag, the size check), the line reads the same.
HUGE = "99999999999999999999"
NUMERIC_REFUSALS = [
    ("run", ["--tokens", "-3"], "--tokens", "must be >= 1, got -3"),
    ("run", ["--tokens", "0"], "--tokens", "must be >= 1, got 0"),
    ("run", ["--tokens", "x"], "--tokens", "must be an integer, got 'x'"),
    ("run", ["--tokens", "1.5"], "--tokens", "must be an integer, got '1.5'"),
    ("run", ["--top-k", "0"], "--top-k", "must be >= 1, got 0"),
    ("run", ["--top-k", "four"], "--top-k", "must be an integer"),
    ("run", ["--hidden", "-1"], "--hidden", "must be >= 1, got -1"),
    ("run", ["--hidden", "x"], "--hidden", "must be an integer, got 'x'"),
    ("run", ["--seed", "-1"], "--seed", "must be >= 0, got -1"),
    ("run", ["--seed", "s"], "--seed", "must be an integer"),
    ("run", ["--mode", "active", "--active-num", "0"], "--active-num", "must be >= 1, got 0"),
    ("run", ["--mode", "active", "--active-num", "300"], "--active-num", "must be at most N*K = 256, got 300"),
    ("run", ["--active-num", "4"], "--active-num", "applies to --mode active, not dropless"),
    ("run", ["--mode", "drop-pad", "--experts", "0"], "--experts", "must be >= 1, got 0"),
    ("run", ["--experts", "4"], "--experts", "applies to --mode drop-pad, not dropless"),
    ("run", ["--mode", "drop-pad", "--capacity", "-2"], "--capacity", "must be >= 1, got -2"),
    ("run", ["--mode", "active", "--capacity", "2"], "--capacity", "applies to --mode drop-pad, not active"),
    # Huge: buffers no machine of today holds, and a row count past the int32 index.
    ("run", ["--tokens", "100000000", "--hidden", "100000"], "--tokens/--top-k/--hidden",
     "the inputs and the output alone need 200001600000000 bytes (181.9 TiB), more than the"),
    ("run", ["--hidden", HUGE], "--tokens/--top-k/--hidden", "bytes"),
    ("run", ["--tokens", "3000000000", "--hidden", "1"], "--tokens/--top-k/--hidden",
     "12000000000 rows to address, more than the int32 expanded_row_idx can"),
    ("run", ["--mode", "active", "--tokens", HUGE, "--active-num", "1"], "--tokens/--top-k/--hidden/--active-num",
     "rows to address"),
    ("run", ["--mode", "drop-pad", "--capacity", "100000000", "--hidden", "1000"],
     "--tokens/--top-k/--hidden/--experts/--capacity", "3200000257024 bytes"),
    ("run", ["--mode", "drop-pad", "--experts", HUGE], "--tokens/--top-k/--hidden/--experts/--capacity", "rows"),
    ("conformance", ["--seed", "-1"], "--seed", "must be >= 0, got -1"),
    ("conformance", ["--seed", "abc"], "--seed", "must be an integer, got 'abc'"),
    ("conformance", ["--perf", "-1"], "--perf", "must be >= 0, got -1"),
    ("conformance", ["--perf", "2.5"], "--perf", "must be an integer, got '2.5'"),
    ("conformance", ["--perf-threshold", "0"], "--perf-threshold", "must be a finite number > 0, got 0"),
    ("conformance", ["--perf-threshold", "-1"], "--perf-threshold", "must be a finite number > 0, got -1"),
    ("conformance", ["--perf-threshold", "nan"], "--perf-threshold", "must be a finite number > 0, got nan"),
    ("conformance", ["--perf-threshold", "inf"], "--perf-threshold", "must be a finite number > 0, got inf"),
    ("conformance", ["--perf-threshold", "x"], "--perf-threshold", "must be a number, got 'x'"),
    ("conformance", ["--device", "-1"], "--device", "must be >= 0, got -1"),
    ("conformance", ["--device", "x"], "--device", "must be an integer, got 'x'"),
    ("conformance", ["--device", HUGE], "--device", f"device {HUGE} does not exist"),
    ("conformance", ["--devices", "0,-1"], "--devices", "0,-1: give distinct non-negative device ids"),
    ("conformance", ["--devices", "a,b"], "--devices", "a,b: give distinct non-negative device ids"),
    ("conformance", ["--devices", f"0,{HUGE}"], "--devices", f"device {HUGE} does not exist"),
    ("conformance", ["--rtol", "-1", "--standard", "pyacl"], "--rtol", "-1: the value must be a finite number >= 0"),
    ("conformance", ["--rtol", "x", "--standard", "pyacl"], "--rtol", "x: the value must be a finite number >= 0"),
    ("conformance", ["--atol", "1e999", "--standard", "pyacl"], "--atol", "the value must be a finite number >= 0"),
    ("conformance", ["--atol", "int8=0.1", "--standard", "pyacl"], "--atol", "the dtype must be one of"),
    ("conformance", ["--max-memory", "-1"], "--max-memory", "-1: give a size such as 4096, 512M or 2GiB"),
    ("conformance", ["--max-memory", "1", "--filter", "dropless-float32"], "--max-memory", "1 B leaves no case to run"),
    ("conformance", ["--max-memory", "12Q"], "--max-memory", "12Q: give a size"),
]


@pytest.mark.parametrize("command, flags, flag, says", NUMERIC_REFUSALS,
                         ids=[" ".join([c, *f]) for c, _, f, _ in [(r[0], 0, r[1], 0) for r in NUMERIC_REFUSALS]])
def test_every_numeric_flag_is_refused_in_one_style(main, no_case_may_run, command, flags, flag, says):
    code, out, err = refused(main, "--emulator", command, *flags)
    assert code == 2 and out == "", out + err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"pyacl-moe {command}: error: argument {flag}: ") and says in err, err
    assert err.endswith(f" (see pyacl-moe {command} --help)\n"), err


def test_the_size_check_refuses_only_what_cannot_fit():
    from pyacl_moe.tools.cases import too_large

    # inputs 64*4*256*4 + 64*4*4 bytes, output 64*256*4: 328704 bytes in all.
    assert too_large(64, 4, 256, memory=328704) is None
    assert "need 328704 bytes" in too_large(64, 4, 256, memory=328703)
    assert too_large(2**31 - 1, 1, 1, memory=2**40) is None  # the last row the int32 index addresses
    assert "rows to address" in too_large(2**31, 1, 1, memory=2**40)


def test_a_memory_error_past_the_check_is_one_line(main, monkeypatch):
    from pyacl_moe.tools import cases

    def out_of_memory(*a, **k):
        raise MemoryError("Unable to allocate 20 GiB for an array")

    monkeypatch.setattr(cases, "make_case", out_of_memory)
    code, out, err = main("--emulator", "run")
    assert code == 2 and out == ""
    assert err == "pyacl-moe: error: out of memory: Unable to allocate 20 GiB for an array; give smaller sizes\n"


def _parsers(parser=None, prog="pyacl-moe"):
    """(prog, parser) of the command and of every subcommand, at any depth."""
    parser = parser or cli.build_parser()
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{prog} {name}")


@pytest.mark.parametrize("prog, parser", list(_parsers()), ids=lambda v: v if isinstance(v, str) else "")
def test_help_states_each_default_once(prog, parser):
    text = parser.format_help()
    assert "(default: False)" not in text and "(default: None)" not in text, text
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help and action.help is not argparse.SUPPRESS:
            shown = formatter._expand_help(action)
            assert shown.count("(default") <= 1, f"{prog} {action.option_strings}: {shown}"


@pytest.mark.parametrize("command, names", [([], "{info,run,conformance,merge,bench,emulator}"),
                                            (["emulator"], "{build,path}")])
def test_a_missing_subcommand_is_named_by_its_choices(main, command, names):
    code, out, err = refused(main, *command)
    prog = " ".join(["pyacl-moe", *command])
    assert code == 2 and out == ""
    assert err == f"{prog}: error: the following arguments are required: {names} (see {prog} --help)\n"


def test_emulator_flag_after_the_subcommand_and_defaults_in_help():
    r = run_cli("run", "--emulator", "--tokens", "8", env={"PYACL_MOE_EMULATOR": "0"})
    assert r.returncode == 0, r.stderr
    assert "on emulator" in r.stdout
    h = run_cli("run", "--help")
    assert "(default: 64)" in h.stdout and "(default: float32)" in h.stdout


@pytest.mark.parametrize("command", [["conformance", "--list"], ["run"]])
def test_a_reader_that_leaves_early_gets_no_traceback(command):
    p = subprocess.Popen([sys.executable, "-m", "pyacl_moe.cli", "--emulator", *command],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None
    p.stdout.close()  # the reader is gone before anything is written, as after `| head -0`
    _, err = p.communicate(timeout=300)
    assert b"Traceback" not in err and b"BrokenPipe" not in err and b"Exception ignored" not in err, err


def test_bench_exit_status_follows_its_targets(monkeypatch, capsys):
    from pyacl_moe.tools import bench

    res = dict.fromkeys(bench.KEYS, 1.0)
    res.update(backend="emulator", numpy_kernel_ns=0.0, numpy_call_mallocs=0.0, fwd_numpy_kernel_ns=0.0,
               fwd_numpy_call_mallocs=0.0)
    extra = {"oneshot_uncached_ns": 1, "input_mib": 1, "reference_peak_extra_mib": 1, "kernel_gb_per_s": 1,
             "copy_gb_per_s": 1, "fwd_out_mib": 1, "fwd_kernel_gb_per_s": 1}
    monkeypatch.setattr(bench, "run", lambda quick=False, log=None: (dict(res), extra))
    assert cli.main(["bench", "--quick"]) == 0
    res["numpy_call_mallocs"] = 2.0  # a missed target
    assert cli.main(["bench", "--quick", "--json"]) == 1
    capsys.readouterr()
