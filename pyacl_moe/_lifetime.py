"""The one lifetime model: who owns a CANN handle, how queued work keeps what it uses, and
where releases happen.

**Owners.** Every CANN object the binding makes has one owner with ``close()``, and a small
*holder* with what its release needs (a handle of the bindings layer). :func:`track` ties the
two with a weak reference whose callback is ``deque.append``: when an owner dies without
``close()``, its token is queued (no Python code runs in the collector), and :func:`collect`,
the *safe point* every entry of the binding that allocates, synchronizes or closes calls,
releases it on the caller's thread, never inside a finalizer.

**Queued work** keeps what it reads or writes on its stream's :class:`Ledger` until that work is
known complete: by a synchronize that began after it was queued, or by a *fence*, an event
recorded behind it and polled (aclrtQueryEventStatus), never waited for.

**Interrupts.** A KeyboardInterrupt never frees what queued work uses (a hold is taken before
its work is queued) and never loses memory for good: a release it cuts short stays registered,
so the next safe point, ``empty_cache()`` or ``close()`` releases it. A handle is released once
(its lock: :mod:`._cann.handles`).

**fork().** In a child of a process that initialized CANN, everything inherited is dead: the
handles refuse to release and the locks here are new ones (a parent thread may have held the
old ones at fork).
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from ._cann import acl
from ._cann.errcheck import check
from ._cann.handles import process_forked

__all__ = ["Holder", "Ledger", "Owner", "WeakMap", "close_core", "collect", "forked", "holders", "release",
           "release_where", "retiring", "track", "unreleased_while"]


class Holder(Protocol):
    def release(self) -> int: ...


# Tokens of owners that died, appended by the garbage collector (the callback is the deque's
# own append: documented thread-safe, it runs no Python code).
_dead: collections.deque[weakref.ref[Any]] = collections.deque()
_lock = threading.Lock()  # guards _registry and _later (held briefly, never across a CANN call)
_registry: dict[weakref.ref[Any], Holder] = {}  # token -> holder, for every owner not yet released
_later: list[Any] = []  # what finishes releasing later without blocking: poll() -> True once done
_collecting = threading.Lock()  # one collector (or device close) releasing at a time


def forked() -> bool:
    """Whether this process is a fork() child of one that initialized CANN."""
    return process_forked()


def track(owner: Any, holder: Holder) -> weakref.ref[Any]:
    """Release ``holder`` when ``owner`` dies (at the next safe point). Returns the token for
    :func:`release`. Call it before the C call that fills the holder."""
    token = weakref.ref(owner, _dead.append)
    with _lock:
        _registry[token] = holder
    return token


def release(token: weakref.ref[Any]) -> int:
    """Release the holder of ``token`` now (an explicit close); returns CANN's status. Safe
    twice and from several threads."""
    with _lock:
        holder = _registry.get(token)
    if holder is None:
        return 0
    status = holder.release()
    with _lock:
        _registry.pop(token, None)
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
    with _lock:
        _later.append(poller)


def collect() -> None:
    """The safe point: release what died, on the calling thread; poll what is retiring. Never
    waits for queued work; never called with a stream's lock held. A token leaves the queue
    only after its release returned, so a release an interrupt cut short is made again."""
    if not (_dead or _later) or forked():
        return
    with _collecting:
        _collect_and_poll()


def _collect_and_poll() -> None:
    # (_collecting held; a loop under a lock is a function of its own: ARCHITECTURE.md)
    _collect_dead()
    if not _later:  # (read without the lock: one appended meanwhile waits for the next safe point)
        return
    with _lock:
        later = list(_later)
    for poller in later:
        try:
            done = poller.poll()
        except Exception:
            done = False
        if done:
            with _lock:
                _later.remove(poller)
    _collect_dead()  # what the finished pollers held


def _collect_dead() -> None:
    while _dead:
        token = _dead[0]
        with _lock:
            holder = _registry.get(token)
        if holder is not None:
            try:
                holder.release()
            except Exception:
                pass  # it stays registered: the device's close releases it (release_where)
            else:
                with _lock:
                    _registry.pop(token, None)
        _dead.popleft()


def holders(kind: type) -> list[Any]:
    """The registered holders of ``kind`` (released or not yet: what may still hold a handle)."""
    with _lock:
        registered = list(_registry.values())
    return [h for h in registered if isinstance(h, kind)]


def unreleased_while(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with no release running meanwhile (a device reset frees what a release
    would free)."""
    with _collecting:
        return fn()


def release_where(predicate: Callable[[Holder], bool]) -> list[BaseException]:
    """Release now every tracked holder for which ``predicate`` is true (a device closing
    releases what it owns). Returns the errors; the caller decides what to raise."""
    with _collecting:
        return _release_chosen(predicate)


def _release_chosen(predicate: Callable[[Holder], bool]) -> list[BaseException]:
    # (_collecting held; a loop under a lock is a function of its own: ARCHITECTURE.md)
    errors: list[BaseException] = []
    with _lock:
        registered = list(_registry.items())
    for token, holder in registered:
        if not predicate(holder):
            continue
        try:
            holder.release()
        except Exception as exc:
            errors.append(exc)
        with _lock:
            _registry.pop(token, None)
    return errors


# ---------------------------------------------------------------------------- weak registries

_K = TypeVar("_K")
_V = TypeVar("_V")


class WeakMap(Generic[_K, _V]):
    """A map from objects, held weakly, to values: a registry the binding walks (every plan, a
    device's borrowed memory) that must not keep its members alive. Its references have no
    callback, so nothing runs when a member dies: dead entries are skipped when read and
    dropped as the map grows. ``_lock`` guards ``_refs``."""

    __slots__ = ("_refs", "_limit", "_lock")

    def __init__(self) -> None:
        self._refs: dict[weakref.ref[Any], _V] = {}
        self._limit = 16
        self._lock = threading.Lock()

    def set(self, key: _K, value: _V) -> None:
        with self._lock:
            self._refs[weakref.ref(key)] = value
            if len(self._refs) > self._limit:
                self._prune()

    def _prune(self) -> None:
        # (_lock held; a loop under a lock is a function of its own: ARCHITECTURE.md)
        for r in [r for r in self._refs if r() is None]:
            del self._refs[r]
        self._limit = max(16, 2 * len(self._refs))

    def add(self, key: _K) -> None:
        self.set(key, None)  # type: ignore[arg-type]

    def discard(self, key: _K) -> None:
        with self._lock:
            self._refs.pop(weakref.ref(key), None)

    def get(self, key: _K) -> _V | None:
        with self._lock:
            return self._refs.get(weakref.ref(key))

    def items(self) -> list[tuple[_K, _V]]:
        """The live members and their values, a copy."""
        with self._lock:
            refs = list(self._refs.items())
        return [(k, v) for r, v in refs if (k := r()) is not None]

    def keys(self) -> list[_K]:
        """The live members, a copy."""
        return [k for k, _ in self.items()]

    def after_fork(self) -> None:
        self._lock = threading.Lock()


# ---------------------------------------------------------------------------- stream order

_NOTHING: list[Any] = []  # what most enqueues free (never appended to)


class Ledger:
    """What queued work on one stream still uses, kept until that work is known complete.

    Points count, in order, the stream's *held enqueues* (copies and launches that hold
    something) and *retire points* (objects handed over to be released once everything queued
    before is done). A hold taken for point p is dropped once point p is known complete: when a
    synchronize that read the count at or after p returns, or when a fence recorded at or after
    p has run.

    Every method is called with the stream's lock held; the lists they return (what became
    free) must be dropped after the lock is released, since dropping the last reference to an
    object may release its memory.
    """

    # A fence every so many points: enough to bound what is held by what is truly outstanding,
    # rare enough to cost nothing per launch (two foreign calls per FENCE_EVERY points).
    FENCE_EVERY = 32
    # Beyond this many fences still pending, no new one: the oldest must finish first.
    MAX_FENCES = 16

    __slots__ = ("context", "stream", "count", "completed", "holds", "fences", "spare", "events", "next_fence")

    def __init__(self, context: acl.Context, stream: acl.StreamHandle | None) -> None:
        self.context = context
        self.stream = stream
        self.count = 0  # points given out
        self.completed = 0  # every point <= completed is known complete
        self.holds: collections.deque[tuple[Any, ...]] = collections.deque()  # (point, what...) in order
        self.fences: collections.deque[tuple[int, acl.EventHandle]] = collections.deque()
        self.spare: list[acl.EventHandle] = []  # completed fence events, for reuse
        # Every fence event made and not yet destroyed: one that an interrupt dropped between
        # the lists above is still here, and destroyed with the rest (drop_events).
        self.events: list[acl.EventHandle] = []
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
            if not self.spare:
                h = acl.EventHandle(self.context)
                self.events.append(h)  # owned before it is created
                acl.create_event(h)
                self.spare.append(h)
            h = self.spare.pop()
            if h:  # (not a creation that failed)
                acl.record_event(h, self.stream)
                self.fences.append((self.count, h))
        except Exception:
            return

    def poll(self) -> list[Any]:
        """Drop what the completed fences release (never waits)."""
        try:
            while self.fences:
                point, h = self.fences[0]
                if not acl.query_event(h):
                    break
                self.fences.popleft()
                self.spare.append(h)
                self.completed = max(self.completed, point)
        except Exception:
            pass
        return self._advance()

    def synchronized(self, mark: int) -> list[Any]:
        """A synchronize that read ``mark`` (the count) before waiting has returned: every
        point up to it is complete. The fence events stay spare for the next fences."""
        self.completed = max(self.completed, mark)
        while self.fences and self.fences[0][0] <= mark:
            self.spare.append(self.fences.popleft()[1])
        return self._advance()

    def _advance(self) -> list[Any]:
        done: list[Any] = []
        while self.holds and self.holds[0][0] <= self.completed:
            done.append(self.holds.popleft())
        return done

    def release_all(self) -> list[Any]:
        """The stream has run everything (it was synchronized, or its device): drop it all."""
        self.completed = self.count
        self.fences.clear()
        done = self._advance()
        self.drop_events()
        return done

    def drop_events(self) -> None:
        """Destroy the fence events not pending (they are only a cache). A destroy is once per
        handle, so one an interrupt cut short is made again by the next call."""
        pending = {id(h) for _, h in self.fences}
        self.spare = []
        for h in self.events:
            if id(h) not in pending:
                try:
                    h.release()
                except Exception:
                    pass
        self.events = [h for h in self.events if id(h) in pending]


# ---------------------------------------------------------------------------- fork

def _after_fork_in_child() -> None:
    global _lock, _collecting
    _lock, _collecting = threading.Lock(), threading.Lock()
    _later.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
