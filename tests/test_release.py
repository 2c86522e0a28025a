"""CANN releases: names and order, what each release's op does, reading an install's versions,
judging a home from its files, and the binding on every emulated release, loaded through the
real search exactly as a CANN of that release (``ASCEND_HOME_PATH``, no ``--emulator``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pyacl_moe import emulator, release
from pyacl_moe._cann import layout

ROOT = Path(__file__).resolve().parent.parent


def _clean_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("PYACL_MOE_EMULATOR", "ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "LD_LIBRARY_PATH",
                 "PYACL_MOE_EMU_RELEASE"):
        env.pop(name, None)
    env.update(extra)
    return env


def _python(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=str(ROOT), timeout=120,
                          env=_clean_env(**env))


# ---------------------------------------------------------------------------- names and order

ORDERED = ["8.0.RC2.alpha002", "8.0.RC2", "8.0.0", "8.1.RC1", "8.5.0.alpha001", "8.5.0-beta.1", "8.5.0",
           "9.0.0-beta.2", "9.0.0-rc.1", "9.0.0", "9.0.1", "9.1.0-beta.1", "9.1.0-beta.2.pre", "9.1.0-beta.2",
           "9.1.0-beta.3", "9.1.0.pre", "9.1.0", "v9.2.0"]


def test_every_release_form_parses_and_orders_as_the_vendor_numbers_them():
    parsed = [release.parse_release(t) for t in ORDERED]
    assert [str(p) for p in sorted(reversed(parsed))] == ORDERED
    assert release.parse_release("8.1.RC1") == release.parse_release("8.1.rc1") != release.parse_release("8.1.0")
    r = release.parse_release("9.0.0-beta.2")
    assert (r.major, r.minor, r.patch, r.qualifiers) == (9, 0, 0, ((1, 2),))


@pytest.mark.parametrize("text", ["7.7.0.1.238", "V100R001C21SPC001B238", "8.0.T6", "9.1", "", "latest"])
def test_what_is_no_release_name_is_refused_by_name(text):
    if text == "9.1":
        assert release.parse_release(text).patch == 0  # major.minor alone is a release (9.1 = 9.1.0)
        return
    with pytest.raises(ValueError, match="not a CANN release name"):
        release.parse_release(text)


# ---------------------------------------------------------------------------- what each release does

@pytest.mark.parametrize("name, since, tiling, dtype, mixed, empty, strided", [
    ("8.0.0", "8.0.0", 561002, 161002, 161002, 161002, "dense"),
    ("8.1.RC1", "8.0.0", 561002, 161002, 161002, 161002, "dense"),
    ("8.5.0", "8.0.0", 561002, 161002, 161002, 161002, "dense"),
    ("9.0.1", "8.0.0", 561002, 161002, 161002, 161002, "dense"),
    ("9.1.0-beta.1", "9.1.0-beta.1", 561103, 561103, 561103, 0, "strides"),
    ("9.1.0-beta.3", "9.1.0-beta.2.pre", 561103, 161002, 561103, 0, "strides"),
    ("9.1.0", "9.1.0.pre", 561103, 161002, 161002, 0, "strides"),
])
def test_each_release_gets_the_behaviour_read_from_its_tag(name, since, tiling, dtype, mixed, empty, strided):
    applies = release.behaviour_for(name)
    b = applies.behaviour
    assert (b.since, b.tiling_status, b.dtype_status, b.mixed_dtype_status, b.empty_dtype_status, b.strided_out) == (
        since, tiling, dtype, mixed, empty, strided)
    assert "ops-transformer v" in b.source and applies.note == ""
    assert b.workspace(16 << 20) == (16 << 20) + (512 if b.entry == "l0op" else 0)


def test_the_releases_after_9_1_0_are_known_by_name_and_order():
    names = ["9.1.0", "9.1.1", "9.2.0-beta", "9.2.0-beta.1", "9.2.0-beta.2", "9.2.0"]
    parsed = [release.parse_release(n) for n in names]
    assert parsed == sorted(parsed) and len(set(parsed)) == len(parsed)
    assert release.KNOWN_AFTER_9_1 == ("9.1.1", "9.2.0-beta.1", "9.2.0-beta.2")
    assert release.parse_release("9.2.0-beta") == release.parse_release("9.2.0-beta.0")  # as the runtime reads it
    for known in release.KNOWN_AFTER_9_1:
        applies = release.behaviour_for(known)
        assert applies.behaviour is release.BEHAVIOURS[-1] and applies.note == "", (known, applies.note)
    assert "newer than the newest release known" in release.behaviour_for("9.2.0").note


def test_a_newer_install_runs_with_the_newest_expectations_and_its_report_says_so():
    from pyacl_moe.tools import conformance

    applies = release.behaviour_for("9.3.0")
    assert applies.behaviour is release.BEHAVIOURS[-1]
    report = conformance.Report("cann", "9.3.0", "Ascend950PR_9599", "quick", 0, chip="Ascend950",
                                expectations={"note": applies.note})
    assert "newer than the newest release known (9.2.0-beta.2): the newest's expectations apply" in report.summary()
    assert "Ascend950PR_9599 (Ascend950)" in report.summary()


def test_a_release_newer_or_older_than_every_entry_says_so():
    newer = release.behaviour_for("10.0.0")
    assert newer.behaviour is release.BEHAVIOURS[-1]
    assert "newer than the newest release known (9.2.0-beta.2)" in newer.note
    older = release.behaviour_for("7.0.0")
    assert older.behaviour is release.BEHAVIOURS[0] and "older than the oldest" in older.note
    odd = release.behaviour_for("8.0.T6")
    assert odd.behaviour is release.BEHAVIOURS[0] and "read as 8.0" in odd.note
    assert "unknown" in release.behaviour_for(None).note


# ---------------------------------------------------------------------------- an install's versions

def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_versions_of_a_toolkit_install(tmp_path):
    home = tmp_path / "ascend-toolkit" / "latest"
    _write(home / f"{layout.arch()}-linux" / "ascend_toolkit_install.info",
           "package_name=Ascend-cann-toolkit\nversion=8.1.RC1\ninnerversion=V100R001C21SPC001B238\n")
    _write(home / "runtime" / "version.info", "Version=7.7.0.1.238\nversion_dir=8.1.RC1\n")
    v = release.read_versions(str(home))
    assert (v.toolkit, v.ops, v.runtime) == ("8.1.RC1", None, "7.7.0.1.238")
    assert v.sources["toolkit_version"].endswith("ascend_toolkit_install.info")


def test_the_legacy_version_cfg_names_the_release(tmp_path):
    _write(tmp_path / "version.cfg", "# version: 1.0\nruntime_running_version=[7.7.0.1.238:8.1.RC1]\n")
    v = release.read_versions(str(tmp_path))
    assert v.toolkit == "8.1.RC1" and v.sources["toolkit_version"].endswith("version.cfg")


def test_versions_of_a_cann_install_and_of_its_packages(tmp_path):
    home = tmp_path / "cann-9.1.0"
    _write(home / "aarch64-linux" / "ascend_toolkit_install.info", "version=9.1.0\n")
    _write(home / "aarch64-linux" / "ascend_ops_install.info", "package_name=Ascend-cann-910b-ops\nversion=9.1.0\n")
    _write(home / "share" / "info" / "ops_transformer" / "version.info", "Version=9.1.0-beta.3\nversion_dir=cann\n")
    _write(home / "share" / "info" / "runtime" / "version.info", "Version=9.0.0\n")
    v = release.read_versions(str(home))
    # ops-transformer upgraded apart: its own version.info wins over the ops package's record.
    assert (v.toolkit, v.ops, v.runtime) == ("9.1.0", "9.1.0-beta.3", "9.0.0")
    (home / "share" / "info" / "ops_transformer" / "version.info").unlink()
    assert release.read_versions(str(home)).ops == "9.1.0"


def test_a_library_found_by_the_loader_leads_to_its_install(tmp_path):
    home = tmp_path / "8.1.RC1"
    lib64 = home / "aarch64-linux" / "lib64"
    lib64.mkdir(parents=True)
    _write(home / "aarch64-linux" / "ascend_toolkit_install.info", "version=8.1.RC1\n")
    (lib64 / "libascendcl.so").write_bytes(b"")
    (tmp_path / "lib64").symlink_to(lib64)
    assert release.read_versions(None, library_paths=[str(tmp_path / "lib64" / "libascendcl.so")]).toolkit == "8.1.RC1"
    assert release.read_versions(None, library_paths=["libascendcl.so"]).toolkit is None


# ---------------------------------------------------------------------------- reading a library's ELF

def test_a_library_is_read_without_loading_it():
    libs = dict(emulator.library_paths("9.1.0"))
    assert layout.needed(libs["op"])[:3] == ("libopapi_math.so", "libnnopbase.so", "libascendcl.so")
    entry = "aclnnMoeInitRoutingV2Grad"
    assert layout.defined_symbols(libs["op"], [entry, "aclrtMalloc"]) == {entry}
    assert layout.defined_symbols(libs["ascendcl"], ["aclrtMalloc", "aclsysGetVersionStr"]) == {
        "aclrtMalloc", "aclsysGetVersionStr"}
    assert layout.defined_symbols(dict(emulator.library_paths("8.1.RC1"))["ascendcl"], ["aclsysGetVersionStr"]) == set()


def test_what_is_not_an_elf_reads_as_unknown(tmp_path):
    junk = tmp_path / "libjunk.so"
    for data in (b"", b"\x7fELF", b"\x7fELF" + bytes(60), os.urandom(4096), b"#!/bin/sh\n"):
        junk.write_bytes(data)
        assert layout.needed(str(junk)) is None or layout.needed(str(junk)) == ()
        assert layout.defined_symbols(str(junk), ["x"]) in (None, set())
    assert layout.needed(str(tmp_path / "missing.so")) is None


# ---------------------------------------------------------------------------- every emulated release

@pytest.fixture(scope="module")
def homes() -> dict[str, str]:
    return {r: emulator.path(r) for r in emulator.RELEASES}


@pytest.mark.parametrize("name", emulator.RELEASES)
def test_each_emulated_release_loads_through_the_real_search_and_behaves_as_that_release(homes, name):
    home = homes[name]
    r = _python(["-m", "tests.release_probe"], ASCEND_HOME_PATH=home)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    new = release.parse_release(name) >= release.parse_release("8.5.0")
    assert got["backend"] == "cann" and got["home"] == home
    assert got["toolkit_version"] == name and got["ops_version"] == (name if new else None)
    assert got["runtime_version"] == {"8.0.0": None, "8.1.RC1": "7.7.0.1.238"}.get(name, name)
    op = "libopapi_transformer.so" if new else "libopapi.so"
    assert os.path.basename(got["op_library"]) == op and os.path.isfile(got["op_library"])
    if new:
        assert f"cann-{name}/{layout.arch()}-linux/lib64/" in got["op_library"]
        assert [os.path.basename(d) for d in got["dependencies"]] == ["libopapi_math.so"]
    else:
        # Up to 8.3 the all-in-one library lives in the op_api folder, linked from lib64.
        assert f"{name}/opp/built-in/op_impl/ai_core/tbe/op_api/lib/linux/{layout.arch()}/" in got["op_library"]
        assert got["dependencies"] == []
    l0op = name == "9.1.0"
    assert got["tiling_status"] == (561103 if l0op else 561002)
    assert got["strided_out"] == ("strides" if l0op else "dense")
    assert (got["binding_strided_out"] == "accepted") == l0op, got["binding_strided_out"]
    assert got["workspace"] == (16777728 if l0op else 16777216)
    assert got["one_call"] and got["plan"] and got["forward_rows"] == [12, 5]
    assert got["expectations"] == ("9.1.0.pre" if l0op else "8.0.0") and got["note"] == ""


@pytest.mark.parametrize("name", ["8.1.RC1", "9.1.0"])
def test_set_env_sh_exports_the_home_emulator_path_prints(homes, name):
    if not shutil.which("bash"):
        pytest.skip("needs bash")
    home = homes[name]
    script = (Path(home).parent / "set_env.sh") if name == "8.1.RC1" else Path(home) / "set_env.sh"
    r = subprocess.run(["bash", "-c", f'source "{script}" && echo "$ASCEND_HOME_PATH"'], capture_output=True,
                       text=True, env=_clean_env(PYACL_MOE_EMU_RELEASE=name))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == home
    printed = subprocess.run([sys.executable, "-m", "pyacl_moe.cli", "emulator", "path"], capture_output=True,
                             text=True, env=_clean_env(PYACL_MOE_EMU_RELEASE=name), cwd=str(ROOT)).stdout.strip()
    assert printed == home


def test_an_unknown_emulated_release_is_refused_by_name():
    r = _python(["-m", "pyacl_moe.cli", "emulator", "path"], PYACL_MOE_EMU_RELEASE="8.2.RC1")
    assert r.returncode == 2 and "PYACL_MOE_EMU_RELEASE='8.2.RC1'" in r.stderr and "9.1.0" in r.stderr


@pytest.mark.parametrize("short, full", [("9.1", "9.1.0"), ("8.1", "8.1.RC1"), ("8.0", "8.0.0")])
def test_the_short_names_the_readme_writes_are_the_emulated_releases_of_that_line(short, full):
    """PYACL_MOE_EMU_RELEASE=9.1 was "malformed" though the README writes 9.1 (issue: papercuts, 7)."""
    from pyacl_moe.emulator import _env, _releases

    _env.check_environment({"PYACL_MOE_EMU_RELEASE": short})
    assert _releases.selected({"PYACL_MOE_EMU_RELEASE": short}).release == full
    r = _python(["-c", "import pyacl_moe.emulator as e; print(e.release())"], PYACL_MOE_EMU_RELEASE=short)
    assert r.returncode == 0 and r.stdout.strip() == full, r.stderr
    # Blanks stay refused, as for every variable; a line the emulator lacks lists the lines it has.
    with pytest.raises(ValueError, match=r"or its line 8\.0, 8\.1, 8\.5, 9\.0, 9\.1"):
        _env.check_environment({"PYACL_MOE_EMU_RELEASE": "9.2"})
    with pytest.raises(ValueError, match="malformed"):
        _env.check_environment({"PYACL_MOE_EMU_RELEASE": f" {short}"})


# ---------------------------------------------------------------------------- homes that do not fit

def _copy_home(homes: dict[str, str], name: str, tmp_path: Path) -> Path:
    """A copy of an emulated release's install, its links kept, to break in a test."""
    src = Path(homes[name])
    root = src.parent if name.startswith("8.") else src  # ascend-toolkit/ or cann-<release>/
    dst = tmp_path / root.name
    shutil.copytree(root, dst, symlinks=True)
    return dst / src.name if name.startswith("8.") else dst


def _info(home: Path) -> subprocess.CompletedProcess[str]:
    return _python(["-m", "pyacl_moe.cli", "info", "--json"], ASCEND_HOME_PATH=str(home))


def test_a_home_whose_op_library_lacks_the_op_is_refused_by_name(homes, tmp_path):
    home = _copy_home(homes, "9.0.0", tmp_path)
    lib64 = home / f"{layout.arch()}-linux" / "lib64"
    shutil.copy(lib64 / "libopapi_math.so", lib64 / "libopapi_transformer.so")  # a library, not this op's
    r = _info(home)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "lib64/libopapi_transformer.so: exports none of the op's entry points" in r.stderr
    assert f"$ASCEND_HOME_PATH = {home}" in r.stderr


def test_a_9_1_home_without_libopapi_math_is_refused_naming_the_dependency(homes, tmp_path):
    home = _copy_home(homes, "9.1.0", tmp_path)
    (home / f"{layout.arch()}-linux" / "lib64" / "libopapi_math.so").unlink()
    r = _info(home)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "lib64/libopapi_transformer.so: a dependency is missing: libopapi_math.so (needed by " \
           "libopapi_transformer.so)" in r.stderr


def test_all_four_entry_points_come_from_one_library_the_first_that_has_them(homes, tmp_path):
    # A per-repository library without the op is passed over for the all-in-one library that has
    # it, and nothing is taken from the first one.
    home = _copy_home(homes, "9.0.0", tmp_path)
    lib64 = home / f"{layout.arch()}-linux" / "lib64"
    os.rename(lib64 / "libopapi_transformer.so", lib64 / "libopapi.so")
    shutil.copy(lib64 / "libopapi_math.so", lib64 / "libopapi_transformer.so")
    r = _info(home)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert os.path.basename(info["op_library"]) == "libopapi.so" and "opapi_transformer" not in info["libraries"]


def test_a_runtime_library_lacking_a_function_is_refused_by_name(homes, tmp_path):
    home = _copy_home(homes, "8.1.RC1", tmp_path)
    lib64 = home / "lib64"
    real = Path(os.path.realpath(lib64 / "libnnopbase.so"))
    real.unlink()
    shutil.copy(os.path.realpath(lib64 / "libascendcl.so"), real)
    r = _info(home)
    assert r.returncode == 2 and "lib64/libnnopbase.so: lacks aclCreateTensor" in r.stderr


# The latest by default (8.1.RC1's op entry: test_emulator_releases), all in the slow step.
@pytest.mark.parametrize("name", [n if n == "9.1.0" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in emulator.RELEASES])
def test_conformance_passes_on_each_emulated_release_and_names_it(homes, name, tmp_path):
    report = tmp_path / "r.json"
    r = _python(["-m", "pyacl_moe.cli", "conformance", "--quick", "--report", str(report)],
                ASCEND_HOME_PATH=homes[name])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    data = json.loads(report.read_text())
    assert data["backend"] == "cann" and data["toolkit_version"] == data["cann_version"] == name
    assert data["ops_version"] == (None if name.startswith("8.0") or name.startswith("8.1") else name)
    assert data["op_library"] == os.path.realpath(dict(emulator.library_paths(name))["op"])
    assert data["expectations"]["since"] == ("9.1.0.pre" if name == "9.1.0" else "8.0.0")
    statuses = {c["name"]: c["status"] for c in data["cases"]}
    assert statuses["neg-not-divisible"] == (561103 if name == "9.1.0" else 561002)


def test_a_release_file_that_is_a_fifo_or_a_device_is_not_read(tmp_path):
    """version.info read with read_text(): a FIFO hung the read (and `pyacl-moe info`) for good,
    a link to /dev/zero read until memory ran out. A release file is read only when it is a
    regular file, and at most its first 64 KiB; the others read as not recorded, and a long
    file gives its first lines."""
    home = tmp_path / "cann-9.1.0"
    _write(home / "share" / "info" / "ops_transformer" / "version.info", "Version=9.1.0\n" + "#" * (1 << 20))
    (home / "share" / "info" / "runtime").mkdir()
    os.mkfifo(home / "share" / "info" / "runtime" / "version.info")
    os.symlink("/dev/zero", home / "version.cfg")
    got: list[release.Versions] = []
    t = threading.Thread(target=lambda: got.append(release.read_versions(str(home))), daemon=True)
    t.start()
    t.join(20)
    assert got, "reading the release files of a home hung"
    assert (got[0].ops, got[0].runtime, got[0].toolkit) == ("9.1.0", None, None), got[0]


def test_info_shows_what_an_install_records_escaped_never_sent_to_the_terminal(homes, tmp_path):
    """An install's version.info is anyone's text: `pyacl-moe info` printed it raw, so an escape
    sequence in it reached the terminal (a title, a cleared screen, a forged line)."""
    home = _copy_home(homes, "9.0.0", tmp_path)
    info = home / "share" / "info" / "ops_transformer" / "version.info"
    info.write_text("Version=9.0.0\x1b]0;owned\x07\x1b[2J\rforged\n")
    r = _python(["-m", "pyacl_moe.cli", "info"], ASCEND_HOME_PATH=str(home))
    assert r.returncode == 0, r.stderr
    assert not any(c in r.stdout for c in "\x1b\x07\r"), repr(r.stdout)
    assert "9.0.0\\x1b]0;owned\\x07\\x1b[2J\\rforged" in r.stdout, r.stdout
