"""The bundled host emulator of the part of CANN this project binds.

``build()`` compiles it (once, cached) into a directory laid out like a CANN install and
returns that directory. The package's top registers the emulator with the bindings layer as the
provider "emulator", whose home imports this package (which declares the emulator's extras)
and builds it: the bindings never import it. :func:`use_emulator`, ``PYACL_MOE_EMULATOR=1`` or
the CLI's ``--emulator`` select it.

The other functions talk to the emulator the process has loaded: its live-object counters,
fault injection, deliberately wrong kernels and stream mode. They raise RuntimeError when the
process is bound to a real CANN instead.
"""

from __future__ import annotations

from .._cann import aclemu, declare, loader
from ..device import collect
from ..errors import InvalidArgument
from . import _build, _releases
from ._build import SRC_DIR, build, build_tree, cache_root
from ._env import EmulatorConfigError, check_environment
from ._errors import EmulatorBuildError

# Deliberately wrong kernels, for proving that a check catches a wrong op: the backward's,
# and the forward's (which the backward kernel ignores).
MUTATIONS: tuple[str, ...] = ("skip-last-k", "fp16-accumulate", "off-by-one-row")
# The releases the emulator stands for (PYACL_MOE_EMU_RELEASE), and the one it is when unset.
RELEASES: tuple[str, ...] = tuple(_releases.PROFILES)
DEFAULT_RELEASE = _releases.DEFAULT
FORWARD_MUTATIONS: tuple[str, ...] = ("fwd-unstable-sort", "fwd-wrong-row")
# Memory faults of the backward kernel, for the poisoned-memory checks: the last row of out left
# unwritten, and one element written past out.
MEMORY_MUTATIONS: tuple[str, ...] = ("skip-last-row", "overrun")
STREAM_MODES: tuple[str, ...] = ("async", "lazy")
FIRST_PHASE_API = "aclnnMoeInitRoutingV2GradGetWorkspaceSize"
# Status that, injected into the first phase, weakens it instead of failing it.
SKIP_CHECKS = -1

__all__ = [
    "announce_builds",
    "FIRST_PHASE_API",
    "FORWARD_MUTATIONS",
    "MEMORY_MUTATIONS",
    "MUTATIONS",
    "SKIP_CHECKS",
    "STREAM_MODES",
    "EmulatorBuildError",
    "EmulatorConfigError",
    "DEFAULT_RELEASE",
    "RELEASES",
    "build",
    "build_tree",
    "cache_root",
    "library_paths",
    "release",
    "check_environment",
    "check_guards",
    "clear_faults",
    "corrupt_guard",
    "inject_fault",
    "mutation",
    "path",
    "set_mutation",
    "set_stream_mode",
    "stats",
    "stream_mode",
    "use_emulator",
    "version",
    "weaken_validation",
]

# The emulator's extras (aclemu.h), declared with the headers when this package is imported:
# the provider the package's top registers imports it before loading its home.
declare.add_declarations((SRC_DIR / "aclemu.h").read_text(), (aclemu.STATS_TYPE,))


def announce_builds(on: bool) -> None:
    """Whether a build of the emulator says on stderr, in one line, what it compiles and where
    (the default; the CLI's ``--json`` turns it off)."""
    _build.announce[0] = bool(on)


def use_emulator() -> None:
    """Bind this process to the bundled emulator (built on first use) instead of a CANN install.

    Call before anything loads CANN; once the real libraries are loaded the choice is final.
    Raises EmulatorConfigError at once when a PYACL_MOE_EMU_* variable is malformed.
    """
    check_environment()
    loader.select_provider(loader.EMULATOR)


def path(release: str | None = None) -> str:
    """The home of a release's emulated install (``release``, default the selected one): what
    its set_env.sh exports as ASCEND_HOME_PATH, ``<home>/lib64`` holding its libraries. Builds
    first if needed."""
    profile = _profile(release)
    return f"{build_tree()}/{profile.release}/{_releases.home(profile)}"


def _profile(name: str | None) -> _releases.Profile:
    check_environment()
    known = _releases.canonical(name) if name is not None else None
    if name is not None and known is None:
        raise ValueError(f"release must be one of {RELEASES} or its line "
                         f"({', '.join(_releases.SHORT_NAMES)}), not {name!r}")
    return _releases.PROFILES[known] if known else _releases.selected()


def release() -> str:
    """The release ``PYACL_MOE_EMU_RELEASE`` selects (``DEFAULT_RELEASE`` when unset)."""
    check_environment()
    return _releases.selected().release


def library_paths(name: str | None = None) -> list[tuple[str, str]]:
    """(library, path) of a release's emulated install (``name``, default the selected one), in
    the order they load: libascendcl, libnnopbase, then the op library's dependency and the op
    library, whose name is "op". Builds first if needed."""
    profile = _profile(name)
    tree = build_tree()
    libs = _releases.libraries(profile)
    return [(lib.name if i < len(libs) - 1 else "op", f"{tree}/{profile.release}/{lib.path}")
            for i, lib in enumerate(libs)]


def stats() -> dict[str, int]:
    """Live-object counters of the loaded emulator: allocations and bytes, streams, events,
    tensors, scalars, int arrays, executors, pending tasks, and cumulative figures. What the
    process dropped is released first, so the counters show what is really alive."""
    collect()
    return aclemu.stats()


def inject_fault(api: str, nth: int = 1, status: int | None = None) -> None:
    """Make the ``nth`` call (counted from now) of the CANN function ``api`` fail with
    ``status`` (None: that function's usual failure); ``nth=0`` fails every call until
    :func:`clear_faults`. ``api="*"`` counts every call except releases and queries."""
    if not isinstance(api, str) or not api or "\0" in api or len(api) > 128:
        raise InvalidArgument("api", f"must be the name of a CANN function (a str of 1 to 128 characters) or '*', "
                                     f"got {api!r:.80}")
    if isinstance(nth, bool) or not isinstance(nth, int) or not 0 <= nth <= 2**31 - 1:
        raise InvalidArgument("nth", f"must be an int in [0, 2**31 - 1] (0: every call), got {nth!r:.80}")
    if status is not None and (isinstance(status, bool) or not isinstance(status, int) or not 1 <= status <= 2**31 - 1):
        raise InvalidArgument("status", f"must be None (the function's usual failure) or a CANN status, an int in "
                                        f"[1, 2**31 - 1], got {status!r:.80}")
    aclemu.inject_fault(api, nth, status or 0)


def weaken_validation() -> None:
    """Make the op's first phase skip the vendor's data type, format and tiling checks until
    :func:`clear_faults` (null checks stay): what a broken CANN release would do. Executors it
    builds that way are never launched."""
    aclemu.inject_fault(FIRST_PHASE_API, 0, SKIP_CHECKS)


def clear_faults() -> None:
    """Forget every fault injected and not yet fired."""
    aclemu.clear_faults()


def set_mutation(name: str | None) -> None:
    """Switch a kernel to a deliberately wrong variant (one of MUTATIONS, FORWARD_MUTATIONS or
    MEMORY_MUTATIONS), or back (None)."""
    known = MUTATIONS + FORWARD_MUTATIONS + MEMORY_MUTATIONS
    if name not in (None, "", "none", *known):
        raise ValueError(f"mutation must be one of {known} or None, not {name!r}")
    aclemu.set_mutation(name or "")


def mutation() -> str | None:
    """The active kernel mutation, or None."""
    return aclemu.mutation() or None


def set_stream_mode(mode: str) -> None:
    """"async" (the default): a device engine runs queued work in the background, as hardware
    does. "lazy": queued work runs only when something waits for it, so a test can see work
    that is queued and not yet run."""
    if mode not in STREAM_MODES:
        raise ValueError(f"stream mode must be one of {STREAM_MODES}, not {mode!r}")
    aclemu.set_stream_mode(mode)


def stream_mode() -> str:
    """The emulator's stream mode: "async" or "lazy"."""
    return aclemu.stream_mode()


def check_guards() -> int:
    """How many live device allocations have corrupt guard bytes (0 when all is well)."""
    return aclemu.check_guards()


def corrupt_guard(address: int) -> None:
    """Test hook: overwrite a guard byte of the allocation holding ``address``, as a stray
    device write past its end would."""
    aclemu.corrupt_guard(address)


def version() -> str:
    """The loaded emulator's version string."""
    return aclemu.version()
