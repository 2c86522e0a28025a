"""Streams and events.

A :class:`Stream` runs its tasks in order, asynchronously to the host. Everything the binding
queues on a stream goes through its :class:`StreamState`, under the stream's lock, and what a
task uses is *held* there until a point of the stream is known complete: when a synchronize
that began after it returns, or when a *fence* recorded behind it has run (an event recorded
every ``FENCE_EVERY`` held tasks and at each hand-over, polled with aclrtQueryEventStatus,
never waited for). Blocks, workspaces and arrays all go back that one way.

Host reads wait for the memory's last writer stream (``Allocation.writer``); ordering between
streams on the device is the caller's, through events, as in CUDA:
``consumer.wait_event(producer.record())``. A wait that learns of a device fault makes the
device faulted (:meth:`~pyacl_moe.device.Device.learn`).

``with stream:`` makes the stream the calling thread's current stream on its device (and the
device current); it closes nothing. Closing a stream waits for it; a stream dropped without
``close()`` is destroyed at a later safe point, once its work has run.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Sequence
from typing import Any

from . import _args
from ._cann import acl
from ._cann.errcheck import check
from .device import (
    EVENTS,
    NOT_YET,
    STREAMS,
    Allocation,
    Device,
    Holder,
    Owner,
    calling,
    collect,
    is_fault,
    resolve_device,
)
from .errors import AclError, ClosedError, InvalidArgument

__all__ = ["Event", "Stream", "StreamState", "current_stream", "resolve_stream", "thread_current"]


class _Current(threading.local):
    """The calling thread's current stream (set by ``with stream:``) and the ones it replaced."""

    stream: Stream | None = None

    def __init__(self) -> None:
        self.saved: list[Stream | None] = []


thread_current = _Current()
Calls = Sequence[tuple[Any, tuple[Any, ...]]]  # (fn, args): queued as fn(*args, stream handle)


class StreamState:
    """A stream's internals, shared by the :class:`Stream` the user holds and by whatever queues
    work on it. It is the device's holder for the stream (released when the Stream is gone and
    its work has run, or when the device closes).

    ``lock`` guards every field below but ``device``, ``ctx``, ``handle``, ``arg`` and
    ``wait_lock``: the points, holds and fences, ``closing``, ``workspace`` (with ``ws_arg``
    and ``ws_size``), ``executors`` (the one call's cached executors, by memo entry) and
    ``after_events``. ``wait_lock`` is held across every CANN wait on
    the stream and across its destroy, so the destroy waits for a wait in progress; a query and
    every enqueue run under ``lock``.
    """

    __slots__ = ("device", "ctx", "handle", "arg", "lock", "wait_lock", "point", "done", "holds", "fences", "spare",
                 "events", "next_fence", "closing", "workspace", "ws_arg", "ws_size", "executors",
                 "after_events", "owner", "__weakref__")
    RANK = STREAMS
    API = "aclrtDestroyStream"
    # A fence every so many held tasks bounds what is held by what is truly outstanding, at two
    # foreign calls per FENCE_EVERY tasks; at most MAX_FENCES pending at once.
    FENCE_EVERY = 32
    MAX_FENCES = 16

    def __init__(self, device: Device, handle: acl.StreamHandle | None, owner: Any = None) -> None:
        self.device, self.ctx, self.handle, self.owner = device, device.context, handle, owner
        self.arg = acl.raw(handle)  # what a second phase is passed for the stream (set once it exists)
        self.lock, self.wait_lock = threading.Lock(), threading.Lock()
        self.point = self.done = 0  # held tasks queued so far; every one <= done is known complete
        self.holds: collections.deque[tuple[int, Any]] = collections.deque()  # (point, what), in order
        self.fences: collections.deque[tuple[int, acl.EventHandle]] = collections.deque()
        self.spare: list[acl.EventHandle] = []  # fence events that ran, for reuse
        self.events: list[acl.EventHandle] = []  # every fence event made: destroyed with the stream
        self.next_fence = self.FENCE_EVERY
        self.closing = False  # no new work
        self.workspace: Allocation | None = None  # the stream's block for its launches' workspace
        self.ws_arg, self.ws_size = acl.void(0), 0  # its address as a second phase is passed it; its bytes
        self.executors: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self.after_events = False  # it waited on another stream's event: a read waits for the device

    def check_open(self) -> None:
        if self.closing or not self.ctx.open:
            raise ClosedError("stream", "it was closed" if self.ctx.open else
                              f"its device {self.device.device_id} was closed or reset"
                              + (" (or this is a fork() child)" if acl.forked() else ""))

    def check_usable(self) -> None:
        """check_open under the lock, or before it once the device is closed (in a fork()
        child a parent thread may hold it)."""
        if not self.ctx.open:
            self.check_open()
        with self.lock:
            self.check_open()

    def __repr__(self) -> str:
        return "the default stream" if self.handle is None else f"stream {self.handle.address:#x}"

    # -- queuing, holding (lock held unless said)

    def enqueue(self, hold: Any, calls: Calls, writes: Sequence[Allocation | None] = ()) -> None:
        """Queue each ``fn(*args, stream handle)`` of ``calls`` under one taking of the lock (no
        lock held), keeping ``hold`` until they have run; ``writes``: the memory they write.
        The hold is taken before the calls, so an interrupt leaves it held, never freed."""
        self.device.check()  # (before the lock: in a fork() child a parent thread may hold it)
        with self.lock:
            self.check_open()
            acl.use_context(self.ctx)
            self.hold(hold)
            written(writes, self)
            _queue(calls, self.handle)
            # What the fences show done is dropped at the return, outside the lock: dropping the last
            # reference to memory gives its block back.
            done = self.fenced()  # noqa: F841

    def hold(self, what: Any) -> None:
        """Keep ``what`` until the task about to be queued has run."""
        self.point += 1
        self.holds.append((self.point, what))

    def live(self) -> bool:
        """Not destroyed, its device not reset: work queued on it may still run."""
        return (self.handle is None or bool(self.handle)) and self.ctx.alive

    def keep(self, what: Any) -> list[Any]:
        """Keep ``what`` until everything queued so far has run (a fence right behind it, so it
        goes without waiting for more work); nothing to keep on a stream that was destroyed or
        whose device was reset. What became free, to drop after the lock."""
        if not self.live():
            return _NOTHING
        self.hold(what)
        return self.fence()

    def fenced(self) -> list[Any]:
        """After a held task: a fence every FENCE_EVERY points, and what the fences show done."""
        if self.point < self.next_fence:
            return _NOTHING
        self.next_fence = self.point + self.FENCE_EVERY
        return self.fence()

    def fence(self) -> list[Any]:
        """Record an event behind everything queued so far (one that cannot be recorded leaves
        what is held to the next fence or wait); then poll."""
        if self.holds and len(self.fences) < self.MAX_FENCES and (not self.fences or self.fences[-1][0] < self.point):
            with contextlib.suppress(AclError):
                acl.use_context(self.ctx)
                if not self.spare:
                    self.events.append(acl.EventHandle(self.ctx))  # owned before it exists
                    acl.create_event(self.events[-1])
                    self.spare.append(self.events[-1])
                acl.record_event(self.spare[-1], self.handle)
                self.fences.append((self.point, self.spare.pop()))
        return self.poll()

    def poll(self) -> list[Any]:
        """What the fences that ran release (never waits)."""
        return self._advance(self.done, True)

    def _advance(self, mark: int, ask: bool = False) -> list[Any]:
        """What the work up to ``mark`` held. The fences behind it are taken back, and so, with
        ``ask``, is each next one CANN says ran (a query that fails ends that walk)."""
        self.done = max(self.done, mark)
        with contextlib.suppress(AclError):
            if ask and self.fences:
                acl.use_context(self.ctx)
            while self.fences and (self.fences[0][0] <= self.done or ask and acl.query_event(self.fences[0][1])):
                self.done = max(self.done, self.fences[0][0])
                self.spare.append(self.fences.popleft()[1])
        out = []
        while self.holds and self.holds[0][0] <= self.done:
            out.append(self.holds.popleft())
        return out

    def mark(self) -> int:
        """The point a wait beginning now covers (no lock held)."""
        with self.lock:
            return self.point

    def completed(self, mark: int) -> None:
        """A wait that read ``mark`` returned clean: what the work up to it held goes."""
        with self.lock:
            # (what it held goes at the return, outside the lock)
            done = self._advance(mark)  # noqa: F841

    # -- waiting

    def synchronize(self, timeout_ms: int | None = None, closing: bool = False) -> bool:
        """aclrtSynchronizeStream(WithTimeout), under ``wait_lock``. A fault it is told of makes
        the device faulted; True when this wait learned it first. Other errors (a timeout) are
        raised. With ``closing``, a stream that refuses new work is waited for too."""
        with self.wait_lock:
            with self.lock:
                if not closing or not self.ctx.open:
                    self.check_open()
                if self.handle is not None and not self.handle:
                    return False  # destroyed: it ran everything
                mark = self.point
            try:
                acl.use_context(self.ctx)
                acl.synchronize_stream(self.handle, timeout_ms)
            except AclError as exc:
                if not is_fault(exc):
                    raise
                return self.device.learn(exc, f"a synchronize of {self!r}")
        if self.device.sync_lock.locked():  # a device-wide wait may have been told of this stream's fault:
            with self.device.sync_lock:  # it has recorded it once it lets go
                pass
        self.completed(mark)
        return False

    # -- workspace and caches

    def ensure_workspace(self, nbytes: int) -> None:
        """A workspace of at least ``nbytes`` (no lock held): the stream's block, grown here.
        The block it replaces is homed here: this stream's later work runs after what used it."""
        if self.workspace_size() >= nbytes:
            return
        ws = self.device.allocate((nbytes,), self, counts="workspace_takes")[0]
        with self.lock:
            self.check_open()
            if self.ws_size < nbytes:  # (else another thread got there first)
                old, self.workspace, self.ws_arg, self.ws_size = self.workspace, ws, acl.void(ws.ptr), ws.nbytes
        # (the block it replaced, or the one it did not take, goes back at the return: outside the lock)

    def _drop_workspace(self) -> Allocation | None:
        # (lock held) No workspace from now on; the one it had.
        old, self.workspace, self.ws_arg, self.ws_size = self.workspace, None, acl.void(0), 0
        return old

    def workspace_size(self) -> int:
        with self.lock:
            return self.ws_size

    def reclaim(self, empty: bool = False) -> None:
        """Out of memory: what completed work held, and the workspace of a stream with nothing
        queued; with ``empty`` (empty_cache), the cached executors and the workspace whatever is
        queued, freed once the work queued so far has run, by a later empty_cache (a stream
        that was closed is asked too)."""
        if not self.ctx.open:
            return
        with self.lock:
            idle = (self.live() if empty else not self.closing) and _idle(self)
            # (what completed work held and the workspace go at the return, outside the lock)
            done = self._advance(self.point) if idle else self.poll()  # noqa: F841
            cached, ws = self._uncache(True) if empty else (_NOTHING, self._drop_workspace() if idle else None)
        for entry in cached:  # (launches already queued captured what they need)
            entry.destroy()

    def _uncache(self, events: bool) -> tuple[list[Any], Allocation | None]:
        # (lock held; a loop under a lock is a function of its own) Give up the cached executors
        # (to destroy after the lock), the workspace (to drop after it) and, with ``events``,
        # the fence events not pending: destroyed (they are only a cache); what is left is what
        # CANN refused. Pending is what the fences hold, not what the spares lack: an interrupt
        # between a fence's pop and its return to the spares (or between an event's creation and
        # its first use) leaves one in neither.
        if events:
            pending = {id(h) for _, h in self.fences}
            self.events = [h for h in self.events if id(h) in pending or h.release()]
        cached, self.executors, self.spare = list(self.executors.values()), collections.OrderedDict(), []
        return cached, self._drop_workspace()

    # -- release

    def shut(self) -> None:
        """Refuse new work (launches in progress end first: they hold the lock)."""
        with self.lock:
            self.closing = True

    def release(self) -> int:
        """The stream, refusing new work (shut, or dropped), has run everything (its close
        waited, or its device's): destroy it, after any wait in progress, and drop what it
        held. Safe again."""
        with self.wait_lock, self.lock:
            # Every fence too (none is pending); what it held goes at the return, outside the lock.
            done = self._advance(self.point)  # noqa: F841
            status = self.handle.release() if self.handle is not None else 0
            cached, ws = self._uncache(not status)  # (a stream CANN refused to destroy keeps its events)
        for entry in cached:  # (launches already queued captured what they need)
            entry.destroy()
        return status

    def dropped(self) -> int:
        """The Stream is gone (a safe point): destroyed once its work has run, never waited for
        (a query that fails is a status: asked again at a later safe point). A fault CANN keeps
        for it is learned first: its destroy would drop it (docs/emulator.md, aclrtDestroyStream)."""
        try:
            with self.lock:
                self.closing = True
                idle = not self.live() or _idle(self)
            if not idle:
                return NOT_YET
            if self.ctx.open:  # (else the device's teardown waits for it)
                self.synchronize(closing=True)  # (it ran everything: this returns at once)
        except AclError as exc:
            return exc.status
        except ClosedError:  # (its device closes meanwhile: the teardown releases it)
            return NOT_YET
        return self.release()


_NOTHING: list[Any] = []  # what most enqueues free (never appended to)


def written(allocs: Sequence[Allocation | None], state: StreamState) -> None:
    """Queued work on ``state`` writes ``allocs`` (the stream's lock held; a loop under a lock
    is a function of its own: ARCHITECTURE.md)."""
    for a in allocs:
        if a is not None:
            a.writer = state


def _queue(calls: Calls, handle: Any) -> None:
    # (the stream's lock held; a loop under a lock is a function of its own: ARCHITECTURE.md)
    for fn, args in calls:
        fn(*args, handle)


def _idle(state: StreamState) -> bool:
    acl.use_context(state.ctx)
    return acl.query_stream(state.handle)


def _create(device: Device, holder: Any, owner: Any, create: Any) -> None:
    """Make a stream's or an event's CANN object, ``create(holder.handle)``, owned before it
    exists (released once ``owner`` is gone), after a safe point."""
    collect()
    device.own(holder, owner)
    with calling(device, holder.handle.context):  # (the context it is made in: the device's may be a reset's since)
        acl.use_context(holder.handle.context)
        create(holder.handle)


class Stream:
    """A CANN stream: tasks on it run in order, asynchronously to the host.

    ``Stream(device)`` creates one (aclrtCreateStream); ``Device.default_stream`` is the
    device's default stream. ``with stream:`` makes it the thread's current stream (and its
    device the current device) until the block ends; it closes nothing. ``close()`` waits for
    the stream and destroys it; it is safe twice. Any thread may use a stream; closing one that
    another thread is using makes that thread's call complete or raise ClosedError.
    """

    __slots__ = ("state", "__weakref__")
    state: StreamState  #: the stream's internals, for pyacl_moe's own layers

    def __init__(self, device: Device | int | None = None) -> None:
        dev = resolve_device(device)
        self.state = s = StreamState(dev, acl.StreamHandle(dev.context))
        _create(dev, s, self, acl.create_stream)
        s.arg = acl.raw(s.handle)  # (one store before the stream is anyone else's: read without a lock)

    @classmethod
    def from_handle(cls, handle: Any, device: Device | int | None = None, owner: Any = None) -> Stream:
        """Wrap an aclrtStream created elsewhere (e.g. ``torch_npu.npu.current_stream().npu_stream``)
        to queue pyacl_moe's work on it. The stream is borrowed: ``close()`` waits for it but
        never destroys it, nor does anything else here; ``owner`` (the object the handle comes
        from) is kept alive while pyacl_moe may still use the handle. ``handle`` is an integer
        address on ``device`` (default: the current device); 0 is CANN's default stream."""
        address = _args.integer("handle", handle, 0, 2**64 - 1)
        dev = resolve_device(device)
        if address == 0:
            return dev.default_stream  # type: ignore[no-any-return]
        collect()
        return cls.default(dev, acl.BorrowedStreamHandle(dev.context, address), owner)

    @classmethod
    def default(cls, device: Device, handle: acl.BorrowedStreamHandle | None = None, owner: Any = None) -> Stream:
        """The default stream of a device being opened (Device calls it); with ``handle``, a
        borrowed stream (:meth:`from_handle`)."""
        s = cls.__new__(cls)
        s.state = state = StreamState(device, handle, owner)
        # A default stream (no handle: CANN's NULL stream) lives as long as its device: no owner.
        device.own(state, None if handle is None else s)
        return s

    @property
    def device(self) -> Device:
        """The device the stream belongs to."""
        return self.state.device

    @property
    def handle(self) -> int:
        """The aclrtStream as an integer (0 for a default stream: CANN's NULL stream).
        ClosedError once the stream or its device was closed, as a handle CANN no longer knows
        would be."""
        self.state.check_usable()
        return self.state.handle.address if self.state.handle is not None else 0

    @property
    def is_default(self) -> bool:
        """True for a device's default stream."""
        return self.state.handle is None

    @property
    def closed(self) -> bool:
        """True once closed, or once its device was closed."""
        s = self.state
        if not s.ctx.open:
            return True  # (before the lock: in a fork() child a parent thread may hold it)
        with s.lock:
            return s.closing

    def __repr__(self) -> str:
        kind = "default stream" if self.state.handle is None else f"stream {self.state.handle.address:#x}"
        return f"<Stream {kind} on device {self.device.device_id}{' closed' if self.closed else ''}>"

    def synchronize(self, timeout_ms: int | None = None) -> None:
        """Block until every task queued on the stream has run. ``timeout_ms``: -1 (no limit)
        or a positive number of ms; CANN refuses 0 (107000). Raises the device's fault
        (AclRuntimeError, e.g. 507015) if this or any earlier wait learned of one, or a
        timeout (507046)."""
        if timeout_ms is not None:
            timeout_ms = _args.int32("timeout_ms", timeout_ms, lo=-1)
        s = self.state
        s.device.check()
        collect()
        s.synchronize(timeout_ms)
        s.device.check()

    def query(self) -> bool:
        """True when every task queued on the stream has run (aclrtStreamQuery); never waits
        and never reports a fault; what completed work held goes."""
        s = self.state
        s.device.check_open()
        with s.lock:
            s.check_open()
            idle = _idle(s)
            # (what completed work held goes at the return, outside the lock)
            done = s._advance(s.point) if idle else s.poll()  # noqa: F841
        return idle

    def wait_event(self, event: Event) -> None:
        """Make later tasks on this stream wait until ``event`` completes (aclrtStreamWaitEvent).
        ``event`` must have been recorded: CANN refuses a wait on an event never recorded
        (AclRuntimeError 107000)."""
        core = _args.instance("event", event, Event, "an Event").core()
        s = self.state
        if core.device is not s.device:
            raise InvalidArgument("event", f"is on device {core.device.device_id}, the stream on {s.device.device_id}")
        s.enqueue(core, [(acl.stream_wait_event, (core.holder.handle,))])
        with s.lock:
            s.after_events = True  # (only ever set: read without the lock, ARCHITECTURE.md)

    def record(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one if None) on this stream and return it."""
        ev = Event(self.state.device) if event is None else _args.instance("event", event, Event, "an Event or None")
        return ev.record(self)

    def close(self) -> None:
        """Wait for the stream, then destroy it (a borrowed one is only waited for). Safe twice.
        Refused on a default stream (InvalidArgument): CANN's NULL stream lives as long as its
        device. Raises a device fault its own wait learned of, after releasing the stream."""
        s = self.state
        if s.handle is None:
            raise InvalidArgument("stream", "is the device's default stream, which lives as long as the device: "
                                            "synchronize() waits for it, Device.close() releases it")
        if not s.ctx.open:
            return  # (a closed device's close released it)
        s.shut()
        learned = s.synchronize(closing=True)
        check(s.device.release(s), "aclrtDestroyStream")
        collect()
        if learned:
            raise s.device.fault_error()

    def __enter__(self) -> Stream:
        self.state.check_usable()
        self.state.device.__enter__()
        thread_current.saved.append(thread_current.stream)
        thread_current.stream = self
        return self

    def __exit__(self, *exc: object) -> None:
        thread_current.stream = thread_current.saved.pop()
        self.state.device.__exit__()


Device.stream_class = Stream


def current_stream(device: Device | int | None = None) -> Stream:
    """The stream calls without ``stream=`` use on ``device`` (default: the current device):
    the one a ``with stream:`` block made current on this thread, else the device's default
    stream."""
    dev = resolve_device(device)
    s = thread_current.stream
    return s if s is not None and s.state.device is dev else dev.default_stream


def resolve_stream(stream: Stream | None, device: Device) -> StreamState:
    """The state of ``stream`` (if None, the thread's current stream on ``device``), checked
    open and on ``device``."""
    if stream is None:
        return current_stream(device).state
    state = _args.instance("stream", stream, Stream, "a Stream or None").state
    state.check_usable()  # (closing is read under the lock)
    if state.device is not device:
        raise InvalidArgument("stream", f"is on device {state.device.device_id}, the arrays on {device.device_id}")
    return state


class _EventCore:
    """What an Event and the queued work that records or waits on it hold: the event is
    destroyed once all of them are gone. Calls on the handle take the holder's lock."""

    __slots__ = ("device", "holder", "recorded", "__weakref__")

    def __init__(self, device: Device) -> None:
        self.device = device
        self.holder = Holder(acl.EventHandle(device.context), EVENTS)
        self.recorded = False  # a record was queued: only ever set, under the holder's lock


class Event(Owner):
    """A CANN event: a marker recorded on a stream, for ordering and timing. ``close()``
    destroys it, at once unless queued work still records or waits on it. CANN tells neither
    its synchronize nor its query of a device fault (a stream's synchronize learns it); its
    synchronize raises the fault of a device that is faulted."""

    __slots__ = ("_core", "_device", "__weakref__")

    def __init__(self, device: Device | int | None = None) -> None:
        dev = resolve_device(device)
        core = _EventCore(dev)
        _create(dev, core.holder, core, acl.create_event)
        self._device = dev
        self._core: _EventCore | None = core

    def core(self, what: str = "event") -> _EventCore:
        """The event's core, checked open (for pyacl_moe's own layers)."""
        c = self._core
        if c is None or not c.holder.handle.context.open:  # type: ignore[union-attr]
            raise ClosedError(what, "it was closed" if c is None else f"its device {c.device.device_id} was "
                                                                     "closed or reset")
        return c

    def _call(self, fn: Any, *args: Any) -> Any:
        """``fn(handle, *args)`` under the holder's lock (a release waits for it)."""
        core = self.core()
        with core.holder.lock:
            if not core.holder.handle:
                raise ClosedError("event", f"its device {core.device.device_id} was closed")
            acl.use_context(core.device.context)
            return fn(core.holder.handle, *args)

    @property
    def device(self) -> Device:
        """The device the event belongs to."""
        return self._device

    @property
    def closed(self) -> bool:
        """True once closed, or once its device was closed."""
        c = self._core
        return c is None or not c.holder.handle.context.open  # type: ignore[union-attr]

    def __repr__(self) -> str:
        return f"<Event {self.handle:#x} on device {self._device.device_id}{' closed' if self.closed else ''}>"

    def record(self, stream: Stream | None = None) -> Event:
        """Record the event on ``stream`` (default: the thread's current stream)."""
        core = self.core()
        state = resolve_stream(stream, core.device)
        with core.holder.lock:  # (the lock order: an event's holder, then a stream's)
            state.enqueue(core, [(acl.record_event, (core.holder.handle,))])
            core.recorded = True
        return self

    def synchronize(self) -> None:
        """Block until the work recorded before the event has run (at once for an event never
        recorded). It learns of no device fault (CANN reports one to a stream's or the device's
        synchronize), but raises the device's fault if it is faulted."""
        self._device.check()
        self._call(acl.synchronize_event)
        self._device.check()

    def query(self) -> bool:
        """True when the work recorded before the event has run (aclrtQueryEventStatus); an
        event never recorded is not complete (CANN reports NOT_READY for it). Never waits."""
        return bool(self._call(acl.query_event))

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to ``end`` (both recorded and complete: 507000 when one
        was never recorded, 107006 while one has not completed; negative if ``end`` completed
        first)."""
        other = _args.instance("end", end, Event, "an Event").core("end")
        for name, core in (("event", self.core()), ("end", other)):
            if not core.recorded:
                raise InvalidArgument(name, "was never recorded: record() it on a stream first (CANN times only "
                                            "recorded events)")
        return float(self._call(acl.event_elapsed_ms, other.holder.handle))

    def __sub__(self, start: Event) -> float:
        """``end - start``: milliseconds between two completed events."""
        return _args.instance("start", start, Event, "an Event").elapsed_ms(self)
