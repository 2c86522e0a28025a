"""Thin wrappers of the emulator's extras (aclemu.h: counters, fault injection, kernel
mutations, guard checks, stream mode). The declarations come from the emulator's package when
it is imported (it adds them); this layer does not import the emulator. Every function raises
RuntimeError when the process is bound to a real CANN.
"""

from __future__ import annotations

from typing import Any

from . import declare, loader

__all__ = ["check_guards", "clear_faults", "corrupt_guard", "inject_fault", "mutation", "set_mutation",
           "set_stream_mode", "stats", "stream_mode", "version"]

STATS_TYPE = "aclemuStats *"


def _acl() -> Any:
    libs = loader.libs()
    if libs.info.backend != loader.EMULATOR:
        raise RuntimeError("the loaded CANN is not the emulator; its extras are unavailable")
    return libs.acl


def stats() -> dict[str, int]:
    acl = _acl()
    s = declare.ffi.new(declare.ctype(STATS_TYPE))
    acl.aclemuGetStats(s)
    return {name: int(getattr(s, name)) for name, _ in declare.ctype(STATS_TYPE).item.fields}


def inject_fault(api: str, nth: int, status: int) -> None:
    if _acl().aclemuInjectFault(api.encode(), nth, status) != 0:
        raise ValueError(f"cannot inject a fault into {api!r} at call {nth} (table full or bad argument)")


def clear_faults() -> None:
    _acl().aclemuClearFaults()


def set_mutation(name: str) -> None:
    if _acl().aclemuSetMutation(name.encode()) != 0:
        raise ValueError(f"unknown mutation {name!r}")


def mutation() -> str:
    return declare.text(_acl().aclemuGetMutation())


def set_stream_mode(mode: str) -> None:
    if _acl().aclemuSetStreamMode(mode.encode()) != 0:
        raise ValueError(f"unknown stream mode {mode!r}")


def stream_mode() -> str:
    return declare.text(_acl().aclemuGetStreamMode())


def check_guards() -> int:
    return int(_acl().aclemuCheckGuards())


def corrupt_guard(address: int) -> None:
    if _acl().aclemuCorruptGuard(declare.ffi.cast(declare.ctype("void *"), address)) != 0:
        raise ValueError(f"{address:#x} is not inside a live device allocation")


def version() -> str:
    return declare.text(_acl().aclemuVersion())
