"""Devices: CANN's process set-up, the current device of each thread, and release order.

A :class:`Device` opens its device once for the process (aclInit when the first one opens,
aclrtSetDevice once) and keeps the device's default context. A thread that uses any object of
the device makes that context current (aclrtSetCurrentContext), which leaves aclrtSetDevice's
reference count alone however often threads switch devices.

:meth:`Device.close` (and interpreter exit) releases in the order CANN asks for: it waits for
the device, then closes its streams, events and memory, then resets the device. aclFinalize
comes only at exit, since CANN 8.1.RC1 allows one aclInit per process. Objects of a closed
device raise :class:`~pyacl_moe.errors.ClosedError` on use; closing them does nothing.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

from . import _args, _lifetime
from ._cann import acl
from .errors import ClosedError, InvalidArgument

__all__ = ["Device", "acl_version", "current_device", "device_count", "open_devices", "resolve_device", "soc_name"]


class Queue(Protocol):
    """What a device asks of each of its streams (the stream module provides them)."""

    def shut(self) -> Any: ...

    def close_for_device(self) -> list[BaseException]: ...

    def poll(self) -> None: ...

    def drop_caches(self) -> None: ...

    def after_fork(self) -> None: ...


class _Process:
    """aclInit once per process; the open devices. Guarded by ``lock``."""

    lock = threading.RLock()
    open_devices: dict[int, Device] = {}
    initialized = False  # aclInit done (by us or by someone else in the process)
    owns_init = False  # aclInit done by us: aclFinalize at exit is ours to call


_tls = threading.local()  # .device: the Device this thread last used through pyacl_moe
# .saved: the devices current when this thread's open `with device:` blocks began


def _saved() -> list[Device | None]:
    saved: list[Device | None] | None = getattr(_tls, "saved", None)
    if saved is None:
        saved = _tls.saved = []
    return saved
_closing: set[Device] = set()  # devices whose close() was interrupted before the end


class Device:
    """An Ascend device (NPU), by id.

    ``Device(0)`` returns the process's shared object for device 0, opening it on first use.
    ``with device:`` makes it the calling thread's current device and restores the previous
    one on exit, closing nothing (as CuPy's and torch's device contexts do). ``close()`` waits
    for the device, releases every stream, event and array of it in CANN's order and resets
    it; the next ``Device(0)`` opens it again.
    """

    # Objects that layers above attach to every open device, by name: the stream module
    # attaches the default stream. name -> factory(device).
    attachments: dict[str, Callable[[Device], Any]] = {}
    # Called with the device at the start of close(), before anything is released: caches of
    # layers above (the workspace pool) register here.
    close_hooks: list[Callable[[Device], None]] = []
    # Kinds of holders (with a ``context``) that close() releases before the reset, after the
    # streams: events, memory; the allocator adds its cached-block holder.
    memory_kinds: list[type] = [acl.EventHandle, acl.DeviceMemory, acl.HostMemory]
    # The wait of every stream of a device, with the fault rule (the stream module's):
    # synchronize_hook(device, closing).
    synchronize_hook: Callable[..., None]

    def __new__(cls, device_id: int = 0) -> Device:
        did = _args.int32("device_id", device_id, lo=0)
        with _Process.lock:
            _refuse_after_fork()
            dev = _Process.open_devices.get(did)
            if dev is not None:
                return dev
            dev = super().__new__(cls)
            dev._open(did)
            _Process.open_devices[did] = dev
            return dev

    def _open(self, device_id: int) -> None:
        self._id = device_id
        #: True once the device was closed (or, in a fork() child, inherited). Set once, read
        #: without a lock: a launch that misses it fails in CANN, cleanly.
        self.closed = False
        self._torn_down = False
        self._lock = threading.RLock()  # guards _queues, _attached, _inside
        self._queues: set[Queue] = set()
        # A lock held by each thread inside a CANN call on the device's memory made outside any
        # stream (Device.call): close() waits for each before it frees memory or resets.
        self._inside: dict[threading.Lock, None] = {}
        self._attached: dict[str, Any] = {}
        if not _Process.initialized:
            _Process.owns_init = acl.init()
            _Process.initialized = True
        count = acl.device_count()
        if device_id >= count:
            raise InvalidArgument("device_id", f"must be in [0, {count}): CANN sees {count} device(s), got {device_id}")
        self._ctx = acl.open_device(device_id)
        _tls.device = self

    # -- identity and state

    @property
    def device_id(self) -> int:
        """The device's id, as CANN numbers it."""
        return self._id

    @property
    def context(self) -> acl.Context:
        """The device's default context (a handle of the bindings layer)."""
        return self._ctx

    def __repr__(self) -> str:
        return f"<Device {self._id}{' closed' if self.closed else ''}>"

    def __int__(self) -> int:
        return self._id

    def check_open(self) -> None:
        """Raise ClosedError if the device was closed."""
        if self.closed:
            raise ClosedError(f"device {self._id}", _closed_reason())

    def activate(self) -> None:
        """Make this device current on the calling thread (nothing when it already is)."""
        if self.closed:
            raise ClosedError(f"device {self._id}", _closed_reason())
        acl.use_context(self._ctx)
        _tls.device = self

    def set_current(self) -> Device:
        """Make this device the calling thread's current device; returns self."""
        self.activate()
        return self

    # -- what the device owns

    def attached(self, name: str) -> Any:
        """The object a layer above attached under ``name`` (made on first use)."""
        obj = self._attached.get(name)
        if obj is None:
            with self._lock:
                self.check_open()
                obj = self._attached.get(name)
                if obj is None:
                    obj = self._attached[name] = Device.attachments[name](self)
        return obj

    def attached_if_made(self, name: str) -> Any:
        """The object attached under ``name`` if it was made, else None (never makes one)."""
        return self._attached.get(name)

    @property
    def default_stream(self) -> Any:
        """The device's default Stream (CANN's NULL stream), attached by the stream module."""
        s = self._attached.get("default_stream")
        return s if s is not None and not self.closed else self.attached("default_stream")

    def queues(self) -> list[Queue]:
        """The device's streams (their states), open or finishing."""
        with self._lock:
            return list(self._queues)

    def add_queue(self, q: Queue) -> None:
        """A stream of this device (closed with it)."""
        with self._lock:
            self.check_open()
            self._queues.add(q)

    def remove_queue(self, q: Queue) -> None:
        """A stream of this device that is gone (destroyed, or closed with the device)."""
        with self._lock:
            self._queues.discard(q)

    # -- waiting

    def synchronize(self) -> None:
        """Wait for every stream of the device (aclrtSynchronizeDevice). Raises
        AclRuntimeError for a device fault (e.g. 507015) of its streams' work, once, whichever
        thread's wait CANN reported it to."""
        self.activate()
        Device.synchronize_hook(self)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, a CANN call on the device (a synchronous copy, an allocation) that
        close() on another thread waits for; ClosedError once the device is closed. The call
        holds a lock of its own throughout, which a ``with`` block releases whatever
        interrupts it."""
        inside = threading.Lock()
        with inside:
            with self._lock:
                if self.closed:
                    raise ClosedError(f"device {self._id}", _closed_reason())
                self._inside[inside] = None
            try:
                self.activate()
                return fn(*args)
            finally:
                with self._lock:
                    self._inside.pop(inside, None)

    def reclaim(self) -> None:
        """Drop what completed work held on every stream of the device (never waits)."""
        with self._lock:
            queues = list(self._queues)
        for q in queues:
            q.poll()
        _lifetime.collect()

    def mem_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device's memory (what the process dropped is freed
        first)."""
        _lifetime.collect()
        self.activate()
        return acl.get_mem_info()

    # -- release

    def close(self) -> None:
        """Wait for the device, then release everything it owns in CANN's order (streams,
        events, memory), then reset it. Safe twice. Another thread's call on an object of the
        device completes first or raises ClosedError. Errors from releasing individual objects
        are collected and the first is raised once everything has been released."""
        with _Process.lock:
            if self._torn_down:
                return
            # From here on, new work on the device is refused. Each step below may be repeated,
            # so a close interrupted half-way (KeyboardInterrupt) is finished by the next one
            # (at the latest the exit hook's).
            self.closed = True
            if _lifetime.forked():
                self._torn_down = True
                return
            errors: list[BaseException] = []
            with self._lock:
                inside, self._inside = list(self._inside), {}
            for lk in inside:  # calls on the device's memory in progress end first
                with lk:
                    pass
            for hook in Device.close_hooks:
                try:
                    hook(self)
                except Exception as exc:
                    errors.append(exc)
            with self._lock:
                queues = list(self._queues)
            for q in queues:
                q.shut()  # no new work starts
            ctx = self._ctx
            try:
                acl.use_context(ctx)
                Device.synchronize_hook(self, True)  # queued work still reads what is about to go
            except Exception as exc:
                errors.append(exc)
                try:  # CANN reported the fault and cleared it: the next wait covers what remains
                    acl.synchronize_device()
                except Exception:
                    pass
            with self._lock:
                self._queues.clear()
            for q in queues:
                errors += q.close_for_device()
            for kind in Device.memory_kinds:
                errors += _lifetime.release_where(
                    lambda h, kind=kind: isinstance(h, kind) and h.context is ctx  # type: ignore[misc]
                )
            self._attached.clear()
            if _Process.open_devices.get(self._id) is self:
                del _Process.open_devices[self._id]
            _closing.add(self)  # until torn down: the exit hook finishes an interrupted close
            if getattr(_tls, "device", None) is self:
                _tls.device = None
            if ctx.alive:
                try:
                    _lifetime.unreleased_while(lambda: acl.reset_device(ctx))
                except Exception as exc:
                    errors.append(exc)
            self._torn_down = True
            _closing.discard(self)
            if errors:
                raise errors[0]

    def __enter__(self) -> Device:
        saved = _saved()
        saved.append(getattr(_tls, "device", None))
        try:
            self.activate()
        except BaseException:
            saved.pop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        previous = _saved().pop()
        if previous is None or previous.closed:
            # The thread had no current device (or it was closed meanwhile): the next call
            # without a device picks device 0 again, as before the block.
            _tls.device = None
        else:
            previous.activate()


def _closed_reason() -> str:
    if _lifetime.forked():
        return "CANN does not survive fork(): objects inherited from the parent are dead in the child"
    return "it was closed (Device.close() or interpreter exit)"


def _refuse_after_fork() -> None:
    if _lifetime.forked():
        raise ClosedError(
            "CANN in this process",
            "this is a fork() child of a process that initialized CANN, which does not survive fork(); "
            "start worker processes with multiprocessing's 'spawn' or 'forkserver' method",
        )


def open_devices() -> list[Device]:
    """The devices open now, in id order."""
    with _Process.lock:
        return sorted(_Process.open_devices.values(), key=lambda d: d.device_id)


def current_device() -> Device:
    """The device this thread last used through pyacl_moe, else device 0."""
    dev = getattr(_tls, "device", None)
    if dev is not None and not dev.closed:
        return dev  # type: ignore[no-any-return]
    return Device(0)


def resolve_device(device: Device | int | None, name: str = "device") -> Device:
    """A Device from a Device, an id or None (the current device); ClosedError if closed."""
    if device is None:
        return current_device()
    if isinstance(device, Device):
        device.check_open()
        return device
    if isinstance(device, bool) or not hasattr(device, "__index__"):
        raise InvalidArgument(name, f"must be a Device, a device id or None, got {type(device).__name__}")
    return Device(device)


def device_count() -> int:
    """How many devices CANN sees."""
    _refuse_after_fork()
    return acl.device_count()


def acl_version() -> tuple[int, int, int]:
    """The ACL interface version (aclrtGetVersion): (major, minor, patch)."""
    _refuse_after_fork()
    return acl.get_version()


def soc_name() -> str | None:
    """The SoC name CANN reports (aclrtGetSocName), e.g. 'Ascend910B3'; opens device 0 if no
    device is open yet (which loads and initializes CANN; the call itself needs neither)."""
    current_device()
    return acl.soc_name()


def _daemon_threads_end_quietly() -> None:
    """From the exit on, a daemon thread that the teardown below stops (its next call raises
    ClosedError) ends without a traceback: the interpreter is about to end it anyway, and
    non-daemon threads were joined before atexit ran, so no thread whose work matters is
    silenced. Any other exception, and any thread that is not a daemon, is reported as before."""
    previous = threading.excepthook

    def hook(args: Any) -> None:
        if isinstance(args.exc_value, ClosedError) and args.thread is not None and args.thread.daemon:
            return
        previous(args)

    threading.excepthook = hook


def _close_all_at_exit() -> None:
    """Release every open device in id order, then aclFinalize if this process called aclInit."""
    if _lifetime.forked():
        return
    _daemon_threads_end_quietly()
    with _Process.lock:
        for dev in sorted([*_Process.open_devices.values(), *_closing], key=lambda d: d.device_id):
            try:
                dev.close()
            except Exception as exc:
                # Nobody is left to catch it: a device fault of work never waited for, say.
                # Said once on stderr rather than dropped.
                try:
                    sys.stderr.write(f"pyacl_moe: at exit, closing device {dev.device_id} reported: {exc}\n")
                except Exception:
                    pass
        if _Process.owns_init:
            _Process.owns_init = False
            try:
                acl.finalize()
            except Exception:
                pass


atexit.register(_close_all_at_exit)


def _after_fork_in_child() -> None:
    # A parent thread may have held the locks at fork. If the parent initialized CANN, every
    # device the child inherits is dead (CANN does not survive fork).
    _Process.lock = threading.RLock()
    dead = _lifetime.forked()
    for dev in _Process.open_devices.values():
        dev._lock = threading.RLock()
        if dead:
            dev.closed = True
            for q in dev._queues:
                q.after_fork()  # a parent thread may have held its lock: the child never waits on it
    if dead:
        _Process.open_devices.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
