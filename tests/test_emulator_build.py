"""Building the emulator: cached, atomic under concurrency, clear without a compiler."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyacl_moe.emulator import _build


def _build_in(cache: Path, env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYACL_MOE_CACHE=str(cache), **(env_extra or {}))
    return subprocess.Popen(
        [sys.executable, "-c", "import pyacl_moe.emulator as e; print(e.build())"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


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


def test_fresh_build_is_fast_and_laid_out_like_cann(fresh_build):
    cache, home, elapsed = fresh_build
    assert home.parent == cache
    for name in ("ascendcl", "nnopbase", "opapi"):
        assert (home / "lib64" / f"lib{name}.so").is_file()
    assert elapsed < 10, f"build took {elapsed:.1f} s"
    lib = str(home / "lib64" / "libopapi.so")
    needed = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True).stdout
    assert "[libnnopbase.so]" in needed and "$ORIGIN" in needed


def test_concurrent_builds_both_succeed(tmp_path):
    procs = [_build_in(tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    homes = {o[0].strip() for o in outs}
    assert len(homes) == 1
    assert not [d for d in tmp_path.iterdir() if d.name.startswith(".build-")]  # no debris


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
