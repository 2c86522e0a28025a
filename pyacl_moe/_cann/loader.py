"""Finding and loading CANN: the search over homes, dlopen, the symbol check, providers.

Nothing is loaded at import. The first call that needs CANN loads it once, thread-safely. The
homes are searched in the order :func:`pyacl_moe._cann.layout.candidate_homes` documents
(``load(ascend_home=...)``, ``$ASCEND_HOME_PATH``, ``$ASCEND_TOOLKIT_HOME``,
``/usr/local/Ascend/cann``, ``/usr/local/Ascend/ascend-toolkit/latest``, the same two under
``$HOME/Ascend``), then the dynamic loader's own path. A home is judged before anything of it
is loaded, from its files alone: ``lib64/libascendcl.so`` and ``lib64/libnnopbase.so`` must
define every function headers/ declares for them, and one op library (the first of
``layout.OP_LIBRARIES``) must export the two phases of both ops, with its dependencies found.
The first home that passes is loaded, dependencies first and each by path, so no
``LD_LIBRARY_PATH`` is needed; every declared function is then resolved. When no home passes,
:class:`~pyacl_moe.errors.CannNotFoundError` names every home and library tried and what each
lacked.

A *provider* is another home, registered by name. The package's top registers the bundled
emulator as the provider "emulator", whose home imports and builds it when it is asked for
(this layer never imports it); ``PYACL_MOE_EMULATOR=1``, ``select_provider("emulator")`` or
``load(emulator=True)`` pick it. Its home is judged and loaded exactly as a CANN's; a provider
may add declarations of its own extras (the emulator's package does when it is imported).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import errors
from .._paths import untrusted_above
from . import declare, layout

__all__ = ["Libraries", "LibraryInfo", "Provider", "libs", "library_info", "load", "loaded_info", "register_provider",
           "select_provider"]

EMULATOR = "emulator"

# Which declarations each library must define (headers/ file names).
_HEADERS = {
    "acl": ("acl_base.h", "acl_rt.h", "acl.h"),
    "nn": ("acl_meta.h",),
    "op": ("aclnn_moe_init_routing_v2_grad.h", "aclnn_moe_init_routing_v2.h"),
}
# Declared, used when present, absent from some releases: aclsysGetVersionStr came with 8.5.
OPTIONAL = frozenset({"aclsysGetVersionStr"})


@dataclass(frozen=True)
class LibraryInfo:
    """Which CANN the process is bound to."""

    backend: str  # "cann" or a provider's name ("emulator")
    home: str | None  # the home searched (as given), None when found by the loader's path
    paths: dict[str, str] = field(default_factory=dict)  # library ("ascendcl", "opapi_transformer") -> path
    op_library: str = ""  # the real path of the library the op was taken from
    dependencies: tuple[str, ...] = ()  # what was loaded by path first, in order


@dataclass(frozen=True)
class Provider:
    """Another home of CANN's libraries. ``home()`` returns it (building it first if it must,
    and adding the provider's own C declarations, :func:`declare.add_declarations`, if it has
    any)."""

    name: str
    home: Callable[[], str]


class Libraries:
    """The loaded libraries (cffi library objects) and where they came from; ``keep`` holds
    the dependencies loaded by path, so they stay."""

    __slots__ = ("acl", "nn", "op", "info", "keep")

    def __init__(self, acl: Any, nn: Any, op: Any, info: LibraryInfo, keep: tuple[Any, ...] = ()) -> None:
        self.acl, self.nn, self.op, self.info, self.keep = acl, nn, op, info, keep


_lock = threading.Lock()  # guards every name below
_providers: dict[str, Provider] = {}
_selected: str | None = None  # a provider chosen before loading
_libs: Libraries | None = None


def after_fork_in_child() -> None:
    """(the package's one at-fork hook, in _cann.acl, calls it) A thread of the parent may have
    held the lock at fork; it does not exist in the child."""
    global _lock
    _lock = threading.Lock()


def register_provider(provider: Provider) -> None:
    """Make a provider available by name (the first registration of a name stands)."""
    with _lock:
        if provider.name not in _providers:
            _providers[provider.name] = provider


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


# ---------------------------------------------------------------------------- judging a home

def _declared(part: str) -> list[str]:
    """The functions headers/ declares for one library ("acl", "nn", "op")."""
    return [f for h in _HEADERS[part] for f in declare.functions_in(h)]


def _fits(home: str, rel: str, wanted: list[str], loaded: set[str]) -> list[str] | str:
    """The load order for the library at ``rel`` when it is there, its dependencies are found
    and it (with them) defines ``wanted``; else what is wrong."""
    path = os.path.join(home, rel)
    if not os.path.isfile(path):
        return f"{rel}: not found"
    folders = layout.library_folders(home, path)
    deps = layout.dependency_order(path, folders, loaded)
    if deps.missing:
        names = ", ".join(sorted({f"{name} (needed by {by})" for name, by in deps.missing}))
        return f"{rel}: a dependency is missing: {names}, in none of {', '.join(folders[:3])} (nor the driver's " \
               "folders or LD_LIBRARY_PATH)"
    if deps.planted:
        return f"{rel}: refused: the dynamic loader would map {', '.join(deps.planted)}, which LD_LIBRARY_PATH's " \
               "relative or empty entry gives it (the current directory, or one below it): drop that entry, " \
               "or put the library in an absolute folder of LD_LIBRARY_PATH"
    for lib in [path, *deps.order, *deps.left]:  # (left to the dynamic loader: read, never loaded by path here)
        if why := layout.elf_problem(lib):
            return f"{rel}: {lib if lib != path else 'the library'} is {why}"
    found = [layout.defined_symbols(lib, wanted) for lib in [path, *deps.order]]
    lacking = [w for w in wanted if not any(w in f for f in found if f is not None)]
    if lacking and None not in found:  # (one that cannot be read is tried: dlopen and the resolution judge it)
        if rel not in layout.RUNTIME_LIBRARIES and len(lacking) == len(wanted):
            return f"{rel}: exports none of the op's entry points"
        more = f" and {len(lacking) - 6} more" if len(lacking) > 6 else ""
        return f"{rel}: lacks {', '.join(lacking[:6])}{more}"
    return [*deps.order, path]


def _opened(names: list[str], three: Sequence[str], backend: str, home: str | None) -> Libraries:
    """dlopen each of ``names`` in order (each finds what it needs already loaded), then bind
    the libraries ``three`` name (acl, nn, op; the others are kept loaded) and resolve them.
    ``home`` is the home they are paths in, None for names the dynamic loader looks up.
    All or nothing: when one cannot be loaded, or the resolution refuses what was loaded,
    everything opened here is closed again (last first), so that no library of a rejected home
    stays mapped for a later load to bind to by soname.

    Every declared function is resolved now, each in its own library: cffi resolves a function
    on first use under its internal lock (see declare's docstring for why that must not happen
    in a finalizer), and a function the library lacks is an install that cannot work."""
    info = LibraryInfo(backend, home, {os.path.basename(p)[3:-3]: p for p in three},
                       os.path.realpath(three[2]) if home else three[2], tuple(p for p in names if p not in three))
    handles: dict[str, Any] = {}
    try:
        for name in names:
            try:
                handles[name] = declare.ffi.dlopen(name)
            except OSError as exc:
                raise errors.CannNotFoundError([f"{name}: cannot be loaded: {exc}"]) from None
            except UnicodeEncodeError:  # (cffi encodes a path as strict UTF-8: os.fsdecode's escapes fail)
                raise errors.CannNotFoundError([f"{name!r}: cannot be loaded: its path is not valid UTF-8, which "
                                                "cffi's dlopen cannot open (rename the folder)"]) from None
        acl, nn, op = (handles[n] for n in three)
        # (hasattr first: it is what resolves a function, an optional one too)
        where = (*three[:2], info.op_library)  # (the op library by its real path)
        missing = [f"{path} lacks {name}" for part, lib, path in zip(_HEADERS, (acl, nn, op), where)
                   for name in _declared(part) if not hasattr(lib, name) and name not in OPTIONAL]
        missing += [f"{three[0]} lacks {name}" for name in declare.extra_functions()
                    if not hasattr(acl, name) and info.backend != "cann"]
        if missing:
            raise errors.CannNotFoundError(missing)
        return Libraries(acl, nn, op, info, tuple(h for n, h in handles.items() if n not in three))
    except BaseException:
        for h in reversed(list(handles.values())):
            declare.ffi.dlclose(h)
        raise


def _load_plan(home: str, backend: str, named: bool = True) -> Libraries | str:
    """The libraries of ``home`` loaded, or what they lacked: for each of acl, nn and op the
    first of its candidates that fits, every path dlopened in order (dependencies first). In a
    home found by default (not ``named``), each library to load, and every folder above it as
    written and as its links resolve, must pass the home's trust rule too: a folder inside the
    home, or a link out of it, that others can write to chooses what is loaded."""
    problems: list[str] = []
    order: list[str] = []
    three: list[str] = []  # the path of each library (acl, nn, op)
    for part, candidates in [("acl", layout.RUNTIME_LIBRARIES[:1]), ("nn", layout.RUNTIME_LIBRARIES[1:]),
                             ("op", [rel.format(arch=layout.arch()) for rel in layout.OP_LIBRARIES])]:
        wanted = [f for f in _declared(part) if f not in OPTIONAL]  # (for "op": the op's four entry points)
        passed_over: list[str] = []  # op libraries there but unfit: only reported when none fits
        for rel in candidates:
            got = _fits(home, rel, wanted, {os.path.basename(p) for p in order})
            if isinstance(got, list):
                three.append(os.path.join(home, rel))
                order += [p for p in got if p not in order]
                break
            if part != "op" or not got.endswith(": not found"):
                passed_over.append(got)
        else:
            problems += passed_over or [f"no op library with the op's four entry points (looked for "
                                        f"{', '.join(candidates)})"]
    if not named and not problems:
        problems += [f"refused: {why}: a library of a home found by default is loaded only when it and every folder "
                     "above it are owned by root or this user and writable by no one else (name the home in "
                     "ASCEND_HOME_PATH to use it anyway)" for why in map(untrusted_above, order) if why][:1]
    if problems:
        return "; ".join(problems)
    return _opened(order, three, backend, str(Path(home)))


def _from_loader_path() -> Libraries | str:
    """The last resort: the dynamic loader's own search (LD_LIBRARY_PATH, ld.so.cache), by
    name, the op library being the first that exports the entry points; else why none could be
    loaded. Not tried when LD_LIBRARY_PATH has a relative or empty entry (the current directory,
    for the loader); a file an absolute entry holds is checked (:func:`layout.elf_problem`)
    before it is mapped."""
    absolute, relative = layout.loader_path()
    if relative:
        shown = ", ".join(repr(e) for e in relative)
        return f"not tried: LD_LIBRARY_PATH has the relative or empty entry {shown} (the current directory, " \
               "or one below it, for the dynamic loader), and nothing is loaded from such a place"
    problems: list[str] = []
    for op in dict.fromkeys(os.path.basename(rel) for rel in layout.OP_LIBRARIES):
        names = ["libascendcl.so", "libnnopbase.so", op]
        try:  # (all three each time: a failed try leaves nothing mapped)
            for name in names:  # (a file an absolute entry holds is read before it is mapped)
                if (path := layout.find(name, absolute)) and (why := layout.elf_problem(path)):
                    raise errors.CannNotFoundError([f"{path} is {why}"])
            return _opened(names, names, "cann", None)
        except errors.CannNotFoundError as exc:
            problems += exc.tried
    return "; ".join(dict.fromkeys(problems))


def _search(ascend_home: str | None) -> Libraries:
    tried = []
    for label, home, named in layout.candidate_homes(ascend_home):
        if not home:
            tried.append(f"{label}: not set")
        elif not os.path.isdir(home):
            tried.append(f"{label} = {home}: no such folder")
        elif why := layout.home_problem(home, named):
            tried.append(f"{label} = {home}: refused: {why}")
        elif isinstance(libs := _load_plan(home, "cann", named), Libraries):
            return libs
        else:
            tried.append(f"{label} = {home}: {libs}")
    if ascend_home is None:
        if isinstance(libs := _from_loader_path(), Libraries):
            return libs
        tried.append(f"dynamic loader path (LD_LIBRARY_PATH, ld.so.cache): {libs}")
    raise errors.CannNotFoundError(tried)


def load(ascend_home: str | os.PathLike[str] | None = None, *, emulator: bool | None = None) -> LibraryInfo:
    """Load the CANN libraries now (otherwise the first call that needs them does).

    ``ascend_home``: a CANN home (what set_env.sh exports as ASCEND_HOME_PATH: a toolkit's
    ``ascend-toolkit/latest`` up to 8.3, ``cann`` or ``cann-<release>`` from 8.5); only it is
    searched. ``emulator=True`` binds to the bundled emulator. Loading twice is a no-op if the
    choice is the same and an error otherwise.
    """
    global _libs, _selected
    if ascend_home is not None and not isinstance(ascend_home, (str, os.PathLike)):
        raise errors.InvalidArgument("ascend_home", f"must be a path (str or os.PathLike) or None, got "
                                                    f"{type(ascend_home).__name__}")
    if emulator is not None and not isinstance(emulator, bool):
        raise errors.InvalidArgument("emulator", f"must be a bool or None, got {type(emulator).__name__}")
    home_arg = os.fspath(ascend_home) if ascend_home is not None else None
    wants = emulator if emulator is not None else \
        os.environ.get("PYACL_MOE_EMULATOR", "").strip().lower() in ("1", "true", "yes", "on")
    with _lock:
        # (the argument first, then a provider selected before, then the environment)
        provider = _selected if emulator is None and _selected is not None else EMULATOR if wants else None
        if _libs is not None:
            same = _libs.info.backend == (provider or "cann") and (
                home_arg is None or _libs.info.home == str(Path(home_arg))
            )
            if not same and (emulator is not None or home_arg is not None):
                raise RuntimeError(f"CANN is already loaded ({_libs.info}); it cannot be switched")
            return _libs.info
        declare.declare()
        if provider is not None:
            # (registered: select_provider refuses an unknown name, and the package's top
            # registers the emulator)
            home = _providers[provider].home()
            if isinstance(got := _load_plan(home, provider), str):
                raise errors.CannNotFoundError([f"provider {provider!r} = {home}: {got}"])
            _libs, _selected = got, provider
        else:
            _libs = _search(home_arg)
        return _libs.info


def libs() -> Libraries:
    """The loaded libraries, loading them if needed."""
    if _libs is None:
        load()
    return _libs  # type: ignore[return-value]


def library_info() -> LibraryInfo:
    """Which libraries are loaded (loading them if needed)."""
    return libs().info


def loaded_info() -> LibraryInfo | None:
    """Which libraries are loaded, or None if nothing is loaded yet (loads nothing)."""
    return _libs.info if _libs is not None else None
