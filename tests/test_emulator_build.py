"""Building the emulator: cached, atomic under concurrency, clear without a compiler, never
loading a build someone else could have written, and bounded in time."""

from __future__ import annotations

import os
import platform
import shutil
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from pyacl_moe.emulator import _build


def _build_in(cache: Path, env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYACL_MOE_CACHE=str(cache), **(env_extra or {}))
    return subprocess.Popen(
        [sys.executable, "-c", "import pyacl_moe.emulator as e; print(e.build())"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


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


@pytest.mark.slow  # a compile from scratch (fresh_build)
def test_fresh_build_is_laid_out_like_cann(fresh_build):
    cache, home, _ = fresh_build
    assert home.parent == cache
    for name in ("ascendcl", "nnopbase", "opapi"):
        assert (home / "lib64" / f"lib{name}.so").is_file()
    lib = str(home / "lib64" / "libopapi.so")
    needed = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True).stdout
    assert "[libnnopbase.so]" in needed and "$ORIGIN" in needed


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
    stamp = (home / "lib64" / "libopapi.so").stat().st_mtime_ns
    assert _build.build() == str(home)
    assert (home / "lib64" / "libopapi.so").stat().st_mtime_ns == stamp


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
    for _, sources, _ in _build.LIBRARIES:
        assert set(sources) <= names
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

def _fake_compile(tmp, cc, timeout):
    """Stands in for the compiler where only the choice of directory is under test."""
    lib64 = tmp / "lib64"
    lib64.mkdir(mode=0o700)
    for name, _, _ in _build.LIBRARIES:
        (lib64 / f"lib{name}.so").write_bytes(b"built by this process")


def _plant(home: Path, mode: int = 0o700, uid: int | None = None) -> None:
    """A complete-looking build directory with libraries that must never be loaded."""
    (home / "lib64").mkdir(parents=True)
    for name, _, _ in _build.LIBRARIES:
        (home / "lib64" / f"lib{name}.so").write_bytes(b"planted")
    rel = _build._release_dir(home)
    rel.mkdir()
    (rel / _build.RELEASE_FILE).write_text("version=planted\n")
    for p in (home, *home.rglob("*")):
        if uid is not None:
            os.chown(p, uid, uid)
        os.chmod(p, mode if p.is_dir() else 0o644)


def _libs_of(home: str) -> set[bytes]:
    return {(Path(home) / "lib64" / f"lib{n}.so").read_bytes() for n, _, _ in _build.LIBRARIES}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache of the test's own, and a compiler that only writes marker libraries."""
    root = tmp_path / "cache"
    monkeypatch.setenv("PYACL_MOE_CACHE", str(root))
    monkeypatch.setattr(_build, "_compile_into", _fake_compile)
    return root


def test_new_cache_root_and_build_are_private(cache):
    home = Path(_build.build())
    assert home.parent == cache
    for p in (cache, home, home / "lib64"):
        st = p.stat()
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700, (p, oct(st.st_mode))
    assert all(not (p.stat().st_mode & 0o022) for p in home.rglob("*"))


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a directory owned by another user needs root")
def test_build_owned_by_another_user_is_not_loaded(cache):
    cache.mkdir(mode=0o700)
    home = cache / f"emulator-{_build.build_hash()}"
    _plant(home, uid=54321)
    with pytest.warns(UserWarning, match="owned by uid 54321"):
        got = _build.build()
    assert _libs_of(got) == {b"built by this process"}
    assert Path(got).stat().st_uid == os.geteuid()


@pytest.mark.parametrize("mode", [0o775, 0o777], ids=["0o775", "0o777"])
def test_build_writable_by_others_is_not_loaded(cache, mode):
    cache.mkdir(mode=0o700)
    home = cache / f"emulator-{_build.build_hash()}"
    _plant(home, mode=mode)
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
    shutil.rmtree(got.parent)
    os.chmod(cache, 0o1777)  # as /tmp: others cannot rename or remove what is ours
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Path(_build.build()).parent == cache


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
def test_release_file_says_what_the_build_is(fresh_build):
    _, home, _ = fresh_build
    infos = list(home.glob("*-linux/ascend_toolkit_install.info"))
    assert len(infos) == 1 and infos[0].parent.name == f"{platform.machine()}-linux"
    fields = dict(line.split("=", 1) for line in infos[0].read_text().splitlines())
    key = home.name.rsplit("-", 1)[1]
    assert fields["package_name"] == "pyacl-moe-emulator"
    assert fields["version"].startswith("pyacl-moe-emulator-") and fields["version"].endswith("+" + key)
    assert fields["arch"] == platform.machine() and fields["os"] == "linux"
    assert fields["path"] == str(infos[0].parent)
