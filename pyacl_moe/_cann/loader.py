"""Finding and loading CANN: the library search, dlopen, and providers.

Nothing is loaded at import. The first call that needs CANN loads it once, thread-safely, from
the first of: ``load(ascend_home=...)``; ``$ASCEND_HOME_PATH``; ``$ASCEND_TOOLKIT_HOME``;
``/usr/local/Ascend/ascend-toolkit/latest``; the dynamic loader's own search path.

A *provider* is another home of the same three libraries, registered by name. The bundled
emulator registers itself as the provider "emulator" when its package is imported (this layer
never imports it); ``PYACL_MOE_EMULATOR=1``, ``select_provider("emulator")`` or
``load(emulator=True)`` pick it. A provider may add declarations of its own extras.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import errors
from . import declare

__all__ = ["LIBRARY_NAMES", "Libraries", "LibraryInfo", "Provider", "libs", "library_info", "load", "loaded_info",
           "loaded_libraries", "register_provider", "select_provider"]

LIBRARY_NAMES: tuple[str, ...] = ("ascendcl", "nnopbase", "opapi")
DEFAULT_TOOLKIT_HOME = "/usr/local/Ascend/ascend-toolkit/latest"
EMULATOR = "emulator"


@dataclass(frozen=True)
class LibraryInfo:
    """Which CANN the process is bound to."""

    backend: str  # "cann" or a provider's name ("emulator")
    home: str | None  # the toolkit (or provider) home, None when found by the loader's path
    paths: dict[str, str] = field(default_factory=dict)  # library name -> path given to dlopen


@dataclass(frozen=True)
class Provider:
    """Another home of CANN's three libraries. ``home()`` returns a directory holding lib64/
    (building it first if it must); ``declarations`` are extra C declarations (with the types
    the bindings build values of) given to cdef before loading."""

    name: str
    home: Callable[[], str]
    declarations: str = ""
    types: tuple[str, ...] = ()


class Libraries:
    """The three loaded libraries (cffi library objects) and where they came from."""

    __slots__ = ("acl", "nn", "op", "info")

    def __init__(self, acl: Any, nn: Any, op: Any, info: LibraryInfo) -> None:
        self.acl, self.nn, self.op, self.info = acl, nn, op, info


_lock = threading.Lock()  # guards every name below
_providers: dict[str, Provider] = {}
_selected: str | None = None  # a provider chosen before loading
_libs: Libraries | None = None


def _reset_lock_in_child() -> None:
    # A thread of the parent may have held the lock at fork; it does not exist in the child.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_lock_in_child)


def register_provider(provider: Provider) -> None:
    """Make a provider available by name (done once, at the provider's import)."""
    with _lock:
        if provider.name not in _providers:
            _providers[provider.name] = provider
            if provider.declarations:
                declare.add_declarations(provider.declarations, provider.types)


def _env_wants_emulator() -> bool:
    return os.environ.get("PYACL_MOE_EMULATOR", "").strip().lower() in ("1", "true", "yes", "on")


def select_provider(name: str) -> None:
    """Bind this process to a registered provider instead of an installed CANN. Must come
    before anything loads CANN; once the real libraries are loaded the choice is final."""
    global _selected
    with _lock:
        if name not in _providers:
            raise RuntimeError(f"no provider named {name!r} is registered (known: {sorted(_providers)})")
        if _libs is not None and _libs.info.backend != name:
            raise RuntimeError(
                f"CANN is already loaded from {_libs.info.home or 'the loader path'}; "
                f"selecting {name!r} must come first"
            )
        _selected = name


def _dlopen_home(home: str, backend: str) -> Libraries:
    lib64 = Path(home) / "lib64"
    paths = {n: str(lib64 / f"lib{n}.so") for n in LIBRARY_NAMES}
    missing = [p for p in paths.values() if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(", ".join(missing) + " not found")
    # In dependency order, so each library finds the ones it needs already loaded.
    acl, nn, op = (declare.ffi.dlopen(paths[n]) for n in LIBRARY_NAMES)
    return Libraries(acl, nn, op, LibraryInfo(backend, str(Path(home)), paths))


def _search(ascend_home: str | None) -> Libraries:
    if ascend_home is not None:
        try:
            return _dlopen_home(ascend_home, "cann")
        except (OSError, FileNotFoundError) as exc:
            raise errors.CannNotFoundError([f"ascend_home={ascend_home!r}: {exc}"]) from None
    tried = []
    candidates = [
        ("$ASCEND_HOME_PATH", os.environ.get("ASCEND_HOME_PATH")),
        ("$ASCEND_TOOLKIT_HOME", os.environ.get("ASCEND_TOOLKIT_HOME")),
        ("default install", DEFAULT_TOOLKIT_HOME),
    ]
    for label, home in candidates:
        if not home:
            tried.append(f"{label}: not set")
            continue
        try:
            return _dlopen_home(home, "cann")
        except (OSError, FileNotFoundError) as exc:
            tried.append(f"{label} = {home}: {exc}")
    try:
        acl, nn, op = (declare.ffi.dlopen(f"lib{n}.so") for n in LIBRARY_NAMES)
        return Libraries(acl, nn, op, LibraryInfo("cann", None, {n: f"lib{n}.so" for n in LIBRARY_NAMES}))
    except OSError as exc:
        tried.append(f"dynamic loader path (LD_LIBRARY_PATH, ld.so.cache): {exc}")
    raise errors.CannNotFoundError(tried)


def _resolve_all(libs: Libraries) -> None:
    """Resolve every declared function now: cffi resolves a function on first use under its
    internal lock (see declare's docstring for why that must not happen in a finalizer)."""
    for name in declare.declared_functions():
        for lib in (libs.acl, libs.nn, libs.op):
            try:
                getattr(lib, name)
            except AttributeError:  # not in this library (or a provider's extra on a real CANN)
                continue


def load(ascend_home: str | None = None, *, emulator: bool | None = None) -> LibraryInfo:
    """Load the CANN libraries now (otherwise the first call that needs them does).

    ``ascend_home``: a toolkit home holding lib64/ (what set_env.sh exports as
    ASCEND_HOME_PATH). ``emulator=True`` binds to the bundled emulator. Loading twice is a
    no-op if the choice is the same and an error otherwise.
    """
    global _libs, _selected
    if ascend_home is not None and not isinstance(ascend_home, (str, os.PathLike)):
        raise errors.InvalidArgument("ascend_home", f"must be a path (str or os.PathLike) or None, got "
                                                    f"{type(ascend_home).__name__}")
    if emulator is not None and not isinstance(emulator, bool):
        raise errors.InvalidArgument("emulator", f"must be a bool or None, got {type(emulator).__name__}")
    with _lock:
        provider = _selected
        if emulator or (emulator is None and provider is None and _env_wants_emulator()):
            provider = EMULATOR
        elif emulator is False:
            provider = None
        if _libs is not None:
            same = _libs.info.backend == (provider or "cann") and (
                ascend_home is None or _libs.info.home == str(Path(ascend_home))
            )
            if not same and (emulator is not None or ascend_home is not None):
                raise RuntimeError(f"CANN is already loaded ({_libs.info}); it cannot be switched")
            return _libs.info
        if provider is not None:
            p = _providers.get(provider)
            if p is None:
                raise RuntimeError(f"no provider named {provider!r} is registered; import pyacl_moe first")
            declare.declare()
            libs = _dlopen_home(p.home(), provider)
            _selected = provider
        else:
            declare.declare()
            libs = _search(ascend_home)
        _resolve_all(libs)
        _libs = libs
        return libs.info


def libs() -> Libraries:
    """The loaded libraries, loading them if needed."""
    lib = _libs
    if lib is None:
        load()
        lib = _libs
    return lib  # type: ignore[return-value]


def loaded_libraries() -> Libraries | None:
    """The loaded libraries, or None if nothing is loaded yet (loads nothing)."""
    return _libs


def library_info() -> LibraryInfo:
    """Which libraries are loaded (loading them if needed)."""
    return libs().info


def loaded_info() -> LibraryInfo | None:
    """Which libraries are loaded, or None if nothing is loaded yet (loads nothing)."""
    lib = _libs
    return lib.info if lib is not None else None
