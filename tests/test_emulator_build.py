"""Building the emulator: cached, atomic under concurrency, clear without a compiler, never
loading a build someone else could have written, and bounded in time."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
import warnings
from pathlib import Path

import pytest

from pyacl_moe import emulator
from pyacl_moe.emulator import _build, _releases

from . import children
from .conftest import start_isolated


def _build_in(cache: Path, env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    """A fresh interpreter building the emulator into ``cache`` (it prints the home)."""
    return start_isolated(children.child_build, env={"PYACL_MOE_CACHE": str(cache), **(env_extra or {})})


# The tests of a build from scratch share one compile of a few seconds: the slow step runs them
# (the default run builds, or reuses, the emulator it tests with anyway).
@pytest.fixture(scope="module")
def fresh_build(tmp_path_factory):
    """One build from scratch in a cache of its own, shared by the tests that inspect it."""
    cache = tmp_path_factory.mktemp("cache")
    t0 = time.perf_counter()
    p = _build_in(cache)
    out, err = p.communicate(timeout=120)
    elapsed = time.perf_counter() - t0
    assert p.returncode == 0, err
    return cache, Path(out.strip()), elapsed


def _tree_of(home: Path) -> Path:
    """The build folder a profile's home is in (``<tree>/<release>/Ascend/...``)."""
    return next(p for p in home.parents if p.name.startswith("emulator-") or p.name.startswith(".build-"))


@pytest.mark.slow  # a compile from scratch (fresh_build)
def test_fresh_build_is_laid_out_like_cann(fresh_build):
    cache, home, _ = fresh_build
    tree = _tree_of(home)
    assert tree.parent == cache and home == tree / _releases.DEFAULT / _releases.home(_releases.selected())
    for p in _releases.PROFILES.values():
        for lib in _releases.libraries(p):
            assert (tree / p.release / lib.path).is_file(), lib
        dynamic = subprocess.run(["readelf", "-d", str(tree / p.release / _releases.libraries(p)[-1].path)],
                                 capture_output=True, text=True).stdout
        assert "[libnnopbase.so]" in dynamic and "RUNPATH" not in dynamic


@pytest.mark.slow  # two compiles from scratch
def test_concurrent_builds_both_succeed(tmp_path):
    procs = [_build_in(tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    homes = {o[0].strip() for o in outs}
    assert len(homes) == 1
    assert not [d for d in tmp_path.iterdir() if d.name.startswith(".build-")]  # no debris


@pytest.mark.slow  # a compile from scratch (fresh_build)
def test_cached_build_is_reused(fresh_build, monkeypatch):
    cache, home, _ = fresh_build
    monkeypatch.setenv("PYACL_MOE_CACHE", str(cache))
    op = home / "lib64" / "libopapi_transformer.so"
    stamp = op.stat().st_mtime_ns
    assert _build.build() == str(home)
    assert op.stat().st_mtime_ns == stamp


def test_hash_follows_flags(monkeypatch):
    h1 = _build.build_hash()
    monkeypatch.setattr(_build, "CFLAGS", _build.CFLAGS + ("-DSOMETHING",))
    assert _build.build_hash() != h1


def test_no_compiler_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(_build.EmulatorBuildError, match="install a C compiler"):
        _build.build()
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(_build.EmulatorBuildError, match="CC"):
        _build.build()


def test_cache_key_covers_every_source(monkeypatch):
    # Every C source any library is built from is hashed, and so is each internal header.
    names = {f.name for f in _build._inputs()}
    for p in _releases.PROFILES.values():
        for lib in _releases.libraries(p):
            assert set(lib.sources) <= names
    assert {"emu.h", "emu_handles.h", "rt_internal.h", "aclemu.h"} <= names


def test_sanitizer_build_has_its_own_key_and_checks_its_names(monkeypatch):
    monkeypatch.delenv(_build.SANITIZE_ENV, raising=False)
    plain = _build.build_hash()
    monkeypatch.setenv(_build.SANITIZE_ENV, "address,undefined")
    assert _build.sanitize_flags()[0] == "-fsanitize=address,undefined"
    assert "-fno-omit-frame-pointer" in _build.sanitize_flags()
    assert _build.build_hash() != plain
    monkeypatch.setenv(_build.SANITIZE_ENV, "address,bogus")
    with pytest.raises(_build.EmulatorBuildError, match="bogus"):
        _build.sanitize_flags()


# ---------------------------------------------------------------------------- the cache's safety

def _lay_out_markers(tree: Path, final: Path, content: bytes) -> None:
    """Every profile's tree with marker files for libraries."""
    for p in _releases.PROFILES.values():
        for lib in _releases.libraries(p):
            path = tree / p.release / lib.path
            _releases.make_folders(path.parent)
            path.write_bytes(content)
            for link in lib.links:
                _releases.link(tree / p.release, link, lib.path)
        _releases.lay_out(p, tree / p.release, final / p.release)


def _fake_compile(tmp, final, cc, timeout):
    """Stands in for the compiler where only the choice of directory is under test."""
    _lay_out_markers(tmp, final, b"built by this process")


def _plant(tree: Path, mode: int = 0o700, uid: int | None = None, content: bytes = b"planted") -> None:
    """A complete-looking build directory with libraries that must never be loaded."""
    tree.mkdir(parents=True)
    _lay_out_markers(tree, tree, content)
    (tree / _build.BUILD_FILE).write_text("version=planted\n")
    for p in (tree, *tree.rglob("*")):
        if p.is_symlink():
            continue
        if uid is not None:
            os.chown(p, uid, uid)
        os.chmod(p, mode if p.is_dir() else 0o644)


def _libs_of(home: str) -> set[bytes]:
    tree = _tree_of(Path(home))
    return {(tree / p.release / lib.path).read_bytes() for p in _releases.PROFILES.values()
            for lib in _releases.libraries(p)}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache of the test's own, and a compiler that only writes marker libraries."""
    root = tmp_path / "cache"
    monkeypatch.setenv("PYACL_MOE_CACHE", str(root))
    monkeypatch.setattr(_build, "_compile_into", _fake_compile)
    return root


def test_new_cache_root_and_build_are_private(cache):
    tree = _tree_of(Path(_build.build()))
    assert tree.parent == cache
    for p in (cache, tree, tree / _releases.DEFAULT):
        st = p.stat()
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700, (p, oct(st.st_mode))
    assert all(p.is_symlink() or not (p.stat().st_mode & 0o022) for p in tree.rglob("*"))


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a directory owned by another user needs root")
def test_build_owned_by_another_user_is_not_loaded(cache):
    cache.mkdir(mode=0o700)
    tree = cache / f"emulator-{_build.build_hash()}"
    _plant(tree, uid=54321)
    with pytest.warns(UserWarning, match="owned by uid 54321"):
        got = _build.build()
    assert _libs_of(got) == {b"built by this process"}
    assert Path(got).stat().st_uid == os.geteuid()


def test_build_whose_link_leads_out_is_not_loaded(cache, tmp_path):
    # The release trees link their own folders; a link out of the build could swap in anyone's.
    cache.mkdir(mode=0o700)
    tree = cache / f"emulator-{_build.build_hash()}"
    _plant(tree)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    lib64 = tree / _releases.DEFAULT / _releases.release_folder(_releases.selected()) / "lib64"
    lib64.unlink()
    lib64.symlink_to(elsewhere)
    with pytest.warns(UserWarning, match="leads out of the build"):
        got = _build.build()
    assert _libs_of(got) == {b"built by this process"}


@pytest.mark.parametrize("mode", [0o775, 0o777], ids=["0o775", "0o777"])
def test_build_writable_by_others_is_not_loaded(cache, mode):
    cache.mkdir(mode=0o700)
    tree = cache / f"emulator-{_build.build_hash()}"
    _plant(tree, mode=mode)
    with pytest.warns(UserWarning, match="writable by group or others"):
        got = _build.build()
    assert _libs_of(got) == {b"built by this process"}
    assert stat.S_IMODE(Path(got).stat().st_mode) == 0o700


def test_shared_cache_root_needs_the_sticky_bit(cache):
    cache.mkdir()
    os.chmod(cache, 0o777)  # anyone may swap our build for theirs: built elsewhere
    with pytest.warns(UserWarning, match="without the sticky bit"):
        got = Path(_build.build())
    assert cache not in got.parents and _libs_of(str(got)) == {b"built by this process"}
    shutil.rmtree(_tree_of(got).parent)
    os.chmod(cache, 0o1777)  # as /tmp: others cannot rename or remove what is ours
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _tree_of(Path(_build.build())).parent == cache


def test_compiler_flags_in_cc_select_another_build(cache, monkeypatch):
    gcc = shutil.which("gcc")
    if not gcc:
        pytest.skip("needs gcc")
    monkeypatch.setenv("CC", gcc)
    plain = _build.build()
    monkeypatch.setenv("CC", f"{gcc} -O0")
    assert _build.build() != plain
    assert _build.build_hash() != _build.build_hash([gcc])


def test_a_hanging_compile_times_out(tmp_path, monkeypatch):
    cc = tmp_path / "hanging-cc"
    cc.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "hanging-cc 1"; exit 0; fi\nexec sleep 600\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("PYACL_MOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(_build.BUILD_TIMEOUT_ENV, "0.5")
    with pytest.raises(_build.EmulatorBuildError, match=r"timed out after 0\.5 s .*PYACL_MOE_EMU_BUILD_TIMEOUT"):
        _build.build()
    assert not list((tmp_path / "cache").iterdir())  # no half-built directory left
    monkeypatch.setenv(_build.BUILD_TIMEOUT_ENV, "soon")
    with pytest.raises(_build.EmulatorBuildError, match="PYACL_MOE_EMU_BUILD_TIMEOUT='soon'"):
        _build.build()


@pytest.mark.slow  # a compile from scratch (fresh_build)
def test_build_file_says_what_the_build_is(fresh_build):
    _, home, _ = fresh_build
    tree = _tree_of(home)
    fields = dict(line.split("=", 1) for line in (tree / _build.BUILD_FILE).read_text().splitlines())
    key = tree.name.rsplit("-", 1)[1]
    assert fields["package_name"] == "pyacl-moe-emulator"
    assert fields["version"].startswith("pyacl-moe-emulator-") and fields["version"].endswith("+" + key)
    assert fields["releases"].split(",") == list(_releases.PROFILES) and fields["default_release"] == "9.0.0"
    # Each release's own toolkit release file, where that release keeps it.
    for p in _releases.PROFILES.values():
        info = tree / p.release / _releases.release_folder(p) / f"{_releases.arch()}-linux" / \
            "ascend_toolkit_install.info"
        lines = dict(line.split("=", 1) for line in info.read_text().splitlines())
        assert lines["version"] == p.release and lines["package_name"] == "Ascend-cann-toolkit"


def test_a_build_says_in_one_line_what_it_builds_and_where(cache, capfd):
    """The first use compiled the emulator for seconds without a word (issue: a new user's
    papercuts, 3); a build that is cached says nothing, and --json turns the line off."""
    tree = _tree_of(Path(_build.build()))
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pyacl-moe: building the host emulator with ") and \
        str(tree) in lines[0], lines
    _build.build()
    assert capfd.readouterr().err == ""  # cached: silent
    emulator.announce_builds(False)
    try:
        _build.build(force=True)
        assert capfd.readouterr().err == ""
    finally:
        emulator.announce_builds(True)
