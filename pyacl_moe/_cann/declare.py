"""The C declarations: one FFI object, fed from headers/ and from what a provider adds.

headers/ holds one plain-C file per CANN header mirrored (the emulator compiles against the
very same files; :mod:`pyacl_moe._paths` finds them). Constants and enum values are read back
from cffi, never copied by hand: :func:`const` answers ``const("ACL_FORMAT_ND") == 2`` from the
parsed headers.

Declaring is lazy (importing the package reads no file) and happens once, under a lock; a
provider's declarations follow the headers' when the provider adds them (the emulator's
package, when it is imported). Every C type the bindings build
values of is parsed at that moment too: cffi parses a type given as a string under an internal
lock, and a finalizer run by the garbage collector in the middle of such a parse would take that
lock again and hang the thread.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

import cffi

from .._paths import HEADER_FILES, headers_dir

__all__ = ["HEADER_FILES", "NULL", "add_declarations", "const", "ctype", "declare", "extra_functions", "ffi",
           "functions_in", "headers_dir", "process"]

ffi = cffi.FFI()
NULL = ffi.NULL

# Every C type the bindings build values of (see the module docstring for why up front). aclrtStream,
# aclrtEvent and aclrtContext are void * (acl_base.h): their slots are void ** (the very same cffi type).
_TYPE_NAMES = (
    "void *", "void **", "uintptr_t", "int32_t *", "int32_t[]", "uint32_t *", "size_t *", "float *", "int64_t *",
    "int64_t[]", "int64_t **", "uint64_t *", "aclDataType *", "aclFormat *", "aclOpExecutor **", "aclTensor **",
    "aclrtEventRecordedStatus *", "aclrtStreamStatus *", "char[]",
)

_lock = threading.Lock()  # guards _texts and _types; cdef itself is not thread-safe
_texts: list[str] = []  # every text given to cdef, in order: the headers', then each provider's
_types: dict[str, Any] = {}


def _cdef_locked(text: str, type_names: tuple[str, ...]) -> None:
    ffi.cdef(text)
    _texts.append(text)
    _types.update({name: ffi.typeof(name) for name in type_names})


def declare() -> None:
    """Give headers/ to cdef, once."""
    if not _texts:
        with _lock:
            _declare_locked()


def _declare_locked() -> None:
    # (_lock held; a loop under a lock is a function of its own: ARCHITECTURE.md)
    if not _texts:  # (the headers, in order, and the C library's free: one text)
        headers = [(headers_dir() / name).read_text() for name in HEADER_FILES]
        _cdef_locked("\n".join([*headers, "void free(void *);"]), _TYPE_NAMES)


def add_declarations(text: str, type_names: tuple[str, ...] = ()) -> None:
    """Declarations a provider adds (the emulator's aclemu* extras), and the types of them the
    bindings build values of. Given to cdef now, after the headers (whose types they use); a
    text given already is not given again (cdef refuses a second declaration of a struct, and a
    module imported again, or whose first import failed, adds its text again)."""
    declare()
    with _lock:
        if text not in _texts:
            _cdef_locked(text, type_names)


def text(p: Any) -> str:
    """A C string (char *, char[]) as str ('' for NULL); undecodable bytes replaced."""
    # (a char string is bytes: cffi gives str for wchar_t only)
    return ffi.string(p).decode("utf-8", "replace") if p != NULL else ""  # type: ignore[union-attr]


def ctype(name: str) -> Any:
    """A pre-parsed C type (one of those declared up front)."""
    if name not in _types:
        declare()
    return _types[name]


@functools.cache  # (two first uses at once each open it, and either is the process: no lock)
def process() -> Any:
    """The process's own symbol table as a cffi library (loading nothing): cffi exposes the
    values the declarations give on any library object, and the C library's ``free`` is there."""
    return ffi.dlopen(None)


@functools.cache  # (a hit runs no Python frame: the NumPy call's copies look their kind up here)
def const(name: str) -> int:
    """The value of an enum item, ``#define`` or ``static const int`` of the headers."""
    declare()
    return int(getattr(process(), name))


_FUNCTION = re.compile(r"\b(acl\w+)\s*\(")
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)


def _functions(text: str) -> list[str]:
    return list(dict.fromkeys(_FUNCTION.findall(_COMMENT.sub(" ", text))))


def functions_in(header: str) -> list[str]:
    """The functions one file of headers/ declares, in order."""
    return _functions((headers_dir() / header).read_text())


def extra_functions() -> list[str]:
    """The functions providers added (the emulator's aclemu* extras)."""
    with _lock:
        text = "".join(_texts[1:])
    return _functions(text)
