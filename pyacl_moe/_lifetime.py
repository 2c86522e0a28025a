"""The one lifetime mechanism: resources released exactly once, never while queued work needs
them, never from inside a finalizer, and safe under KeyboardInterrupt.

**Owners and holders.** An object that owns a CANN resource (a stream, an event, an allocation,
an aclTensor, an executor) keeps a small *holder* with exactly what the release needs (a handle
of the bindings layer). :func:`track` ties the holder to its owner with a weak reference whose
callback is ``deque.append`` itself: when the owner dies, the garbage collector queues the
reference from C, running no Python code, so nothing can interrupt it or take a lock there.
:func:`collect`, the *safe point*, called on the calling thread by every entry of the binding
that allocates, synchronizes or closes, releases what is queued (as CuPy and numba defer their
frees). ``close()`` releases at once through :func:`release`.

**Stream order.** What queued work reads or writes is *held* on the stream's :class:`Ledger`
until that work is known complete: by a synchronize that began after it was queued, or by a
*fence*, an event recorded behind it and polled with aclrtQueryEventStatus, never waited for. No
asynchronous call ever blocks to free memory.

**Rules that make it safe under asynchronous exceptions** (CPython raises them only at calls,
backward jumps and function entry): a resource's handle is stored by the C call that creates it
(see :mod:`._cann.handles`); an object moves between containers by reading it, deleting it, then
appending it (the append's effect is done before its call can be interrupted), never by pop();
and a holder's release is idempotent, so repeating an interrupted step is always safe.

**fork().** In a child of a process that initialized CANN, everything inherited is dead: the
handles refuse to release (:func:`pyacl_moe._cann.handles.process_forked`) and the locks here
are replaced, since a parent thread may have held them at fork.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

from ._cann import acl
from ._cann.errcheck import check
from ._cann.handles import process_forked

__all__ = ["Holder", "Ledger", "Owner", "WeakMap", "close_core", "collect", "forked", "quiesce", "release",
           "release_where", "retiring", "track", "while_releases_wait"]


class Holder(Protocol):
    def release(self) -> int: ...


# Tokens (weak references) of owners that died, appended from C by the garbage collector:
# deque.append runs no Python code and allocates no Python object, so it is safe in a weakref
# callback, and a collection can never fall inside another deque operation.
_dead: collections.deque[weakref.ref[Any]] = collections.deque()
# token -> holder, for every owner not yet released: the source of truth.
_registry: dict[weakref.ref[Any], Holder] = {}
# holders whose release failed for a reason that may pass (a context switch): tried again
_retry: list[Holder] = []
# things that finish releasing later without blocking (streams dropped with queued work):
# poll() returns True once done
_pollers: list[Any] = []
_collect_lock = threading.Lock()  # one collector at a time; guards _retry and _pollers


def forked() -> bool:
    """Whether this process is a fork() child of one that initialized CANN."""
    return process_forked()


def track(owner: Any, holder: Holder) -> weakref.ref[Any]:
    """Release ``holder`` when ``owner`` dies (at the next safe point). Returns the token for
    :func:`release`. Call it before the C call that fills the holder."""
    token = weakref.ref(owner, _dead.append)
    _registry[token] = holder
    return token


def release(token: weakref.ref[Any]) -> int:
    """Release the holder of ``token`` now (an explicit close); returns CANN's status. Safe
    twice and from several threads: the holder's release is exactly-once."""
    holder = _registry.get(token)
    if holder is None:
        return 0
    status = holder.release()
    if token in _registry:
        del _registry[token]
    return status


def close_core(token: weakref.ref[Any], api: str) -> None:
    """After an owner's ``close()`` dropped its reference to a core: release the core now if
    nothing else (queued work) still holds it, raising CANN's failure; otherwise it goes when
    that work is done."""
    if token() is None:
        check(release(token), api)
    collect()


class Owner:
    """The public face of one core (an object that owns a CANN handle through :func:`track`):
    ``close()``, safe twice and from any thread, and the context manager. Subclasses keep the
    core in ``_core`` and name the CANN call that releases it in ``RELEASE_API``."""

    __slots__ = ()
    RELEASE_API = ""
    _core: Any

    def _dropped(self) -> None:
        """Drop references of the owner's own besides the core (a hook)."""

    def close(self) -> None:
        """Release the handle: at once, unless queued work (or another object built from it)
        still needs it, then when that is done. Safe twice."""
        core = self._core
        if core is None:
            return
        token = core.token
        self._core = None
        self._dropped()
        del core
        close_core(token, self.RELEASE_API)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def retiring(poller: Any) -> None:
    """Register something that finishes releasing later, without blocking anyone: its poll()
    is called at safe points until it returns True."""
    _pollers.append(poller)


def collect() -> None:
    """The safe point: release what died, on the calling thread; poll what is retiring. Called
    by every entry of the binding that allocates, synchronizes or closes (never with a stream's
    lock held); never waits for queued work.

    Each dead token is read, released, then removed, so an interrupt at any point leaves it
    queued and the next call finishes the job (a holder's release is exactly-once)."""
    if not (_dead or _retry or _pollers):
        return
    with _collect_lock:
        _drain_locked()
        for _ in range(len(_retry)):
            holder = _retry[0]
            del _retry[0]
            try:
                holder.release()
            except Exception:
                _retry.append(holder)
        i = 0
        while i < len(_pollers):
            try:
                done = _pollers[i].poll()
            except Exception:
                done = False
            if done:
                del _pollers[i]
            else:
                i += 1
        _drain_locked()  # what the pollers and the releases above let go


def _drain_locked() -> None:
    while _dead:
        token = _dead[0]
        holder = _registry.get(token)
        if holder is not None:
            try:
                holder.release()
            except Exception:  # e.g. the device context could not be made current: later
                _retry.append(holder)
            if token in _registry:
                del _registry[token]
        del _dead[0]


def quiesce() -> None:
    """Release everything dropped so far, here and now (for exact accounting: counters, memory
    figures, empty_cache)."""
    collect()


def while_releases_wait(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with no release running meanwhile (a device reset frees what a release
    would free)."""
    with _collect_lock:
        return fn()


def release_where(predicate: Callable[[Holder], bool]) -> list[BaseException]:
    """Release now every tracked holder for which ``predicate`` is true (a device closing
    releases what it owns). Returns the errors, the caller decides what to raise."""
    errors: list[BaseException] = []
    with _collect_lock:
        for token, holder in list(_registry.items()):
            if predicate(holder):
                try:
                    holder.release()
                except Exception as exc:
                    errors.append(exc)
                if token in _registry:
                    del _registry[token]
        for holder in [h for h in _retry if predicate(h)]:
            _retry.remove(holder)
            try:
                holder.release()
            except Exception as exc:
                errors.append(exc)
    return errors


# ---------------------------------------------------------------------------- weak registries

_K = TypeVar("_K")
_V = TypeVar("_V")


class WeakMap(Generic[_K, _V]):
    """A map from objects, held weakly, to values: a registry the binding walks (a stream's
    launchers, every plan, a pool's blocks) that must not keep its members alive.

    Unlike weakref's WeakSet and WeakKeyDictionary it runs no Python code when a member dies:
    its references have no callback (CPython swallows an exception raised in one, so a
    KeyboardInterrupt landing there was lost, and the entry left half removed). Dead entries are
    dropped as the map grows and skipped when it is read. Each method is one dict operation
    under the GIL, or works on a copy."""

    __slots__ = ("_refs", "_limit")

    def __init__(self) -> None:
        self._refs: dict[weakref.ref[Any], _V] = {}
        self._limit = 16

    def set(self, key: _K, value: _V) -> None:
        # A reference without a callback is shared by every caller, and hashes as its object
        # (computed now, while it lives, and kept once it is dead).
        self._refs[weakref.ref(key)] = value
        if len(self._refs) > self._limit:
            dead = [r for r in list(self._refs) if r() is None]
            for r in dead:
                self._refs.pop(r, None)
            self._limit = max(16, 2 * len(self._refs))

    def add(self, key: _K) -> None:
        self.set(key, None)  # type: ignore[arg-type]

    def get(self, key: _K) -> _V | None:
        return self._refs.get(weakref.ref(key))

    def keys(self) -> list[_K]:
        """The live members, a copy."""
        return [k for r in list(self._refs) if (k := r()) is not None]

    def __iter__(self) -> Iterator[_K]:
        return iter(self.keys())


# ---------------------------------------------------------------------------- stream order

_NOTHING: list[Any] = []  # what most enqueues free (never appended to)


class Ledger:
    """What queued work on one stream still uses, kept until that work is known complete.

    Points count, in order, the stream's *held enqueues* (copies and launches that hold
    something) and *retire points* (objects handed over to be released once everything queued
    before is done). A hold taken for point p is dropped once point p is known complete: when a
    synchronize that read the count at or after p returns, or when a fence recorded at or after
    p has run. Launches that hold nothing here (a plan's steady state keeps its own arrays) need
    no point: whatever they use is retired with a point taken after them.

    Every method is called with the stream's lock held; the lists they return (what became
    free) must be dropped after the lock is released, since dropping the last reference to an
    object may release its memory.
    """

    # A fence every so many points: enough to bound what is held by what is truly outstanding,
    # rare enough to cost nothing per launch (two foreign calls per FENCE_EVERY points).
    FENCE_EVERY = 32
    # Beyond this many fences still pending, no new one: the oldest must finish first.
    MAX_FENCES = 16

    __slots__ = ("context", "stream", "count", "completed", "holds", "fences", "spare", "next_fence")

    def __init__(self, context: acl.Context, stream: acl.StreamHandle | None) -> None:
        self.context = context
        self.stream = stream
        self.count = 0  # points given out
        self.completed = 0  # every point <= completed is known complete
        # (point, what...) in point order: what a hold keeps is everything after the point
        self.holds: collections.deque[tuple[Any, ...]] = collections.deque()
        self.fences: collections.deque[tuple[int, acl.EventHandle]] = collections.deque()
        self.spare: list[acl.EventHandle] = []  # completed fence events, for reuse
        self.next_fence = self.FENCE_EVERY  # the count at which after_enqueue fences next

    def hold(self, what: Any) -> None:
        """Keep ``what`` until the enqueue about to be made is complete (call before it)."""
        self.count += 1
        self.holds.append((self.count, what))

    def retire(self, what: Any, counted_only: bool = False) -> list[Any]:
        """Keep ``what`` until everything queued on the stream so far is complete; fences
        right away so that it goes without waiting for more work. With ``counted_only`` (only
        held enqueues used it) and every point known complete, it goes at once."""
        if counted_only and self.completed >= self.count:
            return [what]
        self.count += 1
        self.holds.append((self.count, what))
        self.fence()
        return self.poll()

    def after_enqueue(self) -> list[Any]:
        """Called after each held enqueue: fence every FENCE_EVERY points, and drop what the
        fences show complete."""
        if self.count < self.next_fence:
            return _NOTHING
        self.fence()
        self.next_fence = self.count + self.FENCE_EVERY  # even when no fence could be recorded
        return self.poll()

    def fence(self) -> None:
        """Record an event behind everything queued so far (a failure is not the caller's:
        what is held then waits for the next fence or synchronize)."""
        if not self.holds or len(self.fences) >= self.MAX_FENCES or (self.fences and self.fences[-1][0] == self.count):
            return
        try:
            spare = self.spare
            if not spare:
                h = acl.EventHandle(self.context)
                spare.append(h)  # owned before it is created
                acl.create_event(h)
            h = spare[-1]
            if not h:  # a creation that failed earlier
                del spare[-1]
                return
            acl.record_event(h, self.stream)
            entry = (self.count, h)
            del spare[-1]
            self.fences.append(entry)
        except Exception:
            return

    def poll(self) -> list[Any]:
        """Drop what the completed fences release (never waits)."""
        fences = self.fences
        try:
            while fences:
                point, h = fences[0]
                if not acl.query_event(h):
                    break
                del fences[0]
                self.spare.append(h)
                if point > self.completed:
                    self.completed = point
        except Exception:
            pass
        return self._advance()

    def synchronized(self, mark: int) -> list[Any]:
        """A synchronize that read ``mark`` (the count) before waiting has returned: every
        point up to it is complete. The fence events stay spare for the next fences (a loop
        that synchronizes every step would otherwise create and destroy them every step);
        empty_cache() and closing the stream destroy them."""
        if mark > self.completed:
            self.completed = mark
        fences = self.fences
        while fences and fences[0][0] <= mark:
            h = fences[0][1]
            del fences[0]
            self.spare.append(h)
        return self._advance()

    def _advance(self) -> list[Any]:
        done: list[Any] = []
        holds = self.holds
        c = self.completed
        while holds and holds[0][0] <= c:
            done.append(holds[0])
            del holds[0]
        return done

    def pending(self) -> bool:
        return bool(self.holds)

    def release_all(self) -> list[Any]:
        """The stream has run everything (it was synchronized, or its device): drop it all."""
        self.completed = self.count
        while self.fences:
            h = self.fences[0][1]
            del self.fences[0]
            self.spare.append(h)
        done = self._advance()
        self.drop_events()
        return done

    def drop_events(self) -> None:
        """Destroy the spare fence events (they are only a cache)."""
        spare = self.spare
        while spare:
            h = spare[-1]
            try:
                h.release()
            except Exception:
                pass
            del spare[-1]


# ---------------------------------------------------------------------------- fork

def _after_fork_in_child() -> None:
    # Parent threads do not exist here and may have held the lock.
    global _collect_lock
    _collect_lock = threading.Lock()
    _pollers.clear()
    _retry.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
