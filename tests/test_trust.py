"""What the loader trusts (README, *What the loader loads*): no library from a search of its own
through LD_LIBRARY_PATH, nothing from a relative or empty entry, a default home only when it
and every folder above it are root's or this user's and writable by no one else, no file
mapped before its ELF headers are read, and a load that is all or nothing.

Each case runs in a fresh interpreter (what a process loads is process-wide and final). A
planted library is a real shared object whose constructor leaves a file behind: the test
looks for the file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe import emulator

CC = shutil.which(os.environ.get("CC", "cc"))
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler to build a planted library")
CLEAN = {"PYACL_MOE_EMULATOR": "", "ASCEND_HOME_PATH": "", "ASCEND_TOOLKIT_HOME": "", "LD_LIBRARY_PATH": ""}


@pytest.fixture(scope="module")
def emu_home() -> str:
    return emulator.build()


def _planted(folder: Path, name: str, marker: Path, extra: str = "") -> Path:
    """A shared object ``folder/name`` (its soname) whose constructor writes ``marker``."""
    src = folder / f"{name}.c"
    src.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void planted(void) {{\n'
                   f'    FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("ran", f); fclose(f); }}\n}}\n{extra}\n')
    out = folder / name
    subprocess.run([CC, "-shared", "-fPIC", f"-Wl,-soname,{name}", "-o", str(out), str(src)], check=True,
                   capture_output=True)
    src.unlink()
    return out


def _copy_home(emu_home: str, to: Path) -> Path:
    """A copy of the emulator's release tree, laid out as a CANN install (its links kept)."""
    shutil.copytree(emu_home, to, symlinks=True)
    return to


def child_compute_in(folder: str) -> None:
    os.chdir(folder)  # a relative LD_LIBRARY_PATH entry means this folder to the dynamic loader
    try:
        got = pm.moe_init_routing_v2_grad(np.ones((8, 4), np.float32), np.arange(8, dtype=np.int32), 2)
        print(json.dumps({"ok": bool((got == 2).all()), "backend": pm.library_info().backend}))
    except pm.CannNotFoundError as exc:
        print(json.dumps({"not_found": exc.tried}))


@needs_cc
@pytest.mark.parametrize("entry", [".", "", "sub/.."], ids=["dot", "empty", "relative"])
@pytest.mark.parametrize("how", ["emulator", "ascend_home_path"])
def test_a_planted_loader_in_a_relative_library_path_entry_never_runs(isolated, emu_home, tmp_path, entry, how):
    # The emulator's libascendcl.so needs ld-linux-x86-64.so.2 (as CANN's do): the loader
    # looked for it through LD_LIBRARY_PATH's entries, "." included, and dlopened what it found.
    (tmp_path / "sub").mkdir()
    marker = tmp_path / "ran"
    machine = {"x86_64": "ld-linux-x86-64.so.2", "aarch64": "ld-linux-aarch64.so.1"}.get(os.uname().machine)
    if machine is None:
        pytest.skip("no known dynamic loader name for this machine")
    _planted(tmp_path, machine, marker)
    env = {**CLEAN, "LD_LIBRARY_PATH": f"{entry}:/nonexistent" if entry else ":/nonexistent"}
    env.update({"PYACL_MOE_EMULATOR": "1"} if how == "emulator" else {"ASCEND_HOME_PATH": emu_home})
    r = isolated(child_compute_in, str(tmp_path), env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"], r.stdout
    assert not marker.exists(), "the planted library's constructor ran"


@needs_cc
def test_a_planted_runtime_in_the_current_directory_is_never_loaded_through_an_empty_entry(isolated, tmp_path):
    # No home anywhere: the last resort dlopens libascendcl.so by name, and the dynamic loader
    # reads an empty LD_LIBRARY_PATH entry as the current directory. That resort is not tried
    # then; the error says why.
    marker = tmp_path / "ran"
    _planted(tmp_path, "libascendcl.so", marker)
    r = isolated(child_compute_in, str(tmp_path), env={**CLEAN, "LD_LIBRARY_PATH": ":/nonexistent",
                                                      "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "not_found" in out, out
    assert not marker.exists(), "the planted library's constructor ran"
    last = out["not_found"][-1]
    assert "dynamic loader" in last and "relative or empty entry ''" in last, last


def child_info() -> None:
    try:
        info = pm.library_info()
        print(json.dumps({"home": info.home, "backend": info.backend}))
    except pm.CannNotFoundError as exc:
        print(json.dumps({"not_found": exc.tried}))


def test_a_default_home_others_can_write_to_is_refused_and_the_same_tree_named_loads(isolated, emu_home,
                                                                                      tmp_path):
    # $HOME world-writable with the sticky bit, as on shared scratch machines, and the tree in
    # it another user's (when this test may give it away): found by default, it is refused with
    # the rule; named in ASCEND_HOME_PATH (the user's choice), it loads.
    home = tmp_path / "scratch"
    home.mkdir()
    tree = _copy_home(emu_home, home / "Ascend" / "cann")
    os.chmod(home, 0o1777)
    if os.geteuid() == 0:
        for dirpath, dirs, files in os.walk(home / "Ascend"):
            for name in (dirpath, *(os.path.join(dirpath, n) for n in dirs + files)):
                os.lchown(name, 4242, 4242)
    r = isolated(child_info, env={**CLEAN, "HOME": str(home)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    refused = [t for t in out.get("not_found", []) if str(tree) in t]
    assert refused and "refused" in refused[0] and "writable by no one else" in refused[0], out
    r = isolated(child_info, env={**CLEAN, "HOME": str(home), "ASCEND_HOME_PATH": str(tree)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"home": str(tree), "backend": "cann"}


def test_a_relative_named_home_is_refused(isolated, emu_home, tmp_path):
    link = tmp_path / "here"
    os.symlink(emu_home, link)
    r = isolated(child_compute_in, str(tmp_path), env={**CLEAN, "ASCEND_HOME_PATH": "here", "HOME": str(tmp_path)})
    out = json.loads(r.stdout)
    assert any("$ASCEND_HOME_PATH = here: refused: not an absolute path" in t for t in out["not_found"]), out


def _truncate(path: Path) -> None:
    real = Path(os.path.realpath(path))
    data = real.read_bytes()
    real.unlink()  # (a hard link may be shared with the original tree: write a new file)
    real.write_bytes(data[:len(data) // 2])


@pytest.mark.parametrize("which", ["lib64/libascendcl.so", "lib64/libnnopbase.so", "op"])
def test_a_library_cut_short_is_one_line_and_exit_2_never_a_signal(emu_home, tmp_path, which):
    tree = _copy_home(emu_home, tmp_path / "cann")
    rel = which if which != "op" else os.path.relpath(dict(emulator.library_paths())["op"], emu_home)
    _truncate(tree / rel)
    env = {**os.environ, **CLEAN, "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "pyacl_moe.cli", "conformance", "--ascend-home", str(tree)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cut short" in lines[0] and os.path.basename(rel) in lines[0], r.stderr
    # The library call: an exception, not SIGBUS.
    code = "import pyacl_moe as pm\ntry:\n    pm.Device(0)\nexcept pm.CannNotFoundError as e:\n    print(e.tried[0])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**env, "ASCEND_HOME_PATH": str(tree)})
    assert r.returncode == 0 and "cut short" in r.stdout, (r.returncode, r.stdout, r.stderr)


def child_failed_load_then_the_emulator(bad: str) -> None:
    try:
        pm.load(ascend_home=bad)
    except pm.CannNotFoundError as exc:
        failed = exc.tried
    else:
        sys.exit("the broken home loaded")
    pm.use_emulator()
    got = pm.moe_init_routing_v2_grad(np.full((8, 4), 3, np.float32), np.arange(8, dtype=np.int32), 2)
    with open("/proc/self/maps") as f:
        mapped = sorted({line.split()[-1] for line in f if line.rstrip().endswith("libascendcl.so")})
    print(json.dumps({"failed": failed, "right": bool((got == 6).all()), "mapped": mapped}))


@needs_cc
def test_a_load_that_fails_half_way_leaves_nothing_mapped(isolated, emu_home, tmp_path):
    # The runtime libraries load; the op library (with the four entry points) cannot, for it
    # needs a library that is gone. Nothing of that home may stay mapped: the emulator's op
    # library, loaded next, would bind to its runtime by soname.
    tree = _copy_home(emu_home, tmp_path / "cann")
    op = tree / os.path.relpath(dict(emulator.library_paths())["op"], emu_home)
    gone = tmp_path / "libpyaclmoe_gone.so.1"
    _planted(tmp_path, gone.name, tmp_path / "unused")
    entry = "int {}(void) {{ return 0; }}"
    body = "\n".join(entry.format(n) for n in ("aclnnMoeInitRoutingV2GradGetWorkspaceSize",
                                               "aclnnMoeInitRoutingV2Grad", "aclnnMoeInitRoutingV2GetWorkspaceSize",
                                               "aclnnMoeInitRoutingV2"))
    (tmp_path / "op.c").write_text(body + "\n")
    real_op = Path(os.path.realpath(op))
    real_op.unlink()
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(real_op), str(tmp_path / "op.c"), "-Wl,--no-as-needed",
                    str(gone)], check=True, capture_output=True)
    gone.unlink()
    r = isolated(child_failed_load_then_the_emulator, str(tree), env={**CLEAN, "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "cannot be loaded" in out["failed"][0] and "libpyaclmoe_gone.so.1" in out["failed"][0], out
    assert out["right"], out
    assert len(out["mapped"]) == 1 and str(tree) not in out["mapped"][0], out


def test_a_home_whose_path_is_not_utf8_is_refused_by_name(emu_home, tmp_path):
    # The home passes every check, then cffi's dlopen encodes the path as strict UTF-8: a
    # UnicodeEncodeError escaped load(), and `pyacl-moe info` died with a traceback.
    home = os.fsdecode(os.fsencode(str(tmp_path)) + b"/caf\xe9-home")
    _copy_home(emu_home, Path(home))
    code = ("import sys, pyacl_moe as pm\ntry:\n    pm.load(ascend_home=sys.argv[1])\n"
            "except pm.CannNotFoundError as e:\n    print('refused', *e.tried)\n")
    r = subprocess.run([sys.executable, "-c", code, home], env={**os.environ, **CLEAN}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("refused"), r.stderr[-500:]
    assert "not valid UTF-8" in r.stdout


@needs_cc
@pytest.mark.parametrize("entries", [":/nonexistent", "/nonexistent:.", "/nonexistent"], ids=["empty", "dot", "none"])
def test_a_dependency_a_relative_library_path_entry_would_give_the_loader_is_refused(tmp_path, monkeypatch, entries):
    """A library whose versioned DT_NEEDED (librt.so.1, say) is in neither the home nor an
    absolute LD_LIBRARY_PATH entry was left to the dynamic loader, which maps it from the
    current directory when an entry is relative or empty. The home is refused, naming the file;
    a name the process has mapped already (libc.so.6) is the loaded library, searched for by
    nobody, and passes."""
    from pyacl_moe._cann import loader
    build, home, here = tmp_path / "build", tmp_path / "home", tmp_path / "here"
    for d in (build, home / "lib64", here):
        d.mkdir(parents=True)
    _planted(build, "libplanted.so.1", tmp_path / "unused")
    src = build / "top.c"
    src.write_text("int top(void) { return 1; }\n")
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(home / "lib64" / "libtop.so"), str(src), "-Wl,--no-as-needed",
                    f"-L{build}", "-l:libplanted.so.1", "-lc"], check=True, capture_output=True)
    shutil.rmtree(build)  # found nowhere now, but for the one planted below
    marker = tmp_path / "ran"
    _planted(here, "libplanted.so.1", marker)
    _planted(here, "libc.so.6", marker)
    monkeypatch.chdir(here)
    monkeypatch.setenv("LD_LIBRARY_PATH", entries)
    got = loader._fits(str(home), "lib64/libtop.so", [], set())
    if entries == "/nonexistent":
        assert got == [str(home / "lib64" / "libtop.so")], got
    else:
        assert isinstance(got, str) and "refused" in got and str(here / "libplanted.so.1") in got, got
        assert "libc.so.6" not in got, got
    assert not marker.exists(), "a planted library's constructor ran"


@pytest.mark.parametrize("how", ["lib64", "link"])
def test_a_default_home_whose_library_others_can_replace_is_refused(isolated, emu_home, tmp_path, how):
    """A default home passed its trust rule when it and the folders above it did, though a
    folder inside it others can write to (``lib64``), or a library linked to such a place,
    chooses what is loaded. Each library loaded, and every folder above it as written and as
    its links resolve, must pass the rule too; named in ASCEND_HOME_PATH, the tree loads."""
    from pyacl_moe._paths import untrusted_above
    # The emulator's cache root: this user's, writable by no one else. Not inside its build, which
    # every load judges whole (a writable folder there sets the build aside for other tests).
    top = Path(emu_home).parents[3]
    if untrusted_above(top):
        pytest.skip(f"no trusted folder to lay a home out in ({untrusted_above(top)})")
    scratch = top / f"trust-{os.getpid()}-{how}"
    try:
        scratch.mkdir()
        tree = _copy_home(emu_home, scratch / "Ascend" / "cann")
        lib64 = Path(os.path.realpath(tree / "lib64"))
        if how == "lib64":
            os.chmod(lib64, 0o777)
            shown = "lib64 is writable by group or others"
        else:
            elsewhere = tmp_path / "libnnopbase.so"
            shutil.move(lib64 / "libnnopbase.so", elsewhere)
            os.symlink(elsewhere, lib64 / "libnnopbase.so")
            shown = str(tmp_path.parents[len(tmp_path.parents) - 2])  # the first folder others may write to
        r = isolated(child_info, env={**CLEAN, "HOME": str(scratch)})
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        refused = [t for t in out.get("not_found", []) if str(tree) in t]
        assert refused and "refused" in refused[0] and "writable" in refused[0], out
        assert shown in refused[0], (shown, refused)
        r = isolated(child_info, env={**CLEAN, "HOME": str(scratch), "ASCEND_HOME_PATH": str(tree)})
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == {"home": str(tree), "backend": "cann"}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
