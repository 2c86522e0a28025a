"""Build the host emulator into a directory laid out like a CANN install of each release.

The C sources ship inside the package and are compiled on first use with the system C
compiler, once, into objects that every release profile links (:mod:`._releases`): each
profile's tree, ``<cache>/emulator-<hash>/<release>/Ascend/...``, is laid out as that
release installs (libraries, their names and places, version and install-info files,
set_env.sh), and its libascendcl.so links its own ``release.c``. ``build()`` returns the home
of the profile ``PYACL_MOE_EMU_RELEASE`` selects. The hash covers the sources, the declarations
in headers/, the profiles, the compiler command as given (``$CC`` with its flags), the
compiler's version and the flags, so an edit or another compiler gives a new directory and a
stale build is never loaded.

``PYACL_MOE_EMU_SANITIZE`` (e.g. ``address,undefined``) selects an instrumented build instead,
with its own cache directory (``emulator-san-<hash>``); docs/emulator.md says how to run
Python against it. Builds happen in a private temporary directory that is renamed into place,
so two processes building at once both succeed and neither sees a half-written library; each
compile has a deadline (``PYACL_MOE_EMU_BUILD_TIMEOUT``, default 300 s).

The cache is trusted only when nobody else can write to it: the root and every build directory
are created private (0700); a build directory holding anything not owned by this user, or
writable by group or others, or a symbolic link that leads out of the build, is never loaded
(a library planted there would run as the victim) but rebuilt privately, with a warning; so is
the whole cache when its root is writable by others without the sticky bit. docs/emulator.md
states the rules.

This module is plain Python: it neither imports cffi nor loads anything.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from .. import _paths
from . import _releases
from ._errors import EmulatorBuildError

SRC_DIR = Path(__file__).resolve().parent / "src"

CFLAGS: tuple[str, ...] = (
    "-std=c11",
    "-O3",
    "-fPIC",
    "-fvisibility=hidden",
    "-pthread",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    "-Wno-unused-const-variable",
    "-Wno-format-truncation",
)

# Sanitizers an instrumented build may ask for (PYACL_MOE_EMU_SANITIZE, comma-separated).
SANITIZE_ENV = "PYACL_MOE_EMU_SANITIZE"
SANITIZERS = ("address", "undefined", "leak", "thread")

# Bump when the layout of the build directory changes. 2: the toolkit release file; 3: a tree
# per release profile.
_LAYOUT_VERSION = "3"

BUILD_TIMEOUT_ENV = "PYACL_MOE_EMU_BUILD_TIMEOUT"
DEFAULT_BUILD_TIMEOUT = 300.0

# What a build says of itself, at its top (beside the release trees).
BUILD_FILE = "pyacl_moe_emulator.info"
PACKAGE_NAME = "pyacl-moe-emulator"


def cache_root() -> Path:
    """``$PYACL_MOE_CACHE``, or ``~/.cache/pyacl-moe``."""
    env = os.environ.get("PYACL_MOE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pyacl-moe"


def find_compiler() -> list[str]:
    """The C compiler command: ``$CC`` if set, else the first of cc, gcc, clang on PATH."""
    env = os.environ.get("CC")
    if env:
        cmd = shlex.split(env)
        if cmd and shutil.which(cmd[0]):
            return cmd
        raise EmulatorBuildError(
            f"CC is set to {env!r} but that compiler is not on PATH. Unset CC or point it at an "
            "installed C compiler."
        )
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    raise EmulatorBuildError(
        "no C compiler found (looked for $CC, cc, gcc and clang on PATH). The bundled CANN "
        "emulator is compiled on first use: install a C compiler, for example "
        "'apt-get install gcc' (Debian/Ubuntu), 'dnf install gcc' (Fedora/RHEL, openEuler) or "
        "'apk add gcc musl-dev' (Alpine), or set CC. (CANN, and so this package, runs on Linux only.)"
    )


def sanitize_flags() -> tuple[str, ...]:
    """Compile and link flags for ``$PYACL_MOE_EMU_SANITIZE`` (empty when it is unset)."""
    value = os.environ.get(SANITIZE_ENV, "").strip()
    if not value:
        return ()
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in SANITIZERS]
    if unknown or not names:
        raise EmulatorBuildError(
            f"{SANITIZE_ENV}={value!r}: unknown sanitizer {unknown or value!r}; use a comma-separated "
            f"list of {', '.join(SANITIZERS)}"
        )
    # Line numbers in reports, and frames a stack walk can follow.
    return (f"-fsanitize={','.join(names)}", "-fno-omit-frame-pointer", "-g")


def _cflags() -> tuple[str, ...]:
    return CFLAGS + sanitize_flags()


def _compiler_identity(cc: list[str], timeout: float = 30.0) -> str:
    """The command as given and everything ``--version`` prints: ``gcc -O0`` and ``gcc`` are
    different compilers for the cache, and so are two builds of gcc with one first line."""
    command = shlex.join(cc)
    try:
        out = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
        return command + "\n" + out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return command


def build_timeout() -> float:
    """Seconds the compiles of one build may take: ``$PYACL_MOE_EMU_BUILD_TIMEOUT``, default 300."""
    value = os.environ.get(BUILD_TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_BUILD_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise EmulatorBuildError(f"{BUILD_TIMEOUT_ENV}={value!r} is malformed: use a positive number of "
                                 "seconds, e.g. 300 or 0.5")
    return seconds


def _inputs() -> list[Path]:
    headers = _paths.headers_dir()
    files = sorted(SRC_DIR.glob("*.[ch]"))
    files += [headers / name for name in _paths.HEADER_FILES]
    return files


def build_hash(cc: list[str] | None = None) -> str:
    """The cache key of a build: sources, headers, profiles, compiler command and version, and
    flags."""
    cc = cc or find_compiler()
    h = hashlib.sha256()
    h.update(_LAYOUT_VERSION.encode())
    h.update(_compiler_identity(cc, min(30.0, build_timeout())).encode())
    h.update("\0".join(_cflags()).encode())
    h.update(repr(sorted(_releases.PROFILES.items())).encode())
    h.update(repr([_releases.libraries(p) for p in _releases.PROFILES.values()]).encode())
    for f in _inputs():
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(Path(_releases.__file__).read_bytes())  # the layouts it writes
    return h.hexdigest()[:16]


def _complete(tree: Path) -> bool:
    return (tree / BUILD_FILE).is_file() and all(
        (tree / p.release / lib.path).is_file() for p in _releases.PROFILES.values() for lib in _releases.libraries(p))


def emulator_release() -> str:
    """``pyacl-moe-emulator-<n>``, from EMU_VERSION in rt_internal.h (what aclemuVersion says)."""
    m = re.search(r'#define EMU_VERSION "pyacl-moe emulator (\S+)', (SRC_DIR / "rt_internal.h").read_text())
    return f"{PACKAGE_NAME}-{m.group(1) if m else 'unknown'}"


def _write_build_file(tmp: Path, key: str) -> None:
    """What the build is: the emulator's release and hash, its sanitizers, its profiles."""
    sanitize = ",".join(f.split("=", 1)[1] for f in sanitize_flags()[:1]) or "none"
    lines = [
        f"package_name={PACKAGE_NAME}",
        f"version={emulator_release()}+{'san-' if sanitize != 'none' else ''}{key}",
        f"build_hash={key}",
        f"releases={','.join(_releases.PROFILES)}",
        f"default_release={_releases.DEFAULT}",
        f"sanitizers={sanitize}",
        f"arch={platform.machine()}",
        f"os={platform.system().lower()}",
    ]
    (tmp / BUILD_FILE).write_text("\n".join(lines) + "\n")


def _kill(procs: list[subprocess.Popen[str]]) -> None:
    """Stop and reap whatever is still running, and close every pipe."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        try:  # the whole session: a compiler driver's children hold its pipes open
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
    for proc in running:
        proc.communicate()
    for proc in procs:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()


def _timed_out(cmd: list[str], timeout: float) -> EmulatorBuildError:
    return EmulatorBuildError(
        f"compiling the CANN emulator timed out after {timeout:g} s (raise {BUILD_TIMEOUT_ENV} if the "
        "compiler is just slow):\n  $ " + shlex.join(cmd)
    )


def _start(cmd: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True, start_new_session=True)


def _run(cmd: list[str], deadline: float, timeout: float) -> None:
    proc = _start(cmd)
    try:
        out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill([proc])
        raise _timed_out(cmd, timeout) from None
    if proc.returncode != 0:
        raise EmulatorBuildError(
            "compiling the CANN emulator failed:\n  $ " + shlex.join(cmd) + "\n" + (err or out)
        )


def _release_flags(p: _releases.Profile) -> list[str]:
    major, minor, patch = p.acl_version
    return [f"-DEMU_RELEASE_CODE={p.code}", f'-DEMU_RELEASE_NAME="{p.release}"', f"-DEMU_ACL_MAJOR={major}",
            f"-DEMU_ACL_MINOR={minor}", f"-DEMU_ACL_PATCH={patch}"]


def _compile_into(tmp: Path, final: Path, cc: list[str], timeout: float) -> None:
    """Every profile's tree in ``tmp`` (to be renamed to ``final``): the shared sources
    compiled once, release.c once per profile, then each profile's libraries linked in
    dependency order and its files laid out."""
    deadline = time.monotonic() + timeout
    obj = tmp / "obj"
    obj.mkdir(mode=0o700, parents=True)
    includes = ["-I", str(_paths.headers_dir()), "-I", str(SRC_DIR)]
    cflags = _cflags()
    shared = sorted({s for p in _releases.PROFILES.values() for lib in _releases.libraries(p) for s in lib.sources
                     if s != _releases.RELEASE_SOURCE})
    compiles = [[*cc, *cflags, *includes, "-c", str(SRC_DIR / src), "-o", str(obj / (src + ".o"))] for src in shared]
    compiles += [[*cc, *cflags, *includes, *_release_flags(p), "-c", str(SRC_DIR / _releases.RELEASE_SOURCE),
                  "-o", str(obj / f"release-{p.release}.o")] for p in _releases.PROFILES.values()]
    # Objects compile in parallel; links follow in dependency order.
    jobs: list[tuple[list[str], subprocess.Popen[str]]] = []
    try:
        jobs = [(cmd, _start(cmd)) for cmd in compiles]
        failures = []
        for cmd, proc in jobs:
            try:
                out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise _timed_out(cmd, timeout) from None
            if proc.returncode != 0:
                failures.append("  $ " + shlex.join(cmd) + "\n" + (err or out))
    finally:
        _kill([proc for _, proc in jobs])
    if failures:
        raise EmulatorBuildError("compiling the CANN emulator failed:\n" + "\n".join(failures))
    for p in _releases.PROFILES.values():
        tree = tmp / p.release
        made: dict[str, Path] = {}
        for lib in _releases.libraries(p):
            out_path = tree / lib.path
            _releases.make_folders(out_path.parent)
            objects = [str(obj / (f"release-{p.release}.o" if s == _releases.RELEASE_SOURCE else s + ".o"))
                       for s in lib.sources]
            # No RUNPATH, as CANN's release builds have none: whoever loads a library finds
            # its dependencies (the binding loads them by path first).
            dirs = sorted({str(made[n].parent) for n in lib.needs})
            cmd = [*cc, "-shared", "-pthread", *sanitize_flags()[:1], f"-Wl,-soname,lib{lib.name}.so", *objects]
            cmd += [f for d in dirs for f in ("-L", d, f"-Wl,-rpath-link,{d}")]
            cmd += [f"-l{n}" for n in lib.needs] + ["-o", str(out_path)]
            _run(cmd, deadline, timeout)
            made[lib.name] = out_path
            for link in lib.links:
                _releases.link(tree, link, lib.path)
        _releases.lay_out(p, tree, final / p.release)
    shutil.rmtree(obj)


# ---------------------------------------------------------------------------- the cache's safety

def _untrusted_root(root: Path) -> str | None:
    """Why the cache root must not be used, or None. It may be shared (owned by root, like
    /tmp) only when the sticky bit keeps others from renaming or removing what is ours."""
    if not os.path.isdir(root):  # a root reached through a symbolic link is judged by what it is
        return f"the cache root {root} is not a directory"
    why = _paths.untrusted(root, sticky_ok=True)
    return f"the cache root: {why} (without the sticky bit)" if why else None


def _untrusted_build(tree: Path) -> str | None:
    """Why an existing build directory must not be loaded, or None: everything in it must be
    this user's and writable by nobody else, and a symbolic link may only lead to a place
    inside the build (the release trees link their own folders)."""
    try:
        st = os.lstat(tree)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"{tree} is a symbolic link"
    inside = os.path.realpath(tree) + os.sep
    for dirpath, dirs, files in os.walk(tree):
        for path in (dirpath, *(os.path.join(dirpath, n) for n in dirs + files)):
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue  # removed meanwhile: the build is judged incomplete anyway
            if st.st_uid != os.geteuid():
                return f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
            if stat.S_ISLNK(st.st_mode):
                if not os.path.realpath(path).startswith(inside):
                    return f"{path} is a symbolic link that leads out of the build"
            elif st.st_mode & 0o022:
                return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _private_dir() -> Path:
    """A fresh directory only this user can enter, for a build that cannot go in the cache."""
    return Path(tempfile.mkdtemp(prefix="pyacl-moe-emulator-"))


def _prepare_root(root: Path) -> Path:
    """The cache root to build in: ``root``, created private if missing, or a private
    directory of its own (with a warning) when ``root`` is not safe."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        why = _untrusted_root(root)
    except OSError as exc:
        why = f"the cache root {root} cannot be used ({exc})"
    if why is None:
        return root
    private = _private_dir()
    warnings.warn(f"{why}: the emulator is built in {private} instead; point PYACL_MOE_CACHE at a "
                  "directory only you can write to", stacklevel=3)
    return private


def _set_aside(root: Path, home: Path) -> bool:
    """Move an untrusted build out of the way (and remove it); False if it cannot be moved."""
    try:
        aside = Path(tempfile.mkdtemp(prefix=".untrusted-", dir=root))
        os.rename(home, aside / "build")
    except OSError:
        return False
    shutil.rmtree(aside, ignore_errors=True)
    return True


def _seal(tmp: Path) -> None:
    """Nobody but this user may write anything in a build, whatever the umask let the linker
    create."""
    for dirpath, dirs, files in os.walk(tmp):
        for p in (dirpath, *(os.path.join(dirpath, f) for f in dirs + files)):
            st = os.lstat(p)
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022:
                os.chmod(p, stat.S_IMODE(st.st_mode) & ~0o022)


# Whether a build says on stderr, in one line, what it compiles and where (the first one takes
# seconds): the CLI turns it off under --json. One store, read without a lock.
announce = [True]


def build(force: bool = False) -> str:
    """Compile the emulator if needed and return the home of the selected release profile
    (``PYACL_MOE_EMU_RELEASE``, default ``_releases.DEFAULT``): the folder its set_env.sh exports
    as ASCEND_HOME_PATH.

    Raises EmulatorConfigError when a PYACL_MOE_EMU_* variable is malformed, and
    EmulatorBuildError when no C compiler is available, compilation fails or times out.
    """
    from ._env import check_environment

    check_environment()
    profile = _releases.selected()
    return str(Path(build_tree(force)) / profile.release / _releases.home(profile))


def build_tree(force: bool = False) -> str:
    """Compile the emulator if needed and return the build's folder (one tree per release)."""
    from ._env import check_environment

    check_environment()
    cc = find_compiler()
    timeout = build_timeout()
    key = build_hash(cc)
    name = f"emulator-{'san-' if sanitize_flags() else ''}{key}"
    root = _prepare_root(cache_root())
    tree = root / name
    if os.path.lexists(tree):
        why = _untrusted_build(tree)
        if why is None and _complete(tree) and not force:
            return str(tree)
        if why is not None:
            warnings.warn(f"emulator build {tree} not loaded: {why}; building a private copy", stacklevel=3)
            if not _set_aside(root, tree):
                root = _private_dir()
                tree = root / name
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    if announce[0]:
        kind = "the sanitized host emulator" if sanitize_flags() else "the host emulator"
        print(f"pyacl-moe: building {kind} with {' '.join(cc)} into {tree} (once per version of its sources; "
              "a few seconds)", file=sys.stderr, flush=True)
    keep = False
    try:
        _compile_into(tmp, tree, cc, timeout)
        _write_build_file(tmp, key)
        _seal(tmp)
        if force and tree.exists():
            # Move the old build aside first: a process may still have it mapped.
            old = Path(tempfile.mkdtemp(prefix=".old-", dir=root))
            os.replace(tree, old / "tree")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, tree)
        except OSError:
            # Another process finished the same build first; theirs is identical, unless it
            # was planted meanwhile: then this private build is the one used.
            if not _complete(tree):
                raise
            why = _untrusted_build(tree)
            if why is not None:
                warnings.warn(f"emulator build {tree} not loaded: {why}; using the private build {tmp}",
                              stacklevel=3)
                keep = True
                return str(tmp)
    finally:
        if not keep and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(tree)
