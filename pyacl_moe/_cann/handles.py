"""Owned CANN handles: where a created object's handle lives, and its one release.

A :class:`Handle` is made *before* the C call that creates the object, and that call writes the
handle straight into the handle's slot (CANN's out-parameters), so no handle can be lost
between the C call returning and Python storing it, even when an asynchronous exception
(KeyboardInterrupt) is raised right there. Functions that return the handle instead of writing
it go through :func:`store_result`, which stores the result without running any bytecode in
between.

:meth:`Handle.release` is exactly-once, under threads and asynchronous exceptions alike: it
reads the slot, clears it, then calls the release function, with nothing between the clearing
and the call that can run Python code (only loads), so an interrupt either comes before the
clearing (nothing happened; releasing again does it) or after the call (done). CPython checks
for pending signals and thread switches only at calls, backward jumps and function entry,
never between two loads or stores, which is what makes the read-clear pair atomic too.

After fork() in a child of a process that initialized CANN, every handle is dead: releasing
one does nothing (the child must not call into the parent's CANN objects).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from . import declare

__all__ = ["Handle", "mark_process_forked", "process_forked", "store_result"]

_forked = [False]  # set in a child of an initialized process; never cleared


def mark_process_forked() -> None:
    _forked[0] = True


def process_forked() -> bool:
    """Whether this process is a fork() child of one that initialized CANN."""
    return _forked[0]


def store_result(slot: Any, fn: Callable[..., Any], *args: Any) -> None:
    """``slot[0] = fn(*args)`` with no bytecode between the call and the store: map() calls fn
    and the slot's own __setitem__ from C, and the zero-length deque drains them, so an
    asynchronous exception cannot fall between the two and lose the handle."""
    collections.deque(map(slot.__setitem__, (0,), map(fn, *[(a,) for a in args])), maxlen=0)


class Handle:
    """A CANN object this process owns: its handle slot and how to release it.

    Subclasses name the C type of the slot and implement :meth:`_release_function` (the CANN
    call that destroys the object) and, if the call needs a device context, :meth:`_prepare`.
    ``value`` is the raw handle, for the bindings layer only.
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
        self._slot[0] = declare.NULL

    def _prepare(self) -> bool:
        """Make the release possible (a current device context); False when the object is
        already gone with its device."""
        return True

    def _release_function(self) -> Callable[[Any], int]:  # pragma: no cover - overridden
        raise NotImplementedError

    def release(self) -> int:
        """Release the object once; returns CANN's status (0 when there was nothing to do).

        The caller decides whether a failure is raised (an explicit close) or dropped (a
        finalizer)."""
        if _forked[0] or not self._prepare():
            self._slot[0] = declare.NULL
            return 0
        fn = self._release_function()  # fetched first: no Python call may follow the clearing
        slot = self._slot
        h = slot[0]
        if h == declare.NULL:
            return 0
        slot[0] = declare.NULL
        return int(fn(h))
