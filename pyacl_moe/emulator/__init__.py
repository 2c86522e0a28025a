"""The bundled host emulator of the part of CANN this project binds.

``build()`` compiles it (once, cached) into a directory laid out like a CANN install and
returns that directory. The other functions talk to the emulator the process has loaded
(``pyacl_moe.use_emulator()``, ``PYACL_MOE_EMULATOR=1`` or the CLI's ``--emulator``): its
live-object counters, fault injection and deliberately wrong kernels. They raise RuntimeError
when the process is bound to a real CANN instead.
"""

from __future__ import annotations

from ._build import EmulatorBuildError, build, cache_root

MUTATIONS: tuple[str, ...] = ("skip-last-k", "fp16-accumulate", "off-by-one-row")
FIRST_PHASE_API = "aclnnMoeInitRoutingV2GradGetWorkspaceSize"
# Status that, injected into the first phase, weakens it instead of failing it.
SKIP_CHECKS = -1

__all__ = [
    "FIRST_PHASE_API",
    "MUTATIONS",
    "SKIP_CHECKS",
    "EmulatorBuildError",
    "build",
    "cache_root",
    "check_guards",
    "clear_faults",
    "corrupt_guard",
    "inject_fault",
    "mutation",
    "path",
    "set_mutation",
    "weaken_validation",
    "stats",
    "version",
]


def path() -> str:
    """The emulator's home directory (``<home>/lib64`` holds the libraries), building it first
    if needed."""
    return build()


def _emu():
    from .. import _ffi

    return _ffi.emulator_controls()


def stats() -> dict[str, int]:
    """Live-object counters of the loaded emulator: allocations and bytes, streams, events,
    tensors, scalars, int arrays, executors, pending tasks, and cumulative figures."""
    return _emu().stats()


def inject_fault(api: str, nth: int = 1, status: int | None = None) -> None:
    """Make the ``nth`` call (counted from now) of the CANN function ``api`` fail with
    ``status`` (None: that function's usual failure); ``nth=0`` fails every call until
    :func:`clear_faults`. ``api="*"`` counts every call except releases and queries."""
    if isinstance(nth, bool) or not isinstance(nth, int) or nth < 0:
        raise ValueError(f"nth must be an int >= 0 (0: every call), got {nth!r}")
    _emu().inject_fault(api, nth, status or 0)


def weaken_validation() -> None:
    """Make the op's first phase skip the vendor's data type, format and tiling checks until
    :func:`clear_faults` (null checks stay): what a broken CANN release would do. Executors it
    builds that way are never launched."""
    _emu().inject_fault(FIRST_PHASE_API, 0, SKIP_CHECKS)


def clear_faults() -> None:
    """Forget every fault injected and not yet fired."""
    _emu().clear_faults()


def set_mutation(name: str | None) -> None:
    """Switch the kernel to a deliberately wrong variant (one of MUTATIONS), or back (None)."""
    if name not in (None, "", "none", *MUTATIONS):
        raise ValueError(f"mutation must be one of {MUTATIONS} or None, not {name!r}")
    _emu().set_mutation(name or "")


def mutation() -> str | None:
    """The active kernel mutation, or None."""
    return _emu().mutation() or None


def check_guards() -> int:
    """How many live device allocations have corrupt guard bytes (0 when all is well)."""
    return _emu().check_guards()


def corrupt_guard(address: int) -> None:
    """Test hook: overwrite a guard byte of the allocation holding ``address``, as a stray
    device write past its end would."""
    _emu().corrupt_guard(address)


def version() -> str:
    """The loaded emulator's version string."""
    return _emu().version()
