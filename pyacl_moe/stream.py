"""Streams and events, and the fault rule.

A :class:`Stream` runs its tasks in order, asynchronously to the host. Everything the binding
queues on a stream goes through :class:`StreamState` under the stream's lock: what the task
reads or writes is held on the stream's :class:`~pyacl_moe._lifetime.Ledger` until the task is
known complete, and the memory it writes is stamped with the stream's *epoch* (see below).

**The fault rule.** CANN reports a device fault (a kernel reading outside its memory, say) once,
to the first synchronize of its stream or device, then forgets it; events and queries never
report it. The binding keeps what a wait of its own learns: every wait (:meth:`StreamState.wait`,
whichever call makes it) that CANN tells of a fault records it on the stream with the window of
work it covers, from the last clean wait to now, in epochs (an epoch ends when a wait begins).
Then:

- memory whose latest write lies in a recorded window is faulted: reading it (to_host on any
  stream or none, a copy of it, a launch that reads it) raises the fault, until it is written
  again;
- each fault is raised by exactly one synchronize of its stream or device (``synchronize()``,
  ``close()``, a stream-less ``copy_from_host``'s wait), whichever thread's wait CANN told.

Ordering between two different streams is the caller's job, through events, as in CUDA:
``consumer.wait_event(producer.record())``. ``with stream:`` makes the stream the calling
thread's current stream on its device (and the device current); it closes nothing. Closing a
stream waits for it; a stream dropped without ``close()`` is destroyed once the device reports
it idle (aclrtStreamQuery), at a later safe point.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable
from typing import Any

from . import _args, _lifetime
from ._cann import acl
from ._cann.errcheck import check
from .device import Device, resolve_device
from .errors import AclError, AclRuntimeError, ClosedError, InvalidArgument

__all__ = ["Event", "Fault", "Stream", "StreamState", "active_stream", "any_fault", "check_written",
           "current_stream", "faults_recorded", "is_fault"]


class _Current(threading.local):
    """The calling thread's current stream (set by ``with stream:``) and the ones it replaced."""

    stream: Stream | None = None

    def __init__(self) -> None:
        self.saved: list[Stream | None] = []


thread_current = _Current()

# What a synchronize returns about its own call rather than about the work it waited for.
_NOT_FAULTS = frozenset({507046, 507047})  # the wait timed out


# Whether a wait ever recorded a fault in this process: until one does, the steady states of
# the launches skip looking at their inputs' faults. Set once, never cleared; read without a
# lock (a launch that misses it being set could not have known of the fault anyway).
any_fault: list[bool] = [False]


def faults_recorded() -> bool:
    """Whether any fault was ever recorded in this process."""
    return any_fault[0]


def is_fault(exc: BaseException) -> bool:
    """Whether a synchronize's error is a device fault of the work it waited for."""
    return isinstance(exc, AclRuntimeError) and exc.status >= 500000 and exc.status not in _NOT_FAULTS


class Fault:
    """A fault a wait recorded: CANN's error and the window of epochs it may have come from
    (``lo`` exclusive, ``hi`` inclusive). ``raised``: a synchronize has raised it. Fields are
    guarded by the lock of the stream(s) that hold it."""

    __slots__ = ("error", "lo", "hi", "raised")

    def __init__(self, error: AclError, lo: int, hi: int) -> None:
        # A fault's error is never raised itself (exception() makes a new one): its traceback
        # goes, since its frames would keep the arrays of the wait that caught it alive.
        error.__traceback__ = error.__context__ = error.__cause__ = None
        self.error, self.lo, self.hi, self.raised = error, lo, hi, False

    def exception(self) -> AclError:
        """A new exception with CANN's status, API and message, to raise."""
        e = self.error
        return type(e)(e.status, e.api, e.message)


def check_written(track: Any, waiting: bool = True) -> None:
    """Raise the fault of ``track``'s latest write, if a wait recorded one. With ``waiting``
    (a read back), a write no wait has covered yet is waited for first, on its own stream
    (without raising that stream's other faults): a read on another stream, ordered after the
    write by an event, would never learn of the write's fault otherwise."""
    for state, epoch in track.written:
        if waiting and not state.confirmed(epoch) and not state.device.closed:
            state.wait_unless_destroyed(report=False)
            if state.fault_at(epoch) is None and not state.confirmed(epoch):
                state.drain_waits()  # one of them may have been told of the write's fault
        fault = state.fault_at(epoch)
        if fault is not None:
            raise _reported(fault, state.device)


def _partly(written: tuple[Any, ...], mark: tuple[Any, ...]) -> tuple[Any, ...]:
    """``written`` and a write of part of the memory. Writes known to have run without a fault
    are dropped once there are many (while no fault was ever recorded, the only case where that
    is known without the writer's lock)."""
    if mark[0] in written:
        return written
    if len(written) >= 32 and not any_fault[0]:
        written = tuple(m for m in written if not m[0].confirmed(m[1]))
    return written + mark


def _reported(fault: Fault, device: Device) -> AclError:
    """The exception to raise for ``fault``, now marked raised on every stream that recorded it
    (a device synchronize records one error on each): no synchronize raises it again."""
    for q in device.queues():
        if isinstance(q, StreamState):
            q.mark_raised(fault.error)
    return fault.exception()


class StreamState:
    """A stream's internals, shared by the :class:`Stream` the user holds and by whatever still
    uses the stream (plans, work held on its ledger).

    ``lock`` guards every field below but ``device``, ``context`` and ``handle``: the ledger,
    ``caches`` (per-stream objects of the layers above, each with ``release(idle) -> list``),
    ``workspace``, ``closing``/``closed``, the epochs and faults, ``inside`` (a lock held by
    each thread inside a CANN call on the handle, a wait or a query: the destroy waits for
    each, and since a ``with`` block releases a lock whatever interrupts it, a call cut short
    holds nothing up). Never call :func:`~pyacl_moe._lifetime.collect` while holding it.
    """

    __slots__ = ("device", "context", "handle", "lock", "ledger", "closing", "closed", "caches", "shut_caches",
                 "workspace", "epoch", "mark", "clean", "ripe", "faults", "his", "inside", "owner", "__weakref__")

    def __init__(self, device: Device, handle: acl.StreamHandle | None) -> None:
        self.device = device
        self.context = device.context
        self.handle = handle  # None: the device's default stream
        self.lock = threading.Lock()
        self.ledger = _lifetime.Ledger(device.context, handle)
        self.closing = False  # no new work
        self.closed = False  # the handle is gone
        self.caches: dict[Any, Any] = {}
        self.shut_caches: dict[Any, Any] = {}  # the caches once shut, until the stream is destroyed
        self.workspace: Any = None  # the stream's workspace block (pool.workspace_for)
        self.epoch = 1  # writes queued now are stamped with it; a wait that begins ends it
        self.mark = ((self, 1),)  # what a write queued now stores in its Track.written
        self.clean = 0  # every write stamped <= clean ran, its faults (if any) recorded
        # How far the clean waits that ended reached: CANN reports a fault to one wait only, so
        # a clean wait proves nothing while another that may have been told is still to record
        # it; clean moves up to ripe when no wait is in progress (``inside``).
        self.ripe = 0
        self.faults: list[Fault] = []  # disjoint windows, in order
        self.his: list[int] = []  # each fault's hi, for bisect
        self.inside: dict[threading.Lock, None] = {}
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

    def enqueue(self, hold: Any, call: Callable[..., None], *args: Any, writes: Iterable[tuple[Any, bool]] = ()
                ) -> int:
        """Queue a task: ``call(*args, stream_handle)``, with ``hold`` kept until it has run and
        ``writes`` (the memory it writes: (Track, whole) pairs, see :meth:`stamp`) stamped.
        Returns the task's epoch (for :meth:`wait_for`). The hold is taken first: an
        interrupted call leaves it held, never freed."""
        with self.lock:
            self.check_open()
            acl.use_context(self.context)
            self.ledger.hold(hold)
            call(*args, self.handle)
            self.stamp(writes)
            epoch = self.epoch
            done = self.ledger.after_enqueue()
        del done  # outside the lock: dropping the last reference may free memory
        _lifetime.collect()
        return epoch

    def stamp(self, writes: Iterable[tuple[Any, bool]]) -> None:
        """Memory was just written by work queued here (lock held): for each (Track, whole),
        the write is its latest (whole: all of its bytes, so it replaces what came before; a
        part adds to it, since the rest may still hold a faulted write)."""
        mark = self.mark
        for t, whole in writes:
            t.written = mark if whole else _partly(t.written, mark)

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.mark = ((self, self.epoch),)

    def retire(self, what: Any) -> None:
        """Keep ``what`` until everything queued so far on the stream has run."""
        if _lifetime.forked():
            return
        with self.lock:
            if self.closed:
                return  # its work has run; dropping is safe
            acl.use_context(self.context)
            done = self.ledger.retire(what)
        del done

    # -- waiting, and what it learns of faults

    def begin_wait(self, inside: threading.Lock, closing: bool = False) -> tuple[int, int, int]:
        """Before a wait covering this stream, with ``inside`` held by the caller until it has
        ended: (ledger count, epoch ending, clean so far). A close's own wait (``closing``)
        begins on a stream already refusing work."""
        with self.lock:
            if not closing or self.closed:  # a destroyed stream has no handle to wait on
                self.check_open()
            self.inside[inside] = None
            token = (self.ledger.count, self.epoch, self.clean)
            self._next_epoch()
            return token

    def end_wait(self, token: tuple[int, int, int], error: BaseException | None, inside: threading.Lock
                 ) -> Fault | None:
        """After the wait: a clean wait knows what it covered complete (its holds go); a fault
        CANN reported to it is recorded, and what it covered stays held (CANN reports a
        fault from a completed wait, but nothing here can tell that wait from one that
        failed midway). Returns the fault (None for a clean wait, or one that timed out)."""
        mark, ended, lo = token
        done: list[Any] = []
        fault = None
        with self.lock:
            self.inside.pop(inside, None)
            if error is None:
                self.ripe = max(self.ripe, ended)
                done = self.ledger.synchronized(mark)
            elif is_fault(error):
                assert isinstance(error, AclError)
                # The wait may have covered writes queued while it ran (stamped after
                # ``ended``): the window takes them all (they read as faulted, so nothing
                # need wait for them), and later writes get a new epoch.
                fault = Fault(error, lo, self.epoch)
                self._record(fault)
                self.ripe = max(self.ripe, self.epoch)
                self._next_epoch()
            self._forget_cut_waits()
            if not self.inside:
                self.clean = max(self.clean, self.ripe)
        del done  # outside the lock: dropping the last reference may free memory
        return fault

    def _forget_cut_waits(self) -> None:
        # (lock held; a loop under a lock is a function of its own: ARCHITECTURE.md)
        for lk in [lk for lk in self.inside if not lk.locked()]:
            del self.inside[lk]  # a wait an interrupt cut short

    def _synchronize(self, timeout_ms: int | None, closing: bool = False) -> tuple[BaseException | None, Fault | None]:
        """aclrtSynchronizeStream with the bookkeeping: (CANN's error, the fault recorded)."""
        error: BaseException | None = None
        inside = threading.Lock()
        with inside:
            token = self.begin_wait(inside, closing)
            try:
                acl.use_context(self.context)
                acl.synchronize_stream(self.handle, timeout_ms)
            except AclError as exc:
                error = exc
            fault = self.end_wait(token, error, inside)
        return error, fault

    def _record(self, fault: Fault) -> None:
        # Windows are kept disjoint and in order (merged where they meet), so a lookup is a
        # bisect; a merged window keeps the latest error, as CANN's stream does.
        lo, hi, raised = fault.lo, fault.hi, fault.raised
        while self.faults and self.faults[-1].hi > lo:
            last = self.faults.pop()
            self.his.pop()
            lo, hi, raised = min(lo, last.lo), max(hi, last.hi), raised and last.raised
        fault.lo, fault.hi, fault.raised = lo, hi, raised
        self.faults.append(fault)
        self.his.append(hi)
        any_fault[0] = True

    def fault_at(self, epoch: int) -> Fault | None:
        """The fault recorded for a write stamped ``epoch``, if any."""
        if not self.faults:
            return None
        with self.lock:
            i = bisect.bisect_left(self.his, epoch)
            if i < len(self.faults) and self.faults[i].lo < epoch:
                return self.faults[i]
        return None

    def unraised(self) -> Fault | None:
        """The oldest recorded fault no synchronize raised yet, now marked raised."""
        if not self.faults:
            return None
        with self.lock:
            return _first_unraised(self.faults)

    def mark_raised(self, error: AclError) -> None:
        """A synchronize raised ``error``: so is this stream's record of it."""
        with self.lock:
            _mark_raised(self.faults, error)

    def drain_waits(self) -> None:
        """Return once every wait in progress now has ended (recording what CANN told it)."""
        with self.lock:
            inside = list(self.inside)
        for lk in inside:
            with lk:
                pass

    def confirmed(self, epoch: int) -> bool:
        """Whether writes stamped ``epoch`` are known complete (their faults recorded)."""
        return epoch <= self.clean

    def wait(self, timeout_ms: int | None = None, report: bool = True, closing: bool = False) -> None:
        """Wait for everything queued on the stream (aclrtSynchronizeStream). With ``report``
        (a synchronize), raise the fault CANN reported to this wait, or else one an earlier
        wait recorded and no synchronize raised yet; without (a read's wait), only record.
        With ``closing``, a stream refusing new work is waited for too (ClosedError only once
        it is destroyed)."""
        error, fault = self._synchronize(timeout_ms, closing)
        _lifetime.collect()
        if error is not None and fault is None:
            raise error  # not a fault: a timeout, a closed stream
        if report:
            pending = self.unraised()
            if pending is not None:
                raise _reported(pending, self.device)

    def wait_unless_destroyed(self, report: bool) -> bool:
        """Wait for the stream on behalf of memory its work uses (a read, a host write), even
        while another thread closes it: its close's own wait may not have run that work yet.
        False, waiting for nothing, once it is destroyed (it ran everything)."""
        try:
            self.wait(report=report, closing=True)
        except ClosedError:
            return False
        return True

    def wait_for(self, epoch: int) -> None:
        """Wait for the stream, then raise the fault of a task queued in ``epoch`` (a copy to
        the host the caller is about to use), whichever wait CANN reported it to."""
        self.wait(report=False)
        fault = self.fault_at(epoch)
        if fault is not None:
            raise _reported(fault, self.device)

    def query(self) -> bool:
        """aclrtStreamQuery: True once everything queued has run (never waits, never reports
        a fault)."""
        inside = threading.Lock()
        with inside:
            with self.lock:
                self.check_open()
                mark = self.ledger.count
                self.inside[inside] = None
            acl.use_context(self.context)
            idle = acl.query_stream(self.handle)
            with self.lock:
                self.inside.pop(inside, None)
                done = self.ledger.synchronized(mark) if idle else self.ledger.poll()
        del done
        return idle

    def poll(self) -> None:
        """Drop what completed fences show done (never waits)."""
        with self.lock:
            done = self.ledger.poll()
        del done

    def drop_caches(self) -> None:
        """Give up the per-stream caches and the workspace (empty_cache): what they hold goes
        once the work queued so far is done; the spare fence events go now."""
        with self.lock:
            if self.closed:
                return
            caches, self.caches = self.caches, {}
            retired: list[Any] = []
            if self.workspace is not None:
                self.workspace.uncache()
                retired.append(self.workspace)
                self.workspace = None
            for cache in caches.values():
                retired += cache.release(False)
            acl.use_context(self.context)
            # Only held enqueues use what the caches and the workspace held (a plan's slot keeps
            # its own references): once every point is known complete they go at once.
            done = self.ledger.retire(retired, counted_only=True) if retired else []
            self.ledger.drop_events()
        del done, retired, caches

    # -- release

    def shut(self) -> dict[Any, Any]:
        """Refuse new work (launches check ``closing`` under the lock) and take the caches, to
        be released once the stream has run everything. Safe twice."""
        with self.lock:
            self.closing = True
            self.shut_caches.update(self.caches)
            self.caches = {}
            if self.workspace is not None:
                self.shut_caches["workspace"] = _Kept(self.workspace)
                self.workspace = None
            return self.shut_caches

    def destroy(self, caches: dict[Any, Any]) -> int:
        """The stream has run everything: release its caches, destroy it once no other thread
        is inside a wait on it, then drop what it held. Each step is safe again, so a destroy
        an interrupt cut short is finished by the next (a close, or the retiring poll)."""
        for cache in list(caches.values()):
            cache.release(True)
        with self.lock:
            self.closed = True
            inside, self.inside = list(self.inside), {}
        for lk in inside:  # each call on the handle in progress ends first (one cut short is over)
            with lk:
                pass
        self.device.remove_queue(self)
        # aclrtDestroyStream waits for what is still queued (a fault's wait left it held):
        # what the ledger holds goes after it. A handle is released once.
        status = self.handle.release() if self.handle is not None else 0
        with self.lock:
            self.shut_caches = {}
            done = self.ledger.release_all()
        del done
        return status

    def close(self) -> None:
        """Wait for the stream, then destroy it (an explicit close: raises what the wait
        reports, after releasing everything)."""
        if self.device.closed:
            # Its device's close waits for it and destroys it (or this is a fork() child).
            # Not ``closed``: its queued work may not have run yet, and the memory that work
            # uses is kept while a stream that is not closed has it pending.
            self.closing = True
            return
        if self.closed:  # a close an interrupt cut short, or a drop's: finish it
            check(self.destroy(self.shut()), "aclrtDestroyStream")
            return
        caches = self.shut()
        try:
            error, fault = self._synchronize(None, closing=True)
        except ClosedError:
            return  # another thread's close destroyed it meanwhile
        if error is not None and fault is None:
            _lifetime.retiring(_Retiring(self, caches))  # its work may not have run: later
            raise error
        check(self.destroy(caches), "aclrtDestroyStream")
        _lifetime.collect()
        pending = self.unraised()
        if pending is not None:
            raise _reported(pending, self.device)

    def release(self) -> int:
        """The Stream was dropped without close(): release without blocking (the holder's
        release, called from collect())."""
        if self.device.closed:
            return 0  # its device's close waits for it and destroys it (see close)
        _lifetime.retiring(_Retiring(self, self.shut()))  # (closed: a destroy cut short, finished there)
        return 0

    def close_for_device(self) -> list[BaseException]:
        """The device is closing and has been synchronized."""
        try:
            check(self.destroy(self.shut()), "aclrtDestroyStream")
        except Exception as exc:
            return [exc]
        return []

    def after_fork(self) -> None:
        """In a fork() child: a new lock (a parent thread may have held the old one), and no
        work ever again."""
        self.lock = threading.Lock()
        self.inside = {}
        self.closing = True


class _Kept:
    """A block the stream held (its workspace), dropped with the stream's other caches."""

    __slots__ = ("what",)

    def __init__(self, what: Any) -> None:
        self.what = what

    def release(self, idle: bool) -> list[Any]:
        self.what = None
        return []


class _Retiring:
    """A stream whose work may still be running, destroyed once the device reports it idle."""

    __slots__ = ("state", "caches")

    def __init__(self, state: StreamState, caches: dict[Any, Any]) -> None:
        self.state = state
        self.caches = caches

    def poll(self) -> bool:
        s = self.state
        if s.device.closed:
            return True  # its device's close waits for it and destroys it (see StreamState.close)
        if not s.closed:  # (closed: a destroy was cut short, its work had run)
            acl.use_context(s.context)
            if not acl.query_stream(s.handle):
                return False
        s.destroy(self.caches)
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
    state: StreamState  #: the stream's internals, for pyacl_moe's own layers

    def __init__(self, device: Device | int | None = None) -> None:
        dev = resolve_device(device)
        _lifetime.collect()
        dev.activate()
        handle = acl.StreamHandle(dev.context)
        self.state = StreamState(dev, handle)
        self._is_default = False
        _lifetime.track(self, self.state)  # before the handle exists: a dropped stream is released
        acl.create_stream(handle)
        dev.add_queue(self.state)

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
        s = cls.__new__(cls)
        s.state = StreamState(dev, acl.BorrowedStreamHandle(dev.context, address))
        s.state.owner = owner
        s._is_default = False
        _lifetime.track(s, s.state)
        dev.add_queue(s.state)
        return s

    @classmethod
    def _default(cls, device: Device) -> Stream:
        s = cls.__new__(cls)
        s.state = StreamState(device, None)
        s._is_default = True
        device.add_queue(s.state)
        return s

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
        return self.state.closing or self.state.device.closed

    def __repr__(self) -> str:
        kind = "default stream" if self._is_default else f"stream {self.handle:#x}"
        return f"<Stream {kind} on device {self.device.device_id}{' closed' if self.closed else ''}>"

    def synchronize(self, timeout_ms: int | None = None) -> None:
        """Block until every task queued on the stream has run. ``timeout_ms``: -1 (no limit)
        or a positive number of ms; CANN refuses 0 (107000). Raises AclRuntimeError for a
        device fault of its work (e.g. 507015; CANN's latest one), once, whichever thread's wait
        CANN reported it to, or for a timeout (507046, which leaves a fault for the next wait)."""
        if timeout_ms is not None:
            timeout_ms = _args.int32("timeout_ms", timeout_ms, lo=-1)
        self.state.wait(timeout_ms)

    def query(self) -> bool:
        """True when every task queued on the stream has run (aclrtStreamQuery); never waits
        and never reports a fault."""
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
        ev = Event(self.state.device) if event is None else _args.instance("event", event, Event, "an Event or None")
        ev.record(self)
        return ev

    def close(self) -> None:
        """Wait for the stream, then destroy it (a borrowed one is only waited for). Safe twice;
        a no-op on a default stream."""
        if not self._is_default:
            self.state.close()

    def __enter__(self) -> Stream:
        self.state.check_open()
        self.state.device.__enter__()
        thread_current.saved.append(thread_current.stream)
        thread_current.stream = self
        return self

    def __exit__(self, *exc: object) -> None:
        thread_current.stream = thread_current.saved.pop()
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
    return active_stream(dev) or dev.default_stream


def resolve_stream(stream: Stream | None, device: Device, name: str = "stream") -> StreamState:
    """The state of ``stream`` (if None, the thread's current stream on ``device``, else the
    device's default stream), checked open and on ``device``."""
    if stream is None:
        cur = active_stream(device)
        return cur.state if cur is not None else device.default_stream.state
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
    destroys it, at once unless queued work still records or waits on it. Neither its
    synchronize nor its query reports a device fault (a stream's synchronize does)."""

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
        """Record the event on ``stream`` (default: the thread's current stream)."""
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


def _first_unraised(faults: list[Fault]) -> Fault | None:
    # (the stream's lock held; a loop under a lock is a function of its own: ARCHITECTURE.md)
    for f in faults:
        if not f.raised:
            f.raised = True
            return f
    return None


def _mark_raised(faults: list[Fault], error: AclError) -> None:
    # (the stream's lock held; a loop under a lock is a function of its own: ARCHITECTURE.md)
    for f in faults:
        if f.error is error:
            f.raised = True


def synchronize_device(device: Device, closing: bool = False) -> None:
    """aclrtSynchronizeDevice for ``device``'s streams, with the fault rule: a fault it reports
    is recorded on each of them (CANN does not say which stream's it was), and it raises the
    oldest fault of its streams no synchronize raised yet (one fault recorded on several streams
    is raised once)."""
    # It uses no stream handle, so a stream may close meanwhile: those closing are skipped. A
    # wait an interrupt cuts short learns nothing (like one that timed out).
    inside = threading.Lock()
    with inside:
        states, error = _synchronize_device(device, closing, inside)
    _lifetime.collect()
    if error is not None and not is_fault(error):
        raise error
    for s in states:
        pending = s.unraised()
        if pending is not None:
            raise _reported(pending, device)


def _synchronize_device(device: Device, closing: bool, inside: threading.Lock
                        ) -> tuple[list[StreamState], BaseException | None]:
    # (``inside`` held; a loop under a lock is a function of its own: ARCHITECTURE.md)
    # The streams waited for, and CANN's error.
    tokens = []
    error: BaseException | None = None
    for q in device.queues():
        if isinstance(q, StreamState):
            try:
                tokens.append((q, q.begin_wait(inside, closing)))
            except ClosedError:
                pass
    try:
        acl.use_context(device.context)
        acl.synchronize_device()
    except AclError as exc:
        error = exc
    for s, token in tokens:
        s.end_wait(token, error, inside)
    return [s for s, _ in tokens], error


Device.synchronize_hook = synchronize_device
