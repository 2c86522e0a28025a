"""Build the host emulator into a directory laid out like a CANN install.

The C sources ship inside the package and are compiled on first use with the system C
compiler into ``<cache>/emulator-<hash>/lib64/{libascendcl,libnnopbase,libopapi}.so``, with a
toolkit release file beside them (``<arch>-linux/ascend_toolkit_install.info``). The hash
covers the sources, the declarations in headers/, the compiler command as given (``$CC`` with
its flags), the compiler's version and the flags, so an edit or another compiler gives a new
directory and a stale build is never loaded.

``PYACL_MOE_EMU_SANITIZE`` (e.g. ``address,undefined``) selects an instrumented build instead,
with its own cache directory (``emulator-san-<hash>``); docs/emulator.md says how to run
Python against it. Builds happen in a private temporary directory that is renamed into place,
so two processes building at once both succeed and neither sees a half-written library; each
compile has a deadline (``PYACL_MOE_EMU_BUILD_TIMEOUT``, default 300 s).

The cache is trusted only when nobody else can write to it: the root and every build directory
are created private (0700); a build directory not owned by this user, or writable by group or
others, is never loaded (a library planted there would run as the victim) but rebuilt
privately, with a warning; so is the whole cache when its root is writable by others without
the sticky bit. docs/emulator.md states the rules.

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
import tempfile
import time
import warnings
from pathlib import Path

from .. import _paths
from ._errors import EmulatorBuildError

SRC_DIR = Path(__file__).resolve().parent / "src"

# Which sources make which library, in link order: each library links against the ones
# before it, by soname, and finds them at run time through $ORIGIN, as CANN's libraries do.
LIBRARIES: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("ascendcl", ("rt_state.c", "rt_device.c", "rt_stream.c", "rt_memory.c"), ()),
    ("nnopbase", ("nnopbase.c",), ("ascendcl",)),
    ("opapi", ("opapi.c", "kernel.c", "opapi_fwd.c", "kernel_fwd.c"), ("nnopbase", "ascendcl")),
)

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

# Bump when the layout of the build directory changes. 2: the toolkit release file.
_LAYOUT_VERSION = "2"

BUILD_TIMEOUT_ENV = "PYACL_MOE_EMU_BUILD_TIMEOUT"
DEFAULT_BUILD_TIMEOUT = 300.0

# What a CANN toolkit keeps in <home>/<arch>-linux/ to say which release it is.
RELEASE_FILE = "ascend_toolkit_install.info"
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
    """The cache key of a build: sources, headers, compiler command and version, and flags."""
    cc = cc or find_compiler()
    h = hashlib.sha256()
    h.update(_LAYOUT_VERSION.encode())
    h.update(_compiler_identity(cc, min(30.0, build_timeout())).encode())
    h.update("\0".join(_cflags()).encode())
    h.update(repr(LIBRARIES).encode())  # which sources make which library, and the link order
    for f in _inputs():
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _release_dir(home: Path) -> Path:
    return home / f"{platform.machine() or 'unknown'}-{platform.system().lower() or 'unknown'}"


def _complete(home: Path) -> bool:
    return all((home / "lib64" / f"lib{name}.so").is_file() for name, _, _ in LIBRARIES) and (
        _release_dir(home) / RELEASE_FILE).is_file()


def emulator_release() -> str:
    """``pyacl-moe-emulator-<n>``, from EMU_VERSION in rt_internal.h (what aclemuVersion says)."""
    m = re.search(r'#define EMU_VERSION "pyacl-moe emulator (\S+)', (SRC_DIR / "rt_internal.h").read_text())
    return f"{PACKAGE_NAME}-{m.group(1) if m else 'unknown'}"


def _write_release_file(tmp: Path, home: Path, key: str) -> None:
    """The toolkit-style release file a CANN install keeps, saying what this build is."""
    rel = _release_dir(tmp)
    rel.mkdir(mode=0o700)
    sanitize = ",".join(f.split("=", 1)[1] for f in sanitize_flags()[:1]) or "none"
    lines = [
        f"package_name={PACKAGE_NAME}",
        f"version={emulator_release()}+{'san-' if sanitize != 'none' else ''}{key}",
        f"build_hash={key}",
        "emulated_abi=CANN 8.x",
        f"sanitizers={sanitize}",
        f"arch={platform.machine()}",
        f"os={platform.system().lower()}",
        f"path={_release_dir(home)}",
    ]
    (rel / RELEASE_FILE).write_text("\n".join(lines) + "\n")


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


def _compile_into(tmp: Path, cc: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    lib64 = tmp / "lib64"
    obj = tmp / "obj"
    lib64.mkdir(mode=0o700, parents=True)
    obj.mkdir(mode=0o700)
    includes = ["-I", str(_paths.headers_dir()), "-I", str(SRC_DIR)]
    cflags = _cflags()
    # Objects compile in parallel; links follow in dependency order.
    jobs: list[tuple[list[str], subprocess.Popen[str]]] = []
    try:
        for _, sources, _ in LIBRARIES:
            for src in sources:
                cmd = [*cc, *cflags, *includes, "-c", str(SRC_DIR / src), "-o", str(obj / (src + ".o"))]
                jobs.append((cmd, _start(cmd)))
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
    for name, sources, deps in LIBRARIES:
        cmd = [*cc, "-shared", "-pthread", *sanitize_flags()[:1], f"-Wl,-soname,lib{name}.so"]
        cmd += [str(obj / (s + ".o")) for s in sources]
        cmd += ["-L", str(lib64), *[f"-l{d}" for d in deps], "-Wl,-rpath,$ORIGIN"]
        cmd += ["-o", str(lib64 / f"lib{name}.so")]
        _run(cmd, deadline, timeout)
    shutil.rmtree(obj)


# ---------------------------------------------------------------------------- the cache's safety

def _untrusted_root(root: Path) -> str | None:
    """Why the cache root must not be used, or None. It may be shared (owned by root, like
    /tmp) only when the sticky bit keeps others from renaming or removing what is ours."""
    st = os.stat(root)  # a root reached through a symbolic link is judged by what it is
    if not stat.S_ISDIR(st.st_mode):
        return f"the cache root {root} is not a directory"
    if st.st_uid not in (os.geteuid(), 0):
        return f"the cache root {root} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (f"the cache root {root} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}) "
                "without the sticky bit")
    return None


def _untrusted_build(home: Path) -> str | None:
    """Why an existing build directory must not be loaded, or None: it, and every directory
    and library in it, must be this user's and writable by nobody else."""
    paths = [home, home / "lib64", *(home / "lib64" / f"lib{n}.so" for n, _, _ in LIBRARIES),
             _release_dir(home), _release_dir(home) / RELEASE_FILE]
    for path in paths:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue  # incomplete: rebuilt anyway
        if stat.S_ISLNK(st.st_mode):
            return f"{path} is a symbolic link"
        if st.st_uid != os.geteuid():
            return f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
        if st.st_mode & 0o022:
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
    for dirpath, _, files in os.walk(tmp):
        for p in (dirpath, *(os.path.join(dirpath, f) for f in files)):
            mode = stat.S_IMODE(os.lstat(p).st_mode)
            if mode & 0o022:
                os.chmod(p, mode & ~0o022)


def build(force: bool = False) -> str:
    """Compile the emulator if needed and return its home (the directory holding lib64/).

    Raises EmulatorConfigError when a PYACL_MOE_EMU_* variable is malformed, and
    EmulatorBuildError when no C compiler is available, compilation fails or times out.
    """
    from ._env import check_environment

    check_environment()
    cc = find_compiler()
    timeout = build_timeout()
    key = build_hash(cc)
    name = f"emulator-{'san-' if sanitize_flags() else ''}{key}"
    root = _prepare_root(cache_root())
    home = root / name
    if os.path.lexists(home):
        why = _untrusted_build(home)
        if why is None and _complete(home) and not force:
            return str(home)
        if why is not None:
            warnings.warn(f"emulator build {home} not loaded: {why}; building a private copy", stacklevel=2)
            if not _set_aside(root, home):
                root = _private_dir()
                home = root / name
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    keep = False
    try:
        _compile_into(tmp, cc, timeout)
        _write_release_file(tmp, home, key)
        _seal(tmp)
        if force and home.exists():
            # Move the old build aside first: a process may still have it mapped.
            old = Path(tempfile.mkdtemp(prefix=".old-", dir=root))
            os.replace(home, old / "home")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, home)
        except OSError:
            # Another process finished the same build first; theirs is identical, unless it
            # was planted meanwhile: then this private build is the one used.
            if not _complete(home):
                raise
            why = _untrusted_build(home)
            if why is not None:
                warnings.warn(f"emulator build {home} not loaded: {why}; using the private build {tmp}",
                              stacklevel=2)
                keep = True
                return str(tmp)
    finally:
        if not keep and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(home)
