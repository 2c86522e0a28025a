"""Owned CANN handles: where a created object's handle lives, and its one release.

A :class:`Handle` is made before the C call that creates the object, and that call writes the
handle into the handle's slot (CANN's out-parameters), so the object has an owner from the
moment it exists. :meth:`Handle.release` takes the handle out of its slot and destroys it under
a lock (one of a few, by the handle's identity): of several threads (or a close and a
finalizer) releasing the same handle, exactly one destroys it.

After fork() in a child of a process that initialized CANN, every handle is dead: releasing
one does nothing (the child must not call into the parent's CANN objects).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

from . import declare

__all__ = ["Handle", "interrupts_deferred", "mark_process_forked", "process_forked"]

_forked = [False]  # set in a child of an initialized process; never cleared
# Guard the Handles' slots, each handle by the lock its identity picks: releases of different
# handles seldom wait for one another (a stream's destroy may wait for its work).
_locks = [threading.Lock() for _ in range(64)]


def _lock(h: object) -> threading.Lock:
    return _locks[(id(h) >> 4) % len(_locks)]


def mark_process_forked() -> None:
    _forked[0] = True
    _locks[:] = [threading.Lock() for _ in range(len(_locks))]  # a parent thread may have held one


def process_forked() -> bool:
    """Whether this process is a fork() child of one that initialized CANN."""
    return _forked[0]


class Handle:
    """A CANN object this process owns: its handle slot and how to release it.

    Subclasses name the C type of the slot and implement :meth:`_release_function` (the CANN
    call that destroys the object) and, if the call needs a device context, :meth:`_prepare`.
    """

    __slots__ = ("_slot", "__weakref__")
    SLOT_TYPE = "void **"
    API = ""  # the CANN function that releases it, for error messages

    def __init__(self) -> None:
        self._slot = declare.ffi.new(declare.ctype(self.SLOT_TYPE))

    @property
    def value(self) -> Any:
        return self._slot[0]

    @property
    def address(self) -> int:
        """The handle as an integer (0 when released or never created)."""
        return int(declare.ffi.cast(declare.ctype("uintptr_t"), self._slot[0]))

    def __bool__(self) -> bool:
        return bool(self._slot[0] != declare.NULL)

    def forget(self) -> None:
        """Drop the handle without releasing it: CANN took it (a one-shot executor consumed by
        its launch) or already released it (its device was reset)."""
        with _lock(self):
            self._slot[0] = declare.NULL

    def _prepare(self) -> bool:
        """Make the release possible (a current device context); False when the object is
        already gone with its device."""
        return True

    def _release_function(self) -> Callable[[Any], int]:  # pragma: no cover - overridden
        raise NotImplementedError

    def release(self) -> int:
        """Release the object once; returns CANN's status (0 when there was nothing to do).
        The caller decides whether a failure is raised (an explicit close) or dropped."""
        if _forked[0] or not self._prepare():
            self.forget()
            return 0
        fn = self._release_function()
        with _lock(self):
            h = self._slot[0]
            if h == declare.NULL:
                return 0
            self._slot[0] = declare.NULL
            return int(fn(h))


class interrupts_deferred:
    """Hold SIGINT's Python handler back across a C call that returns a new handle, until the
    handle is stored: a KeyboardInterrupt raised as the call returns would lose the handle
    for good. Python runs signal handlers on the main thread only, so elsewhere this does
    nothing; a SIGINT that arrived meanwhile is handed to the handler on exit."""

    __slots__ = ("saved", "hit")

    def __enter__(self) -> None:
        self.saved: Any = None
        self.hit: tuple[int, Any] | None = None
        if threading.current_thread() is not threading.main_thread():
            return
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):  # (SIG_IGN, SIG_DFL: no Python code runs)
            self.saved = handler
            signal.signal(signal.SIGINT, self._held)

    def _held(self, signum: int, frame: Any) -> None:
        self.hit = (signum, frame)

    def __exit__(self, *exc: object) -> None:
        if self.saved is None:
            return
        signal.signal(signal.SIGINT, self.saved)
        if self.hit is not None:
            self.saved(*self.hit)
