"""The safe point: what an object dropped without ``close()`` owned is released on the caller's
thread, at the next call into pyacl_moe, never in a finalizer.

An object whose release must wait for its owner to go (a DeviceArray's memory, an Event's
handle, a Stream, a plan) is tracked by a *token*: a weak reference to the owner whose
callback is ``deque.append`` (the garbage collector runs no Python code of ours), carrying the
device and what to hand it. The device keeps the token alive (in its inventory, or in the
block the memory is). :func:`collect`, called on entry by every call that allocates,
synchronizes or closes, gives each dead owner's token to its device (``Device.drop``), which
recycles the block or releases the object; a release that must wait (a dropped stream still
running, a status CANN refused) is queued again with :func:`retry`, for the next safe point.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any

from ._cann.acl import forked

__all__ = ["Token", "collect", "retry", "track"]


class Token(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to an owner, with what its device releases once the owner is gone."""

    __slots__ = ("device", "what", "tries")
    device: Any  # the device that releases ``what`` (unset for a block's token: its deque says)
    what: Any  # the holder to release, or the block to take back
    tries: int  # refusals so far


# Tokens of owners that died (or whose release waits), oldest first. Appended by the garbage
# collector and by retry(): a deque's append and popleft are thread-safe by its documentation.
# Only the collector holding _lock reads or removes from the left.
_dead: collections.deque[Token] = collections.deque()
_lock = threading.Lock()  # one collector at a time: guards the left end of _dead


def track(owner: Any, device: Any, what: Any) -> Token:
    """A token for ``owner``: once it is gone, ``device.drop`` receives ``what``. The caller
    keeps the token alive where the device finds it (one nothing refers to never fires)."""
    token = Token(owner, _dead.append)
    token.device, token.what, token.tries = device, what, 0
    return token


retry = _dead.append  # hand a token to the next safe point again (its release could not be made now)


def collect() -> None:
    """The safe point: hand every dead owner's token to its device. Never waits for queued
    work; never called with a lock of the runtime held (lock order: this one first)."""
    if _dead and not forked():  # (a deque's length: one appended meanwhile waits for the next safe point;
        with _lock:  # in a fork() child nothing inherited is released, and a parent thread may hold the lock)
            _drain()


def _drain() -> None:
    # (_lock held; a loop under a lock is a function of its own: ARCHITECTURE.md) A token
    # leaves the deque only after its device took it, and taking one twice is harmless, so a
    # drop an interrupt cut short is made again by the next collector. What a release lets go
    # of (an event a dropped stream's queued work held) is taken in the same call; a token
    # handed back for later (retry) waits for the next one.
    seen: set[int] = set()
    while _dead and id(_dead[0]) not in seen:
        batch = [_dead[i] for i in range(len(_dead))]
        seen.update(map(id, batch))
        for device in dict.fromkeys(token.device for token in batch):  # each device its tokens, in order
            device.drop([token for token in batch if token.device is device])
        for _ in batch:
            _dead.popleft()
