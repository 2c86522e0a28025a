"""Devices, streams and events.

CANN keeps one process-wide initialization (aclInit) and, per thread, a current device
(aclrtSetDevice). This module hides both: a :class:`Device` initializes CANN on first use
(shared and reference-counted across devices), and every call that needs a device first makes
that device current on the calling thread, so any thread may use any object.

Release order on :meth:`Device.close` (and at interpreter exit) is the one CANN asks for:
streams, events, device memory, then aclrtResetDevice, then aclFinalize once the last device
is closed. Objects still alive afterwards are dead: closing them is a no-op, using them raises.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any

from . import _ffi
from .errors import InvalidArgument

__all__ = ["Device", "Event", "Stream", "acl_version", "current_device", "device_count", "soc_name"]


class _Process:
    """aclInit/aclFinalize shared by every open Device."""

    lock = threading.RLock()
    open_devices: dict[int, Device] = {}
    owns_init = False
    # Bumped at each aclFinalize: handles from an older generation are dead.
    generation = 0

    @classmethod
    def acquire(cls) -> None:
        if not cls.open_devices:
            cls.owns_init = _ffi.init()

    @classmethod
    def release(cls) -> None:
        if not cls.open_devices:
            cls.generation += 1
            if cls.owns_init:
                cls.owns_init = False
                _ffi.finalize()


_tls = threading.local()

# id(stream) -> the list of what that stream's queued work still uses (see Stream._init).
_pending: dict[int, list[Any]] = {}


def _thread_current() -> Device | None:
    return getattr(_tls, "device", None)


class _Resource:
    """Something a device owns and must release before aclrtResetDevice."""

    _release_rank = 0  # lower releases first

    def _release(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class Device:
    """An Ascend device (NPU), by id.

    ``Device(0)`` returns the process's shared object for device 0, opening it on first use:
    aclInit once per process, aclrtSetDevice on the calling thread. ``close()`` releases every
    stream, event and array of the device in CANN's order, resets it, and finalizes CANN after
    the last device. As a context manager it is re-entrant: the outermost ``with`` closes it.
    """

    _instances: dict[int, Device] = {}
    # Called with the device at the start of close(), before anything is released: caches in
    # layers above register here (the runtime does not know them).
    _close_hooks: list[Any] = []

    def __new__(cls, device_id: int = 0) -> Device:
        if isinstance(device_id, bool) or not isinstance(device_id, int):
            raise InvalidArgument("device_id", f"must be an int, got {type(device_id).__name__}")
        with _Process.lock:
            dev = cls._instances.get(device_id)
            if dev is not None and not dev._closed:
                return dev
            dev = super().__new__(cls)
            dev._open(device_id)
            cls._instances[device_id] = dev
            return dev

    def _open(self, device_id: int) -> None:
        self._id = device_id
        self._closed = False
        self._depth = 0
        self._sets = 0  # aclrtSetDevice calls made for this device, all threads together
        self._resources: weakref.WeakSet[_Resource] = weakref.WeakSet()
        self._lock = threading.RLock()
        _Process.acquire()
        self._generation = _Process.generation
        _Process.open_devices[device_id] = self
        try:
            count = _ffi.device_count()
            if not 0 <= device_id < count:
                raise InvalidArgument(
                    "device_id", f"must be in [0, {count}): CANN sees {count} device(s), got {device_id}"
                )
            self._set_current()
        except BaseException:
            del _Process.open_devices[device_id]
            _Process.release()
            raise
        self._default_stream = Stream._wrap_default(self)

    # -- identity and state

    @property
    def device_id(self) -> int:
        return self._id

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"<Device {self._id}{' closed' if self._closed else ''}>"

    def __int__(self) -> int:
        return self._id

    # -- making the device current

    def _set_current(self) -> None:
        _ffi.set_device(self._id)
        with self._lock:
            self._sets += 1
        _tls.device = self
        _tls.generation = self._generation

    def _activate(self) -> None:
        """Make this device current on the calling thread (cheap when it already is)."""
        if self._closed:
            raise RuntimeError(f"device {self._id} is closed")
        if getattr(_tls, "device", None) is not self:
            self._set_current()

    def set_current(self) -> Device:
        """Make this device the calling thread's current device; returns self."""
        if self._closed:
            raise RuntimeError(f"device {self._id} is closed")
        self._set_current()
        return self

    # -- resources

    def _register(self, res: _Resource) -> None:
        with self._lock:
            self._resources.add(res)

    def _unregister(self, res: _Resource) -> None:
        with self._lock:
            self._resources.discard(res)

    @property
    def default_stream(self) -> Stream:
        """The device's default stream (CANN's NULL stream)."""
        return self._default_stream

    def synchronize(self) -> None:
        """Wait for every stream of the device (aclrtSynchronizeDevice)."""
        self._activate()
        _ffi.synchronize_device()
        # Every stream of the device has run: what they kept alive may go.
        with self._lock:
            streams = [r for r in self._resources if isinstance(r, Stream)]
        for s in (self._default_stream, *streams):
            s._drop_keepalive()

    def mem_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device's memory."""
        self._activate()
        return _ffi.get_mem_info()

    # -- release

    def close(self) -> None:
        """Release everything this device owns, reset it, and finalize CANN after the last one.

        Safe to call twice. Errors from releasing individual objects are collected and the
        first is raised once everything has been released.
        """
        with _Process.lock:
            if self._closed:
                return
            first_error: BaseException | None = None
            for hook in Device._close_hooks:
                try:
                    hook(self)
                except Exception as exc:
                    first_error = first_error or exc
            try:
                self._activate()
                with self._lock:
                    resources = sorted(self._resources, key=lambda r: r._release_rank)
                for res in resources:
                    try:
                        res._release()
                    except Exception as exc:  # keep releasing the rest
                        first_error = first_error or exc
            except Exception as exc:
                first_error = first_error or exc
            self._closed = True
            if Device._instances.get(self._id) is self:
                del Device._instances[self._id]
            _Process.open_devices.pop(self._id, None)
            try:
                for _ in range(self._sets):
                    _ffi.reset_device(self._id)
            except Exception as exc:
                first_error = first_error or exc
            self._sets = 0
            _pending.pop(id(self._default_stream), None)  # the device ran and freed it all
            if getattr(_tls, "device", None) is self:
                _tls.device = None
            try:
                _Process.release()
            except Exception as exc:
                first_error = first_error or exc
            if first_error is not None:
                raise first_error

    def __enter__(self) -> Device:
        self._activate()
        with self._lock:
            self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            outermost = self._depth == 0
        if outermost:
            self.close()

    def _alive(self, generation: int) -> bool:
        return not self._closed and generation == self._generation


def current_device() -> Device:
    """The device this thread last made current through pyacl_moe, else device 0."""
    dev = _thread_current()
    if dev is not None and not dev._closed:
        return dev
    return Device(0)


def device_count() -> int:
    """How many devices CANN sees."""
    return _ffi.device_count()


def acl_version() -> tuple[int, int, int]:
    """The ACL interface version (aclrtGetVersion): (major, minor, patch)."""
    return _ffi.get_version()


def soc_name() -> str | None:
    """The SoC name CANN reports (aclrtGetSocName), e.g. 'Ascend910B3'; opens device 0 if no
    device is open yet, since CANN answers only once initialized."""
    current_device()
    return _ffi.soc_name()


def _resolve_device(device: Device | int | None) -> Device:
    if device is None:
        return current_device()
    if isinstance(device, Device):
        if device.closed:
            raise InvalidArgument("device", f"device {device.device_id} is closed")
        return device
    return Device(device)


class Stream(_Resource):
    """A CANN stream: tasks on it run in order, asynchronously to the host.

    ``Stream(device)`` creates one (aclrtCreateStream); ``Device.default_stream`` wraps the
    device's default stream. ``close()`` waits for the stream and destroys it; it is safe
    twice and is what the context manager calls.
    """

    _release_rank = 0
    _KEEPALIVE_LIMIT = 4096

    def __init__(self, device: Device | int | None = None) -> None:
        dev = _resolve_device(device)
        dev._activate()
        self._init(dev, _ffi.create_stream(), is_default=False)
        dev._register(self)

    @classmethod
    def _wrap_default(cls, device: Device) -> Stream:
        s = cls.__new__(cls)
        s._init(device, _ffi.null_stream(), is_default=True)
        return s

    def _init(self, device: Device, handle: Any, is_default: bool) -> None:
        self._device = device
        self._h = handle
        self._is_default = is_default
        self._closed = False
        self._closing = False
        self._generation = device._generation
        # Host buffers and device memory that queued tasks still use: kept alive until the
        # stream is synchronized, because CANN reads them when the task runs, not when queued.
        # The list is also held by a module-level registry, so that what it keeps stays
        # reachable even if the stream itself is caught in a reference cycle: the collector
        # frees such memory only after the stream's finalizer has waited for its work.
        self._keepalive: list[Any] = []
        _pending[id(self)] = self._keepalive
        self._lock = threading.Lock()

    @property
    def device(self) -> Device:
        return self._device

    @property
    def handle(self) -> int:
        """The aclrtStream as an integer (0 for a default stream)."""
        return _ffi.address(self._h)

    @property
    def is_default(self) -> bool:
        return self._is_default

    @property
    def closed(self) -> bool:
        return self._closed or not self._device._alive(self._generation)

    def __repr__(self) -> str:
        kind = "default stream" if self._is_default else f"stream {self.handle:#x}"
        return f"<Stream {kind} on device {self._device.device_id}{' closed' if self.closed else ''}>"

    def _use(self) -> Any:
        """Activate the device and return the handle, or raise if the stream is gone."""
        if self.closed:
            raise InvalidArgument("stream", f"{self!r} is closed")
        self._device._activate()
        return self._h

    def _keep(self, *objs: Any) -> None:
        """Keep objects alive until the stream is next synchronized."""
        keep = self._keepalive
        keep.extend(objs)  # atomic under the GIL; the list is swapped, never mutated, on sync
        if len(keep) > self._KEEPALIVE_LIMIT:
            # Bound the list in loops that never synchronize.
            self.synchronize()

    def synchronize(self, timeout_ms: int | None = None) -> None:
        """Block until every task queued on the stream has run. Raises AclRuntimeError for a
        device-side failure (e.g. 507015 for a kernel fault) or a timeout."""
        h = self._use()
        _ffi.synchronize_stream(h, timeout_ms)
        # Only after a successful wait: if it failed, queued tasks may still read what is kept.
        self._drop_keepalive()

    def _drop_keepalive(self) -> None:
        with self._lock:
            done, self._keepalive = self._keepalive, []
            if not self._closed:
                _pending[id(self)] = self._keepalive
        del done  # released outside the lock: finalizers may run here

    def wait_event(self, event: Event) -> None:
        """Make later tasks on this stream wait until ``event`` completes."""
        h = self._use()
        _ffi.stream_wait_event(h, event._use())

    def record(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one if None) on this stream and return it."""
        ev = event if event is not None else Event(self._device)
        ev.record(self)
        return ev

    def _release(self) -> None:
        with self._lock:
            if self._closed or self._closing:
                return
            self._closing = True
        self._device._unregister(self)
        if self._is_default or not self._device._alive(self._generation):
            self._closed = True
            _pending.pop(id(self), None)
            return
        self._device._activate()
        try:
            _ffi.synchronize_stream(self._h)
        finally:
            # Marked closed only once its work has run: whoever sees `closed` may rely on it.
            self._closed = True
            self._keepalive = []
            _pending.pop(id(self), None)
            _ffi.destroy_stream(self._h)

    def close(self) -> None:
        """Wait for the stream, then destroy it. Safe twice; a no-op on a default stream."""
        if self._is_default:
            return
        self._release()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # A stream dropped without close() is destroyed here; errors cannot be raised now.
        try:
            if not self._closed and not self._is_default and self._device._alive(self._generation):
                self._release()
        except Exception:
            pass


class Event(_Resource):
    """A CANN event: a marker recorded on a stream, for ordering and timing."""

    _release_rank = 1

    def __init__(self, device: Device | int | None = None) -> None:
        dev = _resolve_device(device)
        dev._activate()
        self._device = dev
        self._generation = dev._generation
        self._h = _ffi.create_event()
        self._closed = False
        dev._register(self)

    @property
    def device(self) -> Device:
        return self._device

    @property
    def handle(self) -> int:
        return _ffi.address(self._h)

    @property
    def closed(self) -> bool:
        return self._closed or not self._device._alive(self._generation)

    def __repr__(self) -> str:
        return f"<Event {self.handle:#x} on device {self._device.device_id}{' closed' if self.closed else ''}>"

    def _use(self) -> Any:
        if self.closed:
            raise InvalidArgument("event", f"{self!r} is closed")
        self._device._activate()
        return self._h

    def record(self, stream: Stream | None = None) -> Event:
        """Record the event on ``stream`` (default: the device's default stream)."""
        s = stream if stream is not None else self._device.default_stream
        h = self._use()
        _ffi.record_event(h, s._use())
        return self

    def synchronize(self) -> None:
        """Block until the work recorded before the event has run."""
        _ffi.synchronize_event(self._use())

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to ``end`` (both recorded and complete)."""
        return _ffi.event_elapsed_time(self._use(), end._use())

    def __sub__(self, start: Event) -> float:
        """``end - start``: milliseconds between two completed events."""
        return start.elapsed_ms(self)

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._device._unregister(self)
        if self._device._alive(self._generation):
            self._device._activate()
            _ffi.destroy_event(self._h)

    def close(self) -> None:
        """Destroy the event. Safe twice."""
        self._release()

    def __enter__(self) -> Event:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed and self._device._alive(self._generation):
                self._release()
        except Exception:
            pass


def _close_all_at_exit() -> None:
    """Release every open device, in id order, when the interpreter exits."""
    with _Process.lock:
        for dev in sorted(_Process.open_devices.values(), key=lambda d: d.device_id):
            try:
                dev.close()
            except Exception:
                pass


atexit.register(_close_all_at_exit)
