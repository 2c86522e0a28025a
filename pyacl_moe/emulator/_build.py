"""Build the host emulator into a directory laid out like a CANN install.

The C sources ship inside the package and are compiled on first use with the system C
compiler into ``<cache>/emulator-<hash>/lib64/{libascendcl,libnnopbase,libopapi}.so``. The hash
covers the sources, the declarations in headers/, the compiler and its flags, so an edit or a
new compiler gives a new directory and a stale build is never loaded.

``PYACL_MOE_EMU_SANITIZE`` (e.g. ``address,undefined``) selects an instrumented build instead,
with its own cache directory (``emulator-san-<hash>``); docs/emulator.md says how to run
Python against it. Builds happen in a
private temporary directory that is renamed into place, so two processes building at once
both succeed and neither sees a half-written library.

This module is plain Python: it neither imports cffi nor loads anything.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from .. import _paths

SRC_DIR = Path(__file__).resolve().parent / "src"

# Which sources make which library, in link order: each library links against the ones
# before it, by soname, and finds them at run time through $ORIGIN, as CANN's libraries do.
LIBRARIES: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("ascendcl", ("rt_state.c", "rt_device.c", "rt_stream.c", "rt_memory.c"), ()),
    ("nnopbase", ("nnopbase.c",), ("ascendcl",)),
    ("opapi", ("opapi.c", "kernel.c"), ("nnopbase", "ascendcl")),
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

# Bump when the layout of the build directory changes.
_LAYOUT_VERSION = "1"


class EmulatorBuildError(RuntimeError):
    """The emulator could not be compiled: no compiler, or the compiler failed."""


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
        "'apt-get install gcc' (Debian/Ubuntu), 'dnf install gcc' (Fedora/RHEL) or "
        "'xcode-select --install' (macOS), or set CC."
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


def _compiler_identity(cc: list[str]) -> str:
    try:
        out = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else " ".join(cc)
    except (OSError, subprocess.SubprocessError):
        return " ".join(cc)


def _inputs() -> list[Path]:
    headers = _paths.headers_dir()
    files = sorted(SRC_DIR.glob("*.[ch]"))
    files += [headers / name for name in _paths.HEADER_FILES]
    return files


def build_hash(cc: list[str] | None = None) -> str:
    """The cache key of a build: sources, headers, compiler identity and flags."""
    cc = cc or find_compiler()
    h = hashlib.sha256()
    h.update(_LAYOUT_VERSION.encode())
    h.update(_compiler_identity(cc).encode())
    h.update("\0".join(_cflags()).encode())
    h.update(repr(LIBRARIES).encode())  # which sources make which library, and the link order
    for f in _inputs():
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _complete(home: Path) -> bool:
    return all((home / "lib64" / f"lib{name}.so").is_file() for name, _, _ in LIBRARIES)


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise EmulatorBuildError(
            "compiling the CANN emulator failed:\n  $ "
            + " ".join(shlex.quote(c) for c in cmd)
            + "\n"
            + (proc.stderr or proc.stdout)
        )


def _compile_into(tmp: Path, cc: list[str]) -> None:
    lib64 = tmp / "lib64"
    obj = tmp / "obj"
    lib64.mkdir(parents=True)
    obj.mkdir()
    includes = ["-I", str(_paths.headers_dir()), "-I", str(SRC_DIR)]
    cflags = _cflags()
    # Objects compile in parallel; links follow in dependency order.
    jobs = []
    for _, sources, _ in LIBRARIES:
        for src in sources:
            cmd = [*cc, *cflags, *includes, "-c", str(SRC_DIR / src), "-o", str(obj / (src + ".o"))]
            jobs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    failures = []
    for cmd, proc in jobs:
        out, err = proc.communicate()
        if proc.returncode != 0:
            failures.append("  $ " + " ".join(shlex.quote(c) for c in cmd) + "\n" + (err or out))
    if failures:
        raise EmulatorBuildError("compiling the CANN emulator failed:\n" + "\n".join(failures))
    for name, sources, deps in LIBRARIES:
        cmd = [*cc, "-shared", "-pthread", *sanitize_flags()[:1], f"-Wl,-soname,lib{name}.so"]
        cmd += [str(obj / (s + ".o")) for s in sources]
        cmd += ["-L", str(lib64), *[f"-l{d}" for d in deps], "-Wl,-rpath,$ORIGIN"]
        cmd += ["-o", str(lib64 / f"lib{name}.so")]
        _run(cmd)
    shutil.rmtree(obj)


def build(force: bool = False) -> str:
    """Compile the emulator if needed and return its home (the directory holding lib64/).

    Raises EmulatorBuildError when no C compiler is available or compilation fails.
    """
    cc = find_compiler()
    root = cache_root()
    home = root / f"emulator-{'san-' if sanitize_flags() else ''}{build_hash(cc)}"
    if _complete(home) and not force:
        return str(home)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        _compile_into(tmp, cc)
        if force and home.exists():
            # Move the old build aside first: a process may still have it mapped.
            old = Path(tempfile.mkdtemp(prefix=".old-", dir=root))
            os.replace(home, old / "home")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, home)
        except OSError:
            # Another process finished the same build first; theirs is identical.
            if not _complete(home):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(home)
