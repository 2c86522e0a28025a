"""Streams and events.

A :class:`Stream` runs its tasks in order, asynchronously to the host. Everything the binding
queues on a stream goes through :meth:`StreamState.enqueue`: under the stream's lock, what the
task reads or writes is held on the stream's :class:`~pyacl_moe._lifetime.Ledger`, then the
task is queued. What is held is dropped once the task is known complete (a synchronize that
began after it, or a fence), whichever thread synchronizes and whenever.

Ordering between two different streams is the caller's job, through events, as in CUDA:
``consumer.wait_event(producer.record())``.

``with stream:`` makes the stream the calling thread's current stream on its device (and the
device current), as CuPy's and torch's stream contexts do: calls without ``stream=`` on that
device use it. It closes nothing.

Closing a stream waits for it. A stream dropped without ``close()`` is released without
blocking anyone: once the device reports it idle (aclrtStreamQuery), at a later safe point.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from . import _args, _lifetime
from ._cann import acl
from ._cann.errcheck import check
from .device import Device, resolve_device
from .errors import ClosedError, InvalidArgument

__all__ = ["Event", "Stream", "StreamState", "active_stream", "current_stream"]


class _Current(threading.local):
    """The calling thread's current stream (set by ``with stream:``) and the ones it replaced."""

    stream: Stream | None = None

    def __init__(self) -> None:
        self.saved: list[Stream | None] = []


thread_current = _Current()  # read on every launch of a plan (see op.plan)


class Launcher(Protocol):
    """Something that launches on a stream without taking its lock (a plan's steady state).
    ``detach()`` stops it and returns once its launches in flight have returned."""

    def detach(self) -> None: ...


class StreamState:
    """A stream's internals, shared by the :class:`Stream` that the user holds and by whatever
    still uses the stream (plans bound to it, work held on its ledger).

    ``lock`` guards the ledger, ``caches``, ``closing`` and the launchers: every enqueue and
    every state change takes it; never call :func:`~pyacl_moe._lifetime.collect` while holding
    it. ``caches`` holds per-stream objects of the layers above (the op layer's executors, the
    stream's workspace), each with ``release(idle) -> list``: with ``idle`` the stream has run
    everything; otherwise it returns what must be kept until the stream's queued work is done.
    """

    __slots__ = ("device", "context", "handle", "lock", "ledger", "closing", "closed", "caches", "launchers",
                 "shut_caches", "waiters", "owner", "__weakref__")

    def __init__(self, device: Device, handle: acl.StreamHandle | None) -> None:
        self.device = device
        self.context = device.context
        self.handle = handle  # None: the device's default stream
        self.lock = threading.Lock()
        self.ledger = _lifetime.Ledger(device.context, handle)
        self.closing = False  # no new work (set under lock)
        self.closed = False  # the handle is gone
        self.caches: dict[Any, Any] = {}
        self.shut_caches: dict[Any, Any] = {}  # the caches once shut, until the stream is destroyed
        self.waiters = 0  # threads in synchronize() or query() (the handle in use outside the lock)
        self.launchers: _lifetime.WeakMap[Any, None] = _lifetime.WeakMap()
        self.owner: Any = None  # what keeps a borrowed stream alive (Stream.from_handle)

    # -- use

    def check_open(self, what: str = "stream") -> None:
        if self.closing or self.device.closed:
            raise ClosedError(what, self.closed_reason())

    def closed_reason(self) -> str:
        if self.device.closed:
            return f"its device {self.device.device_id} was closed" + (
                " (or this is a fork() child)" if _lifetime.forked() else "")
        return "it was closed"

    def enqueue(self, hold: Any, call: Callable[..., None], *args: Any) -> None:
        """Queue a task: ``call(*args, stream_handle)`` with ``hold`` kept until it has run.
        The hold is taken before the call (an interrupted call leaves it held, never freed)."""
        with self.lock:
            self.check_open()
            acl.use_context(self.context)
            self.ledger.hold(hold)
            call(*args, self.handle)
            done = self.ledger.after_enqueue()
        del done  # outside the lock: dropping the last reference may free memory
        _lifetime.collect()

    def retire(self, what: Any) -> None:
        """Keep ``what`` until everything queued so far on the stream has run."""
        if _lifetime.forked():
            return  # nothing of CANN runs here, and a parent thread may have held the lock at fork
        with self.lock:
            if self.closed:
                return  # its work has run; dropping is safe
            acl.use_context(self.context)
            done = self.ledger.retire(what)
        del done

    def add_launcher(self, launcher: Launcher) -> None:
        with self.lock:
            self.check_open()
            self.launchers.add(launcher)

    # -- waiting

    def sync_mark(self) -> int:
        with self.lock:
            return self.ledger.count

    def sync_done(self, mark: int) -> None:
        with self.lock:
            done = self.ledger.synchronized(mark)
        del done

    def synchronize(self, timeout_ms: int | None) -> None:
        try:
            # Counted while the handle is in use outside the lock: a close waits for it. The
            # count goes up before the check, and close marks the stream before it reads the
            # count, so either this call sees the stream closing or close waits for it.
            self.waiters += 1
            self.check_open()
            acl.use_context(self.context)
            mark = self.sync_mark()
            acl.synchronize_stream(self.handle, timeout_ms)
        finally:
            self.waiters -= 1
        # Only what was held before the wait began: work queued meanwhile by other threads
        # keeps what it uses.
        self.sync_done(mark)
        _lifetime.collect()

    def query(self) -> bool:
        try:
            self.waiters += 1  # see synchronize
            self.check_open()
            acl.use_context(self.context)
            mark = self.sync_mark()
            idle = acl.query_stream(self.handle)
        finally:
            self.waiters -= 1
        if idle:
            self.sync_done(mark)
        else:
            with self.lock:
                done = self.ledger.poll()
            del done
        return idle

    def poll(self) -> None:
        """Drop what completed fences show done (never waits)."""
        with self.lock:
            done = self.ledger.poll()
        del done

    def drop_caches(self) -> None:
        """Give up the per-stream caches (empty_cache): what they hold goes once the work
        queued so far is done; the spare fence events go now."""
        with self.lock:
            if self.closed:
                return
            caches, self.caches = self.caches, {}
            retired: list[Any] = []
            for cache in caches.values():
                retired += cache.release(False)
            acl.use_context(self.context)
            # Only held enqueues use the caches (a plan's slot keeps its own references).
            done = self.ledger.retire(retired, counted_only=True) if retired else []
            self.ledger.drop_events()
        del done, retired, caches

    # -- release

    def shut(self) -> None:
        """Stop new work and the launchers (waiting for launches in flight). Safe twice."""
        with self.lock:
            self.closing = True
            launchers = self.launchers.keys()
            self.shut_caches.update(self.caches)
            self.caches = {}
        for launcher in launchers:
            launcher.detach()

    def _shut(self) -> dict[Any, Any]:
        """shut(), then the caches, to be released once the stream has run everything."""
        self.shut()
        with self.lock:
            caches, self.shut_caches = self.shut_caches, {}
        return caches

    def _destroy(self, caches: dict[Any, Any]) -> int:
        """The stream has run everything: release its caches and what it held, destroy it
        (once no other thread is still waiting on it)."""
        while self.waiters:
            time.sleep(0.0001)
        for cache in caches.values():
            cache.release(True)
        with self.lock:
            done = self.ledger.release_all()
            self.closed = True
        del done
        return self._finish_destroy()

    def _finish_destroy(self) -> int:
        """The end of _destroy, repeated by whoever finds the stream closed while its device
        is open (an interrupt may have cut _destroy short after it marked the stream closed):
        no longer a queue of the device, and the handle released (a second release does
        nothing)."""
        self.device.remove_queue(self)
        return self.handle.release() if self.handle is not None else 0

    def close(self) -> None:
        """Wait for the stream, then destroy it (an explicit close; raises what the wait or
        the destruction reports, after releasing everything)."""
        if self.device.closed:  # its device closed it (or this is a fork() child): nothing left
            self.closing = self.closed = True
            return
        if self.closed:
            _check_destroy(self._finish_destroy())  # after an interrupted close, or nothing
            return
        caches = self._shut()
        try:
            acl.use_context(self.context)
            acl.synchronize_stream(self.handle)
        except Exception:
            # Its work may not have run: release it later, once the device says it has.
            _lifetime.retiring(_Retiring(self, caches))
            raise
        _check_destroy(self._destroy(caches))
        _lifetime.collect()

    def release(self) -> int:
        """The Stream was dropped without close(): release without blocking (the holder's
        release, called from collect())."""
        if self.device.closed:
            self.closed = True
            return 0
        if self.closed:
            return self._finish_destroy()
        _lifetime.retiring(_Retiring(self, self._shut()))
        return 0

    def close_for_device(self) -> list[BaseException]:
        """The device is closing and has been synchronized."""
        errors: list[BaseException] = []
        try:
            status = self._destroy(self._shut())
            if status:
                _check_destroy(status)
        except Exception as exc:
            errors.append(exc)
        return errors


def _check_destroy(status: int) -> None:
    check(status, "aclrtDestroyStream")


class _Retiring:
    """A stream whose work may still be running, destroyed once the device reports it idle."""

    __slots__ = ("state", "caches")

    def __init__(self, state: StreamState, caches: dict[Any, Any]) -> None:
        self.state = state
        self.caches = caches

    def poll(self) -> bool:
        s = self.state
        if s.device.closed:
            s.closed = True
            return True
        if s.closed:
            s._finish_destroy()
            return True
        if s.waiters:
            return False  # a thread still waits on it (through a plan's stream): later
        acl.use_context(s.context)
        if not acl.query_stream(s.handle):
            return False
        s._destroy(self.caches)
        return True


class Stream:
    """A CANN stream: tasks on it run in order, asynchronously to the host.

    ``Stream(device)`` creates one (aclrtCreateStream); ``Device.default_stream`` is the
    device's default stream. ``with stream:`` makes it the thread's current stream (and its
    device the current device) until the block ends; it closes nothing. ``close()`` waits for
    the stream and destroys it; it is safe twice. Any thread may use a stream; closing one that
    another thread is using makes that thread's call complete or raise ClosedError.
    """

    __slots__ = ("state", "_is_default", "__weakref__")
    state: StreamState  #: the stream's internals, for pyacl_moe's own layers (read on every launch)

    def __init__(self, device: Device | int | None = None) -> None:
        dev = resolve_device(device)
        _lifetime.collect()
        dev.activate()
        handle = acl.StreamHandle(dev.context)
        state = StreamState(dev, handle)
        self.state = state
        self._is_default = False
        _lifetime.track(self, state)  # before the handle exists: a dropped stream is released
        acl.create_stream(handle)
        dev.add_queue(state)

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
        _lifetime.collect()
        dev.activate()
        h = acl.BorrowedStreamHandle(dev.context, address)
        s = cls.__new__(cls)
        state = StreamState(dev, h)
        state.owner = owner
        s.state = state
        s._is_default = False
        _lifetime.track(s, state)
        dev.add_queue(state)
        return s

    @classmethod
    def _default(cls, device: Device) -> Stream:
        s = cls.__new__(cls)
        state = StreamState(device, None)
        s.state = state
        s._is_default = True
        device.add_queue(state)
        return s

    # -- properties

    @property
    def device(self) -> Device:
        """The device the stream belongs to."""
        return self.state.device

    @property
    def handle(self) -> int:
        """The aclrtStream as an integer (0 for a default stream, and once closed)."""
        h = self.state.handle
        return h.address if h is not None else 0

    @property
    def is_default(self) -> bool:
        """True for a device's default stream."""
        return self._is_default

    @property
    def closed(self) -> bool:
        """True once closed, or once its device was closed."""
        s = self.state
        return s.closing or s.device.closed

    def __repr__(self) -> str:
        kind = "default stream" if self._is_default else f"stream {self.handle:#x}"
        return f"<Stream {kind} on device {self.device.device_id}{' closed' if self.closed else ''}>"

    # -- waiting and ordering

    def synchronize(self, timeout_ms: int | None = None) -> None:
        """Block until every task queued on the stream has run. ``timeout_ms``: -1 (no limit)
        or a positive number of ms; CANN refuses 0 (107000). Raises AclRuntimeError for a
        device-side failure (e.g. 507015 for a kernel fault; the stream's latest one, reported
        once) or a timeout (507046, which leaves a fault for the next synchronize)."""
        if timeout_ms is not None:
            timeout_ms = _args.int32("timeout_ms", timeout_ms, lo=-1)
        self.state.synchronize(timeout_ms)

    def query(self) -> bool:
        """True when every task queued on the stream has run (aclrtStreamQuery); never
        waits."""
        return self.state.query()

    def wait_event(self, event: Event) -> None:
        """Make later tasks on this stream wait until ``event`` completes (aclrtStreamWaitEvent).
        ``event`` must have been recorded: CANN refuses a wait on an event never recorded
        (AclRuntimeError 107000)."""
        ev = _args.instance("event", event, Event, "an Event")
        core = ev.core("event")
        if core.device is not self.state.device:
            raise InvalidArgument("event", f"is on device {core.device.device_id}, the stream on "
                                           f"{self.state.device.device_id}")
        self.state.enqueue(core, acl.stream_wait_event, core.handle)

    def record(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one if None) on this stream and return it."""
        if event is None:
            ev = Event(self.state.device)
        else:
            ev = _args.instance("event", event, Event, "an Event or None")
        ev.record(self)
        return ev

    # -- release

    def close(self) -> None:
        """Wait for the stream, then destroy it (a borrowed one is only waited for). Safe twice;
        a no-op on a default stream."""
        if self._is_default:
            return
        self.state.close()

    def __enter__(self) -> Stream:
        self.state.check_open()
        self.state.device.__enter__()
        cur = thread_current
        cur.saved.append(cur.stream)
        cur.stream = self
        return self

    def __exit__(self, *exc: object) -> None:
        cur = thread_current
        cur.stream = cur.saved.pop()
        self.state.device.__exit__()


Device.attachments["default_stream"] = Stream._default


def active_stream(device: Device) -> Stream | None:
    """The stream a ``with stream:`` block made current on this thread, if it is on
    ``device``; else None (calls then take their stream-less path)."""
    s = thread_current.stream
    return s if s is not None and s.state.device is device else None


def current_stream(device: Device | int | None = None) -> Stream:
    """The stream calls without ``stream=`` use on ``device`` (default: the current device):
    the one a ``with stream:`` block made current on this thread, else the device's default
    stream."""
    dev = resolve_device(device)
    s = thread_current.stream
    if s is not None and s.state.device is dev:
        return s
    return dev.default_stream  # type: ignore[no-any-return]


def resolve_stream(stream: Stream | None, device: Device, name: str = "stream") -> StreamState:
    """The state of ``stream`` (if None, the thread's current stream on ``device``, else the
    device's default stream), checked open and on ``device``."""
    if stream is None:
        cur = thread_current.stream
        if cur is None or cur.state.device is not device:
            state: StreamState = device.default_stream.state
            return state
        stream = cur
    if not isinstance(stream, Stream):
        raise InvalidArgument(name, f"must be a Stream or None, got {type(stream).__name__}")
    state = stream.state
    state.check_open(name)
    if state.device is not device:
        raise InvalidArgument(name, f"is on device {state.device.device_id}, the arrays on {device.device_id}")
    return state


class _EventCore:
    """What an Event owns: the handle, released once neither the Event nor queued work (a
    record, a wait) needs it."""

    __slots__ = ("device", "handle", "token", "__weakref__")

    def __init__(self, device: Device) -> None:
        self.device = device
        self.handle = acl.EventHandle(device.context)
        self.token = _lifetime.track(self, self.handle)
        acl.create_event(self.handle)


class Event(_lifetime.Owner):
    """A CANN event: a marker recorded on a stream, for ordering and timing. ``close()``
    destroys it, at once unless queued work still records or waits on it."""

    __slots__ = ("_core", "_device", "__weakref__")
    RELEASE_API = "aclrtDestroyEvent"

    def __init__(self, device: Device | int | None = None) -> None:
        dev = resolve_device(device)
        _lifetime.collect()
        dev.activate()
        self._device = dev
        self._core: _EventCore | None = None
        self._core = _EventCore(dev)

    def core(self, what: str = "event") -> _EventCore:
        """The event's handle owner, checked open (for pyacl_moe's own layers)."""
        c = self._core
        if c is None or c.device.closed:
            raise ClosedError(what, "it was closed" if c is None else f"its device {c.device.device_id} was closed")
        return c

    @property
    def device(self) -> Device:
        """The device the event belongs to."""
        return self._device

    @property
    def handle(self) -> int:
        """The aclrtEvent as an integer (0 once closed)."""
        c = self._core
        return c.handle.address if c is not None else 0

    @property
    def closed(self) -> bool:
        """True once closed, or once its device was closed."""
        return self._core is None or self._device.closed

    def __repr__(self) -> str:
        return f"<Event {self.handle:#x} on device {self._device.device_id}{' closed' if self.closed else ''}>"

    def record(self, stream: Stream | None = None) -> Event:
        """Record the event on ``stream`` (default: the device's default stream)."""
        core = self.core()
        state = resolve_stream(stream, core.device)
        state.enqueue(core, acl.record_event, core.handle)
        return self

    def synchronize(self) -> None:
        """Block until the work recorded before the event has run (at once for an event never
        recorded). It reports no device fault of that work: the stream's synchronize (or the
        device's) does."""
        core = self.core()
        core.device.activate()
        acl.synchronize_event(core.handle)

    def query(self) -> bool:
        """True when the work recorded before the event has run (aclrtQueryEventStatus); an
        event never recorded is not complete (CANN reports NOT_READY for it). Never waits."""
        core = self.core()
        core.device.activate()
        return acl.query_event(core.handle)

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to ``end`` (both recorded and complete: 507000 when one
        was never recorded, 107006 while one has not completed; negative if ``end`` completed
        first)."""
        other = _args.instance("end", end, Event, "an Event")
        core = self.core()
        core.device.activate()
        return acl.event_elapsed_ms(core.handle, other.core("end").handle)

    def __sub__(self, start: Event) -> float:
        """``end - start``: milliseconds between two completed events."""
        return _args.instance("start", start, Event, "an Event").elapsed_ms(self)

