"""Where a CANN install keeps what this binding needs, release by release.

Plain Python: it reads directories and files (the ELF headers of shared libraries included)
and loads nothing, so a home can be judged before any of its libraries enters the process.

**Homes** are searched in this order (:func:`candidate_homes`): ``load(ascend_home=...)``
alone when given; else ``$ASCEND_HOME_PATH``, ``$ASCEND_TOOLKIT_HOME`` (what each release's
set_env.sh exports), ``/usr/local/Ascend/cann`` (the default root from 8.5),
``/usr/local/Ascend/ascend-toolkit/latest`` (up to 8.3), the same two under ``$HOME/Ascend``
(a non-root install); the loader then tries the dynamic loader's own path. A home the user
names (the first three) is the user's choice and must be an absolute path; a default one is
used only when it and every folder above it are owned by root or this user and writable by
no one else (:func:`pyacl_moe._paths.untrusted_above`), as CANN's installer leaves them.

**The op library** in a home is the first of :data:`OP_LIBRARIES` that exports the four
entry points of both ops (the two phases of each), in the order the releases use them: the
per-repository ``libopapi_transformer.so`` of 8.5 and later (in ``lib64``, or in the op_api
folder its package stages it in), the all-in-one ``libopapi.so`` (up to 8.3; deprecated in
9.1 and not to be mixed with the per-repository libraries), then the 8.2/8.3 split libraries.
All four come from that one library.

**Dependencies** are a library's DT_NEEDED entries, read from its dynamic section. CANN's
release builds carry no RUNPATH (ops-transformer ``cmake/config.cmake`` sets
``CMAKE_SKIP_RPATH``), so ``libopapi_transformer.so`` finds ``libopapi_math.so`` only where the
dynamic loader looks; :func:`dependency_order` finds each one in the home's library folders
(``lib64``, the library's own folder) and the driver's (what set_env.sh adds, used when
trusted), so the loader can load them by path first and no environment is needed. It never
searches ``$LD_LIBRARY_PATH`` to load from it: a dependency found only in one of its absolute
entries is left to the dynamic loader (which reads the variable itself), and one that a relative
or empty entry holds (the current directory, to the dynamic loader) makes the library unfit,
whatever its name: the dynamic loader would map that file. A dependency with an unversioned name
(``libX.so``, the form every CANN library has) found nowhere makes the library unfit;
versioned names (``libc.so.6``) are the system's, left to the dynamic loader.

**Before a library is mapped** (:func:`elf_problem`) its ELF headers are read: a file that is
not a shared object of this machine, or shorter than its headers and segments say (an
interrupted copy, which the dynamic loader would map and die on with SIGBUS), is refused.
"""

from __future__ import annotations

import itertools
import os
import platform
import re
import struct
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from .._paths import untrusted_above

__all__ = ["DRIVER_FOLDERS", "OP_LIBRARIES", "RUNTIME_LIBRARIES", "arch", "candidate_homes",
           "defined_symbols", "dependency_order", "elf_problem", "library_folders", "loader_path", "needed"]

RUNTIME_LIBRARIES = ("lib64/libascendcl.so", "lib64/libnnopbase.so")

OP_API_FOLDER = "opp/built-in/op_impl/ai_core/tbe/op_api/lib/linux/{arch}"

# Paths in a home, in the order they are tried.
OP_LIBRARIES: tuple[str, ...] = (
    "lib64/libopapi_transformer.so",  # ops-transformer's library (8.5 and later)
    f"{OP_API_FOLDER}/libopapi_transformer.so",  # ops-transformer's library, in its package's op_api folder
    "lib64/libopapi.so",  # the all-in-one op library (up to 8.3; deprecated in 9.1)
    "lib64/libaclnn_ops_train.so",  # the split op library of 8.2 and 8.3 (training ops)
    # the split op library of 8.2 and 8.3 (inference ops: 8.1.RC1's umbrella header
    # aclnn_ops_infer.h holds the MoE ops)
    "lib64/libaclnn_ops_infer.so",
)

# What set_env.sh (8.5) adds to LD_LIBRARY_PATH for the driver.
DRIVER_FOLDERS = ("/usr/local/Ascend/driver/lib64", "/usr/local/Ascend/driver/lib64/common",
                  "/usr/local/Ascend/driver/lib64/driver")


def arch() -> str:
    """The machine as CANN names its folders: ``aarch64`` or ``x86_64``."""
    m = platform.machine()
    return {"arm64": "aarch64", "amd64": "x86_64", "AMD64": "x86_64"}.get(m, m) or "unknown"


def candidate_homes(ascend_home: str | os.PathLike[str] | None = None) -> list[tuple[str, str | None, bool]]:
    """(label, directory or None when unset, whether the user named it) in search order; a
    directory already listed is not listed again."""
    if ascend_home is not None:
        return [(f"ascend_home={os.fspath(ascend_home)!r}", os.fspath(ascend_home), True)]
    user = Path.home() / "Ascend"
    listed = [
        ("$ASCEND_HOME_PATH", os.environ.get("ASCEND_HOME_PATH") or None, True),
        ("$ASCEND_TOOLKIT_HOME", os.environ.get("ASCEND_TOOLKIT_HOME") or None, True),
        ("default root (8.5 and later)", "/usr/local/Ascend/cann", False),
        ("default root (up to 8.3)", "/usr/local/Ascend/ascend-toolkit/latest", False),
        ("non-root default (8.5 and later)", str(user / "cann"), False),
        ("non-root default (up to 8.3)", str(user / "ascend-toolkit" / "latest"), False),
    ]
    kept: dict[str, tuple[str, str | None, bool]] = {}  # (an unset one keyed by its label: never a path)
    for label, home, named in listed:
        kept.setdefault(os.path.realpath(home) if home else label, (label, home, named))
    return list(kept.values())


def home_problem(home: str, named: bool) -> str | None:
    """Why a home must not be used, or None: a named one must be an absolute path (the user's
    choice, trusted); one found by default, and every folder above it, owned by root or this
    user and writable by no one else."""
    if named:
        return None if os.path.isabs(home) else "not an absolute path (a home the user names must be one)"
    why = untrusted_above(home)
    return f"{why}: a home found by default is used only when it and every folder above it are owned by " \
           "root or this user and writable by no one else (name it in ASCEND_HOME_PATH to use it anyway)" if why \
        else None


def library_folders(home: str, library: str) -> list[str]:
    """Where a library's dependencies are looked for, to load them by path: its own folder,
    the home's lib64 and op_api folder, then the driver's (those that are trusted)."""
    folders = [os.path.dirname(os.path.realpath(library)), os.path.dirname(library), os.path.join(home, "lib64"),
               os.path.join(home, OP_API_FOLDER.format(arch=arch()))]
    folders += [d for d in DRIVER_FOLDERS if os.path.isdir(d) and untrusted_above(d) is None]
    return list(dict.fromkeys(folders))


def loader_path() -> tuple[list[str], list[str]]:
    """``$LD_LIBRARY_PATH``'s entries as the dynamic loader reads them: (the absolute ones, the
    relative or empty ones, which stand for the current directory or one below it)."""
    entries = os.environ.get("LD_LIBRARY_PATH", "").split(":") if os.environ.get("LD_LIBRARY_PATH") else []
    return [e for e in entries if os.path.isabs(e)], [e for e in entries if not os.path.isabs(e)]


# ---------------------------------------------------------------------------- ELF

# The ELF structures of this process's class and byte order (a library of another cannot be
# loaded here, so it is only ever refused), each unpacked to the fields read here, in the same
# order for both classes (the rest skipped as padding): header (e_type, e_machine, e_phoff,
# e_shoff, e_phentsize, e_phnum, e_shentsize, e_shnum), program header up to p_filesz (p_type,
# p_offset, p_filesz), section header (sh_type, sh_offset, sh_size, sh_link), dynamic symbol
# (st_name, st_info, st_shndx), dynamic entry (d_tag, d_val).
_END = "<" if sys.byteorder == "little" else ">"
_WIDE = struct.calcsize("P") == 8
_EHDR = struct.Struct(_END + ("16xHH12xQQ6xHHHH2x" if _WIDE else "16xHH8xII6xHHHH2x"))
_PHDR = struct.Struct(_END + ("I4xQ16xQ" if _WIDE else "II8xI4x"))
_SHDR = struct.Struct(_END + ("4xI16xQQI20x" if _WIDE else "4xI8xIII12x"))
_SYM = struct.Struct(_END + ("IBxH16x" if _WIDE else "I8xBxH"))
_DYN = struct.Struct(_END + ("qQ" if _WIDE else "iI"))
_MACHINES = {"x86_64": 62, "aarch64": 183}  # ELF e_machine: EM_X86_64, EM_AARCH64
_ET_DYN, _PT_LOAD, _SHT_DYNSYM, _SHT_DYNAMIC, _DT_NEEDED, _DT_SONAME = 3, 1, 11, 6, 1, 14
_MAX_TABLE = 64 << 20  # a symbol or string table larger than this is not read (not a sane library)


def _sections(fd: int) -> tuple[list[tuple[int, int, int, int]], str | None]:
    """(the section headers (type, offset, size, link) of the shared library open at ``fd``
    (nothing is mapped), None), or ([], why it must not be mapped)."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, _EHDR.size, 0)
    if head[:4] != b"\x7fELF":
        return [], "not an ELF file"
    if len(head) >= 6 and (head[4] != (2 if _WIDE else 1) or head[5] != (1 if _END == "<" else 2)):
        return [], "an ELF file of another class or byte order than this process"
    if len(head) < _EHDR.size:
        return [], f"cut short ({size} bytes: not even its ELF header)"
    e_type, machine, phoff, shoff, phentsize, phnum, shentsize, shnum = _EHDR.unpack(head)
    if e_type != _ET_DYN:
        return [], f"not a shared object (ELF type {e_type})"
    want = _MACHINES.get(arch())
    if want is not None and machine != want:
        return [], f"built for another machine (ELF machine {machine}; this one is {arch()}, {want})"
    if phnum == 0 or phentsize < _PHDR.size or phoff + phnum * phentsize > size:
        return [], f"cut short or damaged ({size} bytes: its program headers are not all there)"
    table = os.pread(fd, phnum * phentsize, phoff)
    for i in range(phnum):
        p_type, offset, filesz = _PHDR.unpack_from(table, i * phentsize)
        if p_type == _PT_LOAD and offset + filesz > size:
            return [], f"cut short ({size} bytes; its segments need {offset + filesz})"
    if shoff and (shentsize < _SHDR.size or shoff + shnum * shentsize > size or shnum > 1 << 20):
        return [], f"cut short ({size} bytes; its section table ends at {shoff + shnum * shentsize})"
    raw = os.pread(fd, shnum * shentsize, shoff) if shoff else b""
    return [_SHDR.unpack_from(raw, i * shentsize) for i in range(shnum)], None


def _tables(path: str, kind: int) -> tuple[list[tuple[bytes, bytes]], str | None]:
    """((entries, string table) of each section of ``kind`` of the library at ``path`` (a
    section's link is its strings), None), or ([], why it cannot be read as one)."""
    try:
        with open(path, "rb") as f:
            s, why = _sections(fd := f.fileno())  # (no sections when it must not be mapped)
            return [(os.pread(fd, size, offset), os.pread(fd, s[link][2], s[link][1])) for t, offset, size, link in s
                    if t == kind and link < len(s) and max(size, s[link][2]) <= _MAX_TABLE], why
    except (OSError, struct.error) as exc:
        return [], f"cannot be read ({getattr(exc, 'strerror', None) or exc})"


def elf_problem(path: str) -> str | None:
    """Why the file at ``path`` must not be mapped as a shared library of this process, or
    None: it must be an ELF shared object of this machine's class, byte order and machine, and
    hold every byte its program headers, segments and section table say it has (a file cut
    short is mapped by the dynamic loader all the same, and touching the missing pages kills
    the process with SIGBUS)."""
    return _tables(path, -1)[1]  # (no section is of kind -1: nothing read but the headers)


def _string(strtab: bytes, at: int) -> bytes:
    end = strtab.find(b"\0", at)
    return strtab[at:end if end >= 0 else len(strtab)]


def needed(path: str, kind: int = _DT_NEEDED) -> tuple[str, ...] | None:
    """The DT_NEEDED entries of a shared library, in order (``kind``: the entries of another
    name tag, DT_SONAME); None when it cannot be read."""
    tables, why = _tables(path, _SHT_DYNAMIC)
    dyn, strtab = tables[0] if tables else (b"", b"")  # (the first dynamic section; its entries end at DT_NULL)
    entries = itertools.takewhile(lambda e: e[0] != 0, _DYN.iter_unpack(dyn[:len(dyn) // _DYN.size * _DYN.size]))
    names = [_string(strtab, v).decode("utf-8", "replace") for tag, v in entries
             if tag == kind and v < len(strtab)]
    return None if why else tuple(names)


def mapped_names() -> set[str]:
    """The file names and sonames of the libraries this process has mapped (/proc/self/maps):
    the dynamic loader gives a DT_NEEDED name that one of them answers to that library, and
    searches for nothing."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and ".so" in line}
    except OSError:
        return set()
    return {n for p in paths if p.startswith("/") for n in (os.path.basename(p), *(needed(p, _DT_SONAME) or ()))}


def defined_symbols(path: str, wanted: Iterable[str]) -> set[str] | None:
    """Which of ``wanted`` the library's dynamic symbol table defines (global or weak, not
    undefined); None when it cannot be read."""
    targets = {w.encode() for w in wanted}
    tables, why = _tables(path, _SHT_DYNSYM)
    found = {s.decode() for syms, strtab in tables
             for name, info, shndx in _SYM.iter_unpack(syms[:len(syms) // _SYM.size * _SYM.size])
             if shndx and (info >> 4) in (1, 2) and name < len(strtab) and (s := _string(strtab, name)) in targets}
    return None if why else found


_UNVERSIONED = re.compile(r"lib[^/]*\.so")


class Dependencies(NamedTuple):
    """A library's dependency closure: ``order`` the paths to load first (dependencies before
    what needs them), ``missing`` (name, needed by) for CANN-style names found nowhere, ``left``
    those found only through ``$LD_LIBRARY_PATH``'s absolute entries (the dynamic loader's to
    load), ``planted`` those a relative or empty entry of it holds (the dynamic loader would map
    a file of the current directory, or one below it: refused)."""

    order: list[str]
    missing: list[tuple[str, str]]
    left: list[str]
    planted: list[str]


def find(name: str, folders: list[str]) -> str | None:
    """The first of ``folders`` that holds a file ``name``."""
    return next((os.path.join(d, name) for d in folders if os.path.isfile(os.path.join(d, name))), None)


def dependency_order(path: str, folders: list[str], loaded: set[str]) -> Dependencies:
    """Every dependency of ``path`` found in ``folders``, transitively, in load order.
    ``loaded`` are the names of the libraries already loaded by us (they are not looked for
    again). A library whose ELF cannot be read is left for dlopen to judge; the dependencies of
    one left to the dynamic loader are walked too, for what a relative entry would give them."""
    deps = Dependencies([], [], [], [])
    seen = set(loaded)
    absolute, relative = loader_path()
    mapped = mapped_names() if relative else set()  # (what the process has mapped is not looked for)

    def visit(lib: str, ours: bool) -> None:
        for name in needed(lib) or ():
            if name in seen:
                continue
            seen.add(name)
            left = find(name, absolute)
            if (where := find(name, folders)) is not None:
                visit(where, ours)
                deps.order.append(where)
            elif (here := find(name, relative)) and name not in mapped and not (left and os.path.samefile(here, left)):
                deps.planted.append(os.path.abspath(here))
            elif left is not None:
                visit(left, False)
                deps.left.append(left)
            elif ours and _UNVERSIONED.fullmatch(name):
                deps.missing.append((name, os.path.basename(lib)))

    visit(path, True)
    return deps
